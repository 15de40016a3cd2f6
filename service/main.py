"""ASGI entry point: `uvicorn service.main:app`."""

from service.app import create_app

app = create_app()
