"""The optional parts of dptrain a command needs: a missing one is named, with the pip line that adds it.

The client commands (submit, list, logs, ...) need none of them, so the server's modules are imported
only inside the commands that run a server (dptrain_server/): `api`, `migrate` and `users` need
`dptrain[server]`, `worker` needs `dptrain[worker]`, and `up`, which runs both, `dptrain[all]`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

# dptrain's own top-level packages: an ImportError naming one of them is a bug, not a missing extra.
OURS = frozenset(
    {
        "api_schemas",
        "dptrain",
        "dptrain_cli",
        "dptrain_server",
        "migrations",
        "rank_contract",
        "service",
        "workers",
    }
)
EXIT_MISSING = 1

err = Console(stderr=True)


@contextmanager
def require(extra: str) -> Iterator[None]:
    """Turn an ImportError of a third-party module inside into the pip line of `extra`, and exit 1."""
    try:
        yield
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if not missing or missing in OURS:
            raise
        raise missing_extra(extra, str(exc)) from exc


def missing_extra(extra: str, why: str) -> typer.Exit:
    """Say that this command needs dptrain[`extra`] (because of `why`) and the pip line; the exit to raise."""
    # markup=False: `dptrain[server]` would otherwise read as a rich style tag.
    err.print(
        f"this command needs dptrain[{extra}]: {why}\n  pip install 'dptrain[{extra}]'",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return typer.Exit(EXIT_MISSING)


def installed(*modules: str) -> None:
    """Raise ModuleNotFoundError for the first of `modules` that is not installed, importing none of them."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
