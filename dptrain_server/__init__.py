"""The server side of the `dptrain` program: api, worker, migrate, up and users.

The `dptrain` program finds these commands by the entry points pyproject.toml registers in the group
`dptrain.server_commands` and loads one only when it is asked for (dptrain_cli/lazy.py): the client
names no module of this package, and its own commands never import it. Its modules import the
server's own (service, workers, FastAPI, Celery, torch) inside the commands, so that a missing extra
is named (dptrain_cli/extras.py) rather than crashing `dptrain --help`.
"""
