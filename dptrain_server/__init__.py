"""The server side of the `dptrain` program: api, worker, migrate, up and users.

`dptrain_cli.main` loads this package only when one of these commands is asked for, so the client
commands never import it. Its modules import the server's own (service, workers, FastAPI, Celery,
torch) inside the commands, so that a missing extra is named (dptrain_cli/extras.py) rather than
crashing `dptrain --help`.
"""
