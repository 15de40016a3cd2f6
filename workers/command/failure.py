"""Why a command job's rank failed: the exception that ended its program, from the best channel there is.

In order, the first that answers:

1. dptrain's start-up hook in the program's interpreter (workers/command/rank_hook/sitecustomize.py): the
   uncaught exception's type, message and traceback, as JSON in rank_contract.layout's RunFiles.exception;
2. torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE), written by a program whose entry point
   carries torch.distributed.elastic.multiprocessing.errors.record (the hook can be missing: an
   interpreter started with -I, -E or -S, a program that replaced sys.excepthook without chaining
   it);
3. the traceback at the end of the rank's log, torch's `[rankN]: ` prefixes taken off, or the
   header-less report of a SyntaxError in the main file (a Python program started by a shell script
   after another Python program took the hook's file, a hook that could not write);
4. how the program ended: ProcessKilled (a signal) or ProcessExited (an exit code, sys.exit(3)).

What is retried then depends on the type alone: workers.attempt.end.is_retryable.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rank_contract.env import EXCEPTION_FILE_ENV
from rank_contract.failures import Failure
from rank_contract.files import read_file
from rank_contract.layout import RunFiles
from workers.engine.events import TRACEBACK_TAIL_LINES, ErrorEvent

# torchrun's variable for a rank's error file (torch.distributed.elastic's ErrorHandler).
TORCHELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# How much of the log's end is read for the traceback (40 lines of a traceback fit easily).
_TAIL_BYTES = 64 << 10
# The most of an error file read: the program wrote it, and may have written anything.
_MAX_FILE_BYTES = 1 << 20
_MAX_MESSAGE_CHARS = 2000
# The line that ends a Python traceback: `ValueError: bad`, `torch.OutOfMemoryError: ...`, `KeyboardInterrupt`
# (dotted names are shortened to the class's, as the engine's error events name it).
_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*)(?::\s?(.*))?")
# What torch's sys.excepthook puts before every line of a traceback after init_process_group.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_TRACEBACK_HEADER = "Traceback (most recent call last):"
# A frame's location: `  File "train.py", line 7, in <module>`, or a SyntaxError's `  File "x.py", line 3`.
_FRAME = re.compile(r'\s+File "([^"]*)", line (\d+)')
# What Python prints, with no Traceback header, for a file it cannot compile: the main file's error.
_COMPILE_ERRORS = ("SyntaxError", "IndentationError", "TabError")


@dataclass(frozen=True)
class Raised:
    """An exception that ended a program: its class's name, message and formatted traceback."""

    type: str
    message: str
    traceback: str | None = None


def log_tail(path: Path, lines: int = TRACEBACK_TAIL_LINES) -> list[str]:
    """The last `lines` lines of the rank's log (empty if there is none)."""
    data = read_file(path, limit=_TAIL_BYTES, from_end=True)
    return data.decode("utf-8", errors="replace").splitlines()[-lines:] if data else []


def _read_json(path: Path | str | None) -> Any:
    # The program wrote it (and may have put a link, a FIFO or a device there instead): a regular
    # file only, opened without following a link or waiting on a FIFO, and read within a bound.
    data = read_file(path, limit=_MAX_FILE_BYTES) if path else None
    try:
        return json.loads(data) if data is not None else None
    except ValueError:  # cut short or not JSON: another channel answers
        return None


def _type_name(value: object) -> str | None:
    """A class name from a file the program wrote (the last part of a dotted one), None if it is none."""
    if isinstance(value, str) and (m := _EXCEPTION_LINE.fullmatch(value.strip())) and not m.group(2):
        return m.group(1).rsplit(".", 1)[-1]
    return None


def from_hook_file(path: Path) -> Raised | None:
    """What dptrain's start-up hook recorded in `path`, None if it recorded nothing usable."""
    data = _read_json(path)
    if not isinstance(data, dict) or (kind := _type_name(data.get("type"))) is None:
        return None
    message, tb = data.get("message"), data.get("traceback")
    return Raised(kind, message if isinstance(message, str) else "", tb if isinstance(tb, str) else None)


