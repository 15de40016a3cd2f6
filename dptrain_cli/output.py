"""How the CLI writes: untrusted text verbatim, JSON for scripts, rich only for what we wrote ourselves.

A job's output, its error message and traceback, a job's name: all come from users' code, so they
are never rich markup (a `[/]` in a traceback would raise MarkupError or hide the lines after it, a
`[link=...]` would inject a link) and never reach the terminal with control characters (escape
sequences could move the cursor or retitle the window). They are written whole, without rich's
wrapping at the terminal width, so a copied log line is the line the job printed.
"""

from __future__ import annotations

import json
import re
import sys
from enum import Enum
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.text import Text

out = Console()
err = Console(stderr=True)

# C0 controls but tab and newline, DEL, and the C1 controls (0x80-0x9f: 0x9b is a one-byte CSI).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Output(str, Enum):
    """`--output`: text for people, json for scripts."""

    text = "text"
    json = "json"


def clean(text: str) -> str:
    """`text` with control characters other than newline and tab removed."""
    return _CONTROL.sub("", text)


def step_text(step: int, total: int | None) -> str:
    """`7/50`, or `7` for a job without a total (a command that set no `hyperparameters.steps`)."""
    return f"{step}/{total}" if total is not None else str(step)


def inert(text: str) -> Text:
    """Untrusted `text` as a rich Text (shown, never parsed as markup), control characters removed."""
    return Text(clean(text))


def say(text: str, *, stderr: bool = False) -> None:
    """Write untrusted `text` and a newline as it is: no markup, no highlighting, no wrapping."""
    stream = sys.stderr if stderr else sys.stdout
    stream.write(clean(text) + "\n")
    stream.flush()


def _plain(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list):
        return [_plain(d) for d in data]
    return data


def emit_json(data: Any, *, lines: bool = False) -> None:
    """`data` (models, lists of them, plain values) as JSON on stdout: indented, or one line (JSONL).

    ASCII only: json escapes every control character then, C1 ones included.
    """
    text = json.dumps(_plain(data), indent=None if lines else 2)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
