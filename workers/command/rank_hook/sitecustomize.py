"""dptrain's start-up hook in a command job's program: record the exception that ends it, as JSON.

workers/sandbox/rank_env.py puts this folder, and nothing else, first on every rank's PYTHONPATH, so each
Python interpreter of a rank imports this module as it starts (site.py's `sitecustomize`). It acts
only where the command wrapper (workers/command/main.py) named a file in DPTRAIN_EXCEPTION_FILE:
the first interpreter that sees the name takes it out of the environment, so the program's own
Python subprocesses (a helper script it runs and whose failure it handles) never write there; a
`sh -c "python train.py"` leaves it to the Python program. Forked children keep the hook but not
the pid it was installed in, and write nothing either.

The hook is the program's sys.excepthook, chaining the one before it: torch's (installed by
init_process_group, which prefixes every line of the traceback with `[rankN]: `) and any the
program sets later that chains ours keep working. A program that replaces sys.excepthook without
chaining, or an interpreter started with -I, -E or -S, skips it: the wrapper then reads torchrun's
error file or the log instead (workers/command/failure.py). threading.excepthook is left alone: an
exception in a thread does not end the program, and naming it would mistype a later exit or signal.

Only the standard library, most of it imported when needed: this runs in every interpreter of every
rank, before the program, and must neither slow it down nor break it (its failures are swallowed).
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import TracebackType

# rank_contract.env.EXCEPTION_FILE_ENV (not imported: nothing of dptrain's is loaded at start-up).
_FILE_ENV = "DPTRAIN_EXCEPTION_FILE"
# The most of a traceback written: the end is what names the failure.
_MAX_TRACEBACK_CHARS = 64 << 10


def _install(path: str) -> None:
    pid = os.getpid()
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() == pid:
            # The program's own exit must go on whatever happens here.
            with contextlib.suppress(Exception):
                _write(path, kind, exc, tb)
        previous(kind, exc, tb)

    sys.excepthook = excepthook


def _write(path: str, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    import json
    import traceback

    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        message = ""
    record = {
        "type": kind.__name__,
        "module": kind.__module__,
        "message": message,
        "traceback": "".join(traceback.format_exception(kind, exc, tb))[-_MAX_TRACEBACK_CHARS:],
        "rank": os.environ.get("RANK"),
        "pid": os.getpid(),
    }
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(partial, path)


def _chain_next_sitecustomize() -> None:
    """Run the `sitecustomize` this one shadows (the job's own, the environment's), as Python would have.

    Python imports only the first `sitecustomize` on sys.path; this one comes first, so the next one
    (say the job's code tree's) is run here and becomes `sitecustomize` in sys.modules. An error in
    it propagates to site.py, which prints "Error in sitecustomize" and goes on, as without dptrain.
    """
    import importlib.util
    from importlib.machinery import PathFinder

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec(__name__, rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if _target := os.environ.pop(_FILE_ENV, None):
        _install(_target)
    _chain_next_sitecustomize()
