"""Server-side commands: api, worker, webhook-worker, migrate and the embedded `up` (`users` is users.py).

Each is an entry point of the group `dptrain.server_commands` (pyproject.toml), by which the `dptrain`
program finds it. Each command imports the server's modules (FastAPI, SQLAlchemy, Celery, torch)
itself: `dptrain --help` lists these commands from this module, and on a client-only install it
must still work, and a command run there must name the extra to install (dptrain_cli/extras.py).
"""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from dptrain.settings import DEFAULT_HOME, HOME_ENV, TOKEN_FILE
from dptrain_cli.extras import installed, require

if TYPE_CHECKING:
    from service.config import Settings

console = Console(stderr=True)

# `up` runs every CPU job of up to this many ranks, however few cores the machine has: ranks
# beyond the cores share them (docs/cluster.md, "dptrain up"). A cluster's `dptrain worker` keeps
# one slot per core.
UP_MIN_SLOTS = 4


def migrate() -> None:
    """Apply database migrations (Alembic, the only source of the schema)."""
    with require("server"):
        from migrations import upgrade
        from service.config import get_settings

    settings = get_settings()
    if settings.is_sqlite:
        Path(settings.home).mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    console.print(f"database at head ({_redact(settings.database_url)})", markup=False, highlight=False)


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
    # `dptrain up`'s worker serves its own operator alone: it may run unsandboxed (with a warning).
    embedded: bool = typer.Option(False, "--embedded", hidden=True),
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
        from workers.node.celery_app import app as celery_app
        from workers.node.heartbeat import node_slots
        from workers.sandbox.bubblewrap import SandboxUnavailable, check_at_start

    try:
        # Probed once, for real, before the worker takes a job: a cluster worker never runs one unsandboxed
        # unless its operator said so.
        warning = check_at_start(settings.sandbox, embedded=embedded)
    except SandboxUnavailable as exc:
        console.print(f"dptrain worker: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if warning:
        console.print(f"dptrain worker: warning: {warning}", markup=False, highlight=False, soft_wrap=True)
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


def webhook_worker(
    # Threads wait on sockets, so many are cheap: with DPTRAIN_WEBHOOK_SENDS_PER_RECEIVER (2), eight
    # receivers may hang at once before another one's delivery waits for a thread.
    concurrency: int = typer.Option(16, help="Deliveries sent at once (threads), to all receivers."),
) -> None:
    """Run the webhook worker: signed POSTs of job state changes, retried with backoff (docs/api.md)."""
    with require("server"):
        from service.config import get_settings
        from service.webhooks.worker import create_app, sweep_thread, worker_argv

    settings = get_settings()
    # Its own process and queue: a slow or dead receiver never takes a thread a node's start needs.
    sweep_thread(settings).start()
    create_app(settings).worker_main(worker_argv(settings, concurrency=concurrency))


def up(
    host: str = "127.0.0.1",
    port: int = 8000,
    slots: int = typer.Option(
        0,
        help=f"CPU rank processes at once (default DPTRAIN_NODE_SLOTS, else the cores, at least "
        f"{UP_MIN_SLOTS}: ranks beyond the cores share them).",
    ),
) -> None:
    """Embedded default: API and one worker, SQLite and a serverless queue under DPTRAIN_HOME."""
    with require("all"):
        from dptrain_server.supervise import API_STOP_SECONDS, WORKER_STOP_SECONDS, Supervisor
        from service.config import get_settings
        from service.files import private_umask, write_private

        # The children import these; a missing one is better named here than in their tracebacks.
        installed("uvicorn", "fastapi", "sqlalchemy", "alembic", "celery", "torch")

    # Before anything is created: the home, its database and the token are this account's alone.
    private_umask()
    # Where the client looks for the token (dptrain/settings.py): one definition for both sides.
    home = Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ[HOME_ENV] = str(home)
    token = os.environ.get("DPTRAIN_BOOTSTRAP_TOKEN")
    token_file = home / TOKEN_FILE
    if not token:
        token = token_file.read_text().strip() if token_file.is_file() else secrets.token_urlsafe(24)
        os.environ["DPTRAIN_BOOTSTRAP_TOKEN"] = token
    write_private(token_file, token + "\n")
    get_settings.cache_clear()
    migrate()
    settings = get_settings()
    cores = os.cpu_count() or 1
    slots = slots or settings.node_slots or max(cores, UP_MIN_SLOTS)
    supervisor = Supervisor()
    # Ranks beyond the cores share them; the worker gives them one thread each
    # (workers/sandbox/rank_setup.py).
    env = dict(os.environ)
    worker_args = ["worker", "--device", "cpu", "--slots", str(slots), "--embedded"]
    # Children stop in the reverse order of their start: the webhook sender first in, last out, so
    # its own shutdown never delays the worker's (whose running jobs go back to the queue at once),
    # and the state changes of that shutdown are in its outbox before it goes.
    supervisor.start("webhooks", ["webhook-worker"], env=env, stop_seconds=WORKER_STOP_SECONDS, restart=True)
    # A worker that dies is started again (its runs are requeued); the API serves on meanwhile.
    supervisor.start("worker", worker_args, env=env, stop_seconds=WORKER_STOP_SECONDS, restart=True)
    api_args = ["api", "--host", host, "--port", str(port)]
    supervisor.start("API", api_args, env=env, stop_seconds=API_STOP_SECONDS)
    _banner(host=host, port=port, home=home, token_file=token_file, slots=slots, settings=settings)
    code = supervisor.run()
    supervisor.reraise()
    raise typer.Exit(code)


def _banner(*, host: str, port: int, home: Path, token_file: Path, slots: int, settings: Settings) -> None:
    # A wildcard address serves every interface; this host reaches it on loopback.
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    token_arg = shlex.quote(str(token_file))
    lines = [
        f"dptrain up: the API and one CPU worker ({slots} rank slots), home {home}",
        f"  dashboard  {url}/  (sign in with the token)",
        f"  token      {token_file}  (the CLI reads it when DPTRAIN_TOKEN is unset)",
        f'  try        curl -H "Authorization: Bearer $(cat {token_arg})" {url}/v1/jobs',
        f"  database   {_redact(settings.database_url)}  broker {_redact(settings.broker_url)}",
        "  stop       Ctrl-C or SIGTERM; running jobs resume from their last checkpoint at the next up",
    ]
    # soft_wrap: a wrapped curl line could not be pasted; no markup: paths may hold brackets.
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
