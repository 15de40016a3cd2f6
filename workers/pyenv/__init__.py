"""Per-job Python environments (not environment variables): their key, cache, build and setup."""
