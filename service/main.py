"""ASGI entry point: `uvicorn service.main:app` (each uvicorn worker process imports it)."""

import gc

from service.app import create_app
from service.files import private_umask

# The API process's files (an upload's archive and its folders, the embedded database) are its own:
# set here, where every API process starts, not in `create_app`, which tests call in their process.
private_umask()
app = create_app()

# Everything imported and built so far (FastAPI, SQLAlchemy, pydantic, torch-free but large) lives
# as long as the process: frozen out of the collector's sight, no collection walks it again, and a
# request's garbage collections walk only what the request allocated. Only the
# server entry point does this, not `create_app`, which tests call many times.
gc.collect()
gc.freeze()
