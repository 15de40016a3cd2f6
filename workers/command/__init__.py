"""The rank side of a command job, run inside the sandbox: the wrapper around the user's program."""
