"""One rank of a command job: run the user's own program, log its output, report how it ended.

    python -m torch.distributed.run --standalone --nproc-per-node N -m workers.command.main \
        --job-id J --on-node NODE --run-dir RUN_DIR -- python train.py --epochs 1

The job id stays on this wrapper's command line, where procs.rank_processes finds it; the user's
program, its child, runs in the wrapper's process group, which procs.sweep_ranks kills whole.
The program reports through the SDK (`import dptrain`) itself; this wrapper adds what only an
outside observer can tell: its exit, as an error event when it failed, typed by the exception that
ended the program wherever one can be found (workers/command/failure.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

from rank_contract.env import SUPERVISOR_ENV
from rank_contract.failures import Failure
from rank_contract.layout import RunFiles
from rank_contract.stacks import await_dump, collective_timed_out
from workers.command.args import expand_command
from workers.command.clean_end import after_finish
from workers.command.failure import failure, program_env
from workers.engine.events import ErrorEvent, EventWriter
from workers.engine.process import default_signals, own_session, redirect_output, supervisor_id

# Signals a rank may get directly rather than through its group; the wrapper passes them on.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class Args:
    """The wrapper's command line: its own options, then the program after `--`."""

    job_id: str
    node: str
    run_dir: Path
    command: list[str]


def parse_args(argv: Sequence[str]) -> Args:
    """Split `--job-id J [--on-node N] --run-dir R -- CMD...` (the program's own options untouched)."""
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("usage: workers.command.main --job-id J [--on-node N] --run-dir R -- CMD [ARG...]")
    cut = argv.index("--")
    opts = dict(zip(argv[:cut:2], argv[1:cut:2], strict=True))
    unknown = set(opts) - {"--job-id", "--on-node", "--run-dir"}
    if unknown or "--job-id" not in opts or "--run-dir" not in opts:
        raise SystemExit(f"workers.command.main: bad options {argv[:cut]}")
    return Args(opts["--job-id"], opts.get("--on-node", ""), Path(opts["--run-dir"]), argv[cut + 1 :])


def program(command: Sequence[str]) -> list[str]:
    """The argv to start: a leading `python`/`python3` is this interpreter (it has torch and the SDK)."""
    cmd = list(command)
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    return cmd


def watch_supervisor_group(value: str | None, *, interval: float = 1.0) -> threading.Thread | None:
    """SIGKILL this process's whole group (the program too) as soon as the supervisor `value` is gone.

    Like process.watch_supervisor, but an exit of the wrapper alone would leave the program
    training on, beside the next attempt.
    """
    if not value or ":" not in value or not os.path.isdir("/proc"):
        return None
    pid = int(value.split(":", 1)[0])

    def watch() -> None:
        # Same pid and start time: the same process (supervisor_id reads "pid:None" once it is gone).
        while supervisor_id(pid) == value:
            time.sleep(interval)
        print(f"supervisor {pid} is gone: this rank and its program are killed", file=sys.stderr, flush=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="dptrain-supervisor-watch", daemon=True)
    thread.start()
    return thread


def _end(events: EventWriter, event: ErrorEvent | None, code: int) -> NoReturn:
    if event is not None:
        events.emit(event)
    events.close()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the program as this rank; exit with its code (128+N if signal N killed it)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    default_signals()
    own_session()  # a no-op under torchrun, which already starts each rank as a session leader
    rank = int(os.environ.get("RANK", "0"))
    files = RunFiles(args.run_dir)
    log_path = files.rank_log(rank)
    # The program inherits fds 1 and 2: its output, and the wrapper's own words, go to the rank's log.
    redirect_output(log_path)
    events = EventWriter(files.rank_events(rank), rank)
    watch_supervisor_group(os.environ.get(SUPERVISOR_ENV))
    cmd = program(expand_command(args.command, os.environ))
    try:
        # In this process group (no new session): killing the group, as torchrun and the
        # supervisor watch do, takes the program and whatever it started with it.
        child = subprocess.Popen(cmd, env=program_env(args.run_dir, rank))
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        message = f"{'command not found' if missing else 'cannot run'}: {cmd[0]} ({exc.strerror})"
        print(f"dptrain: rank {rank}: {message}", file=sys.stderr)
        kind = Failure.COMMAND_NOT_FOUND if missing else Failure.COMMAND_NOT_EXECUTABLE
        _end(events, ErrorEvent(rank=rank, error_type=kind, message=message), 127 if missing else 126)

    def forward(signum: int, _frame: FrameType | None) -> None:
        # A signal to the whole group reaches the program twice (once from here); the first one
        # decides, as Python's default handlers and most scripts' own exit at once.
        if child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    returncode = child.wait()  # resumed after each forwarded signal (PEP 475)
    if (clean := after_finish(args.run_dir, rank, returncode)) is not None:
        print(f"dptrain: {clean.message}", file=sys.stderr)
        events.emit(clean)
        returncode = 0
    if returncode == 0:
        _end(events, None, 0)
    code = 128 - returncode if returncode < 0 else returncode  # a shell's code for a killed program
    failed = failure(rank, returncode, run_dir=args.run_dir, log_path=log_path)
    if collective_timed_out(failed.message):
        # Alive, this wrapper keeps torchrun from tearing down the other ranks until the worker has
        # read where they hang (rank_contract/stacks.py).
        events.emit(failed)
        await_dump(args.run_dir)
        _end(events, None, code)
    _end(events, failed, code)


if __name__ == "__main__":
    main()
