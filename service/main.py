"""ASGI entry point: `uvicorn service.main:app` (each uvicorn worker process imports it)."""

import gc

from service.app import create_app

app = create_app()

# Everything imported and built so far (FastAPI, SQLAlchemy, pydantic, torch-free but large) lives
# as long as the process: moved out of the collector's sight, a collection no longer walks it. A
# submit spent about 400 us of its ~4.5 ms of CPU in the collector, ~150 us after (bench/findings.md,
# section 4). Only the server entry point does this, not `create_app`, which tests call many times.
gc.collect()
gc.freeze()
