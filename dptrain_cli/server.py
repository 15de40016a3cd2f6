"""Server-side commands: api, worker, migrate, and the embedded `up`.

Each command imports the server's modules (FastAPI, SQLAlchemy, Celery, torch) itself, so that the
client commands, which share this `dptrain` program, start without them and run without them
installed (dptrain_cli/extras.py).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from dptrain_cli.extras import installed, require

if TYPE_CHECKING:
    from service.config import Settings

console = Console(stderr=True)


def migrate() -> None:
    """Apply database migrations (Alembic, the only source of the schema)."""
    with require("server"):
        from migrations import upgrade
        from service.config import get_settings

    settings = get_settings()
    if settings.is_sqlite:
        Path(settings.home).mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    console.print(f"[green]database at head[/green] ({_redact(settings.database_url)})")


def api(host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Run the HTTP API (uvicorn)."""
    with require("server"):
        import uvicorn

        from service.config import get_settings

        installed("fastapi", "sqlalchemy")

    uvicorn.run(
        "service.main:app",
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        # A log line per request costs as much CPU as a cached poll itself; request counts and
        # latencies are in /metrics either way. DPTRAIN_ACCESS_LOG=1 turns it back on.
        access_log=get_settings().access_log,
    )


def worker(
    concurrency: int = typer.Option(0, help="Node runs supervised at once (default: its slots)."),
    device: str = typer.Option(
        "auto", help="Which jobs to take: cpu, cuda, or auto (cuda if a GPU is visible)."
    ),
    node_name: str = typer.Option(
        "", help="This node's name (default DPTRAIN_NODE_NAME, else the host name)."
    ),
    address: str = typer.Option("", help="Where other nodes reach this one (default DPTRAIN_NODE_ADDRESS)."),
    slots: int = typer.Option(
        0, help="Rank processes at once (default DPTRAIN_NODE_SLOTS, else GPUs or cores)."
    ),
) -> None:
    """Run a worker node: a Celery worker on this node's own queue, placing and running jobs' ranks."""
    # Options override the environment; the worker's modules read settings once, on import.
    for key, value in (("NODE_NAME", node_name), ("NODE_ADDRESS", address), ("NODE_SLOTS", slots or "")):
        if value:
            os.environ[f"DPTRAIN_{key}"] = str(value)
    with require("worker"):
        from service.config import get_settings

        get_settings.cache_clear()
        settings = get_settings()
        if device == "auto":
            import torch  # only the worker needs torch, and only to look for a GPU

            device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            installed("torch")  # the ranks import it: better said now than at the first job
        if device not in ("cpu", "cuda"):
            raise typer.BadParameter(f"device must be cpu, cuda or auto, not {device!r}")
        from workers.celery_app import app as celery_app
        from workers.heartbeat import node_slots

    celery_app.conf.dptrain_device = device
    threads = concurrency or settings.worker_concurrency or node_slots(settings, device)
    celery_app.worker_main(_worker_argv(settings, threads))


def _worker_argv(settings: Settings, concurrency: int) -> list[str]:
    from service.dispatch import node_queue

    # Placement chose this node: its queue carries only the starts meant for it.
    queue = node_queue(settings.queue, settings.node)
    return [
        "worker",
        "-Q",
        queue,
        "-c",
        str(concurrency),
        "--loglevel",
        "INFO",
        "-n",
        f"dptrain-{settings.node}@%h",
    ]


def up(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Embedded default: API and one worker, SQLite and a serverless queue under DPTRAIN_HOME."""
    with require("all"):
        from service.config import get_settings

        # The children import these; a missing one is better named here than in their tracebacks.
        installed("uvicorn", "fastapi", "sqlalchemy", "alembic", "celery", "torch")

    home = Path(os.environ.get("DPTRAIN_HOME", ".dptrain")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DPTRAIN_HOME"] = str(home)
    token = os.environ.get("DPTRAIN_BOOTSTRAP_TOKEN")
    token_file = home / "token"
    if not token:
        token = token_file.read_text().strip() if token_file.is_file() else secrets.token_urlsafe(24)
        os.environ["DPTRAIN_BOOTSTRAP_TOKEN"] = token
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    get_settings.cache_clear()
    migrate()
    settings = get_settings()
    worker_cmd = [sys.executable, "-m", "dptrain_cli.main", "worker", "--device", "cpu"]
    worker_proc = subprocess.Popen(worker_cmd, env=os.environ.copy())
    console.print(
        f"[bold]dptrain up[/bold] on http://{host}:{port}  home={home}\n"
        f"token: {token_file} (the CLI reads it when DPTRAIN_TOKEN is unset)\n"
        f"database: {_redact(settings.database_url)}  broker: {_redact(settings.broker_url)}"
    )
    threading.Thread(target=_exit_with, args=(worker_proc,), daemon=True, name="worker-watchdog").start()
    try:
        api(host=host, port=port)
    finally:
        _stopping.set()
        worker_proc.terminate()
        try:
            worker_proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker_proc.kill()


def _exit_with(worker_proc: subprocess.Popen[bytes]) -> None:
    """If the embedded worker dies, stop the API too: a service that accepts jobs nobody runs is worse."""
    code = worker_proc.wait()
    if code is not None and not _stopping.is_set():
        console.print(f"[red]the embedded worker exited with {code}; stopping[/red]")
        os.kill(os.getpid(), signal.SIGTERM)


_stopping = threading.Event()


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
