"""One node's part of an attempt, in the node process: accepted, launched, watched, ended."""