def from_torchelastic_file(path: str | None) -> Raised | None:
    """What torch's @record wrote to the rank's TORCHELASTIC_ERROR_FILE, None if nothing usable.

    Its format (torch/distributed/elastic/multiprocessing/errors/error_handler.py):
    {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback ...", ...}}};
    a plain string in "message" is the newer format, without the call stack.
    """
    data = _read_json(path)
    body = data.get("message") if isinstance(data, dict) else None
    if isinstance(body, dict):
        text, extra = body.get("message"), body.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    else:
        text, stack = body, None
    if not isinstance(text, str):
        return None
    kind, _, message = text.partition(": ")
    if (name := _type_name(kind)) is None:
        return None
    return Raised(name, message, stack if isinstance(stack, str) else None)


def from_log(tail: Sequence[str]) -> Raised | None:
    """The last exception reported in a rank's log `tail`, None if it holds none.

    Understands torch's `[rankN]: ` line prefixes, and a SyntaxError (IndentationError, TabError)
    in the main file, which Python prints as `  File "x.py", line 3`, the line, a caret, and
    `SyntaxError: ...`, without a Traceback header.
    """
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in tail]
    found: tuple[int, int] | None = None  # (where the report starts, where its exception line is)
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK_HEADER)]
    if starts:
        # The frames are indented; the first line after them that is not names the exception.
        for j in range(starts[-1] + 1, len(lines)):
            line = lines[j]
            if line and not line[0].isspace() and _EXCEPTION_LINE.fullmatch(line.rstrip()):
                found = (starts[-1], j)
                break
    for j in range(len(lines) - 1, found[1] if found else -1, -1):
        if lines[j].startswith(tuple(f"{name}:" for name in _COMPILE_ERRORS)):
            start = j
            while start > 0 and lines[start - 1][:1].isspace():
                start -= 1
            if start < j and _FRAME.match(lines[start]):
                found = (start, j)
            break
    if found is None:
        return None
    start, end = found
    m = _EXCEPTION_LINE.fullmatch(lines[end].rstrip())
    assert m is not None  # noqa: S101 - matched above
    return Raised(m.group(1).rsplit(".", 1)[-1], m.group(2) or "", "\n".join(lines[start : end + 1]))


def _where(tb: str | None) -> str:
    """`code (file, line N)` of the last frame of `tb`: what names a bare `assert` that failed."""
    lines = (tb or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if m := _FRAME.match(lines[i]):
            # The frame's source line is indented deeper than the frame's own; `-c` code has none.
            after = lines[i + 1] if i + 1 < len(lines) else ""
            code = after.strip() if after.startswith("    ") and not _FRAME.match(after) else ""
            place = f"{os.path.basename(m.group(1))}, line {m.group(2)}"
            return f"{code} ({place})" if code else place
    return ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return f"signal {signum}"


def program_env(run_dir: Path, rank: int) -> dict[str, str]:
    """The program's environment: the rank's, unbuffered, and where dptrain's hook records its exception."""
    path = RunFiles(run_dir).exception(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONUNBUFFERED": "1", EXCEPTION_FILE_ENV: str(path)}


def failure(rank: int, returncode: int, *, run_dir: Path, log_path: Path) -> ErrorEvent:
    """The error event of rank `rank`'s program that exited with `returncode` (negative: by that signal)."""
    log = log_tail(log_path)
    raised = (
        from_hook_file(RunFiles(run_dir).exception(rank))
        or from_torchelastic_file(os.environ.get(TORCHELASTIC_ERROR_FILE_ENV))
        or from_log(log)
    )
    return error_event(rank, returncode, raised=raised, log=log)


def error_event(rank: int, returncode: int, *, raised: Raised | None, log: Sequence[str]) -> ErrorEvent:
    """The error event of `raised`, or where the program raised nothing that was found, of how it ended."""
    if raised is not None:
        message = raised.message.strip() or _where(raised.traceback)
        # The exception's own traceback; the log's tail where there is none (a file without one).
        tb = "\n".join((raised.traceback or "").splitlines()[-TRACEBACK_TAIL_LINES:]) or "\n".join(log)
        return ErrorEvent(
            rank=rank, error_type=raised.type, message=message[:_MAX_MESSAGE_CHARS], traceback=tb or None
        )
    if returncode < 0:
        kind, message = Failure.PROCESS_KILLED, f"rank {rank} was killed by {_signal_name(-returncode)}"
    else:
        kind, message = Failure.PROCESS_EXITED, f"rank {rank} exited with code {returncode}"
    return ErrorEvent(rank=rank, error_type=kind, message=message, traceback="\n".join(log) or None)
