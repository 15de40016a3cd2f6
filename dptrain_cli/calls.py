"""How every client command calls the API: refusals become exit code 3, with their reasons on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import typer

from dptrain.client import Client
from dptrain.errors import ApiError, Refused
from dptrain_cli.output import Output, emit_json, say

EXIT_SUCCEEDED, EXIT_FAILED, EXIT_TIMEOUT, EXIT_REFUSED, EXIT_CANCELLED, EXIT_UNPLACEABLE = 0, 1, 2, 3, 4, 5
OUTPUT = typer.Option(Output.text, "--output", help="text for people, json for scripts.")

T = TypeVar("T")


def refused(exc: ApiError) -> typer.Exit:
    """Print why the API refused, field by field where it said; the exit for it."""
    if isinstance(exc, Refused) and exc.errors:
        for e in exc.errors:
            say(f"{e.path}: {e.msg}", stderr=True)
    else:
        say(f"refused ({exc.status_code}): {exc.detail}", stderr=True)
    return typer.Exit(EXIT_REFUSED)


@contextmanager
def api() -> Iterator[Client]:
    """The client, with the API's refusals turned into exit code 3 and their reasons on stderr."""
    client = Client.from_env()
    try:
        yield client
    except ApiError as exc:
        raise refused(exc) from exc
    finally:
        client.close()


def fetch(output: Output, call: Callable[[Client], T]) -> T | None:
    """What `call` reads through the API; with --output json it is printed here and None returned."""
    with api() as client:
        result = call(client)
    if output is Output.json:
        emit_json(result)
        return None
    return result
