"""`dptrain users`: manage users from the server host, straight in the database (no token needed)."""

from __future__ import annotations

import typer
from rich.console import Console

from service.config import get_settings
from service.db import session_factory
from service.errors import ServiceError
from service.users import service

app = typer.Typer(no_args_is_help=True, help="Users and tokens, from the server host (database access).")
out = Console()
err = Console(stderr=True)


def _refuse(exc: ServiceError) -> typer.Exit:
    err.print(f"[red]{type(exc).__name__}[/red]: {exc.message}")
    return typer.Exit(1)


@app.command()
def create(name: str, admin: bool = typer.Option(False, "--admin", help="An admin sees every job.")) -> None:
    """Create a user and print its token; it is shown this once (only its hash is stored)."""
    try:
        with session_factory(get_settings()).begin() as session:
            issued = service.create(session, name=name, admin=admin)
    except ServiceError as exc:
        raise _refuse(exc) from exc
    err.print(f"created {'admin' if admin else 'user'} {name}; its token (not shown again):")
    out.print(issued.token, markup=False, highlight=False)


@app.command()
def token(name: str) -> None:
    """Issue another token for a user and print it once."""
    try:
        with session_factory(get_settings()).begin() as session:
            issued = service.issue_token(session, actor=None, name=name)
    except ServiceError as exc:
        raise _refuse(exc) from exc
    out.print(issued.token, markup=False, highlight=False)


@app.command()
def revoke(name: str) -> None:
    """Revoke every token of a user at once."""
    try:
        with session_factory(get_settings()).begin() as session:
            n = service.revoke_tokens(session, actor=None, name=name)
    except ServiceError as exc:
        raise _refuse(exc) from exc
    out.print(f"revoked {n} token(s) of {name}")
