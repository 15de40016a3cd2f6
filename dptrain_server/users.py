"""`dptrain users`: manage users from the server host, straight in the database (no token needed).

The server's modules are imported when a command runs, not with this module, which `dptrain --help`
loads on a client-only install too (dptrain_cli/extras.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from api_schemas import MAX_PRIORITY
from dptrain_cli.extras import require

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from service.config import Settings

app = typer.Typer(no_args_is_help=True, help="Users and tokens, from the server host (database access).")
out = Console()
err = Console(stderr=True)
T = TypeVar("T")


def _service() -> ModuleType:
    with require("server"):
        from service.users import service
    return service


def session_factory(settings: Settings) -> sessionmaker[Session]:
    """The server database's sessions."""
    with require("server"):
        from service.db import session_factory as factory
    return factory(settings)


def _in_db(work: Callable[[Session], T]) -> T:
    # One transaction in the server's database; a refusal of the service exits 1 with its reason.
    with require("server"):
        from service.config import get_settings
        from service.errors import ServiceError
    try:
        with session_factory(get_settings()).begin() as session:
            return work(session)
    except ServiceError as exc:
        err.print(f"[red]{type(exc).__name__}[/red]: {escape(exc.message)}")
        raise typer.Exit(1) from exc


_CAN_RUN_CODE = "May upload code and run jobs with an entrypoint or a command (admins always may)."


@app.command()
def create(
    name: str,
    admin: bool = typer.Option(False, "--admin", help="An admin sees every job."),
    can_run_code: bool = typer.Option(False, "--can-run-code", help=_CAN_RUN_CODE),
) -> None:
    """Create a user and print its token; it is shown this once (only its hash is stored)."""
    issued = _in_db(lambda s: _service().create(s, name=name, admin=admin, can_run_code=can_run_code))
    may = " who may run code" if can_run_code and not admin else ""
    err.print(f"created {'admin' if admin else 'user'} {escape(name)}{may}; its token (not shown again):")
    out.print(issued.token, markup=False, highlight=False)


@app.command()
def token(name: str) -> None:
    """Issue another token for a user and print it once."""
    with require("server"):
        from service.config import get_settings
    cap = get_settings().max_tokens_per_user
    issued = _in_db(lambda s: _service().issue_token(s, actor=None, name=name, max_tokens=cap))
    out.print(issued.token, markup=False, highlight=False)


@app.command()
def revoke(name: str) -> None:
    """Revoke every token of a user at once."""
    n = _in_db(lambda s: _service().revoke_tokens(s, actor=None, name=name))
    out.print(f"revoked {n} token(s) of {escape(name)}")


@app.command()
def grant(
    name: str,
    can_run_code: bool | None = typer.Option(
        None, "--can-run-code/--no-can-run-code", help=f"{_CAN_RUN_CODE} Left out: unchanged."
    ),
    max_priority: int | None = typer.Option(
        None,
        "--max-priority",
        min=0,
        max=MAX_PRIORITY,
        help="The highest job priority they may submit (default 0).",
    ),
) -> None:
    """Change what an existing user may do, and print what they may do now."""
    info = _in_db(
        lambda s: _service().grant(
            s, actor=None, name=name, can_run_code=can_run_code, max_priority=max_priority
        )
    )
    may = "may" if info.can_run_code or info.admin else "may not"
    ceiling = MAX_PRIORITY if info.admin else info.max_priority
    out.print(f"{escape(name)} {may} run code, up to priority {ceiling}{' (an admin)' if info.admin else ''}")
