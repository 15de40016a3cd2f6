"""A loader process that fails other than in a sample's read: what the rank raises, and how it learns.

torch's DataLoader meets three such failures of its processes, and reports each in a way that hides
what happened or never ends:

- an exception it catches in a loader process (in its `worker_init_fn` or a fetch) is raised again
  in the rank as "Caught X in DataLoader worker process N. Original Traceback ...", or as a plain
  RuntimeError when X cannot be rebuilt from one string;
- a loader process that dies (a signal, an exit) is reported by the SIGCHLD handler torch installs
  in the rank, as a RuntimeError raised wherever the rank's main thread happens to be;
- a batch that cannot be sent to the rank is only printed, by the loader process's queue feeder
  thread, and dropped: pickling it failed (an object in it that pickle refuses, or the socket
  multiprocessing opens under TMPDIR to pass a tensor's file descriptor: "AF_UNIX path too long"),
  the process lives on, and the rank waits for that batch forever.

Each of the engine's DataLoaders gets a `LoaderWatch` as its `worker_init_fn`. In every loader
process it turns a batch that could not be sent into a report on a pipe to the rank and then ends
the process (every later batch would be lost the same way), so the rank's SIGCHLD handler wakes it
at once. `loader_failure` turns torch's RuntimeErrors into the typed errors below, with a loader's
own report where one came. DataLoader's `timeout` (data.loader_timeout_seconds) bounds what is left:
a loader process alive but stuck. This module imports no torch: main.py uses it on any exception.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.queues
import os
import re
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rank_contract.failures import Failure, named

# A loader process's exit status after it reported a batch it could not send (any non-zero status
# makes torch's SIGCHLD handler raise in the rank; the report says why).
SEND_FAILED_EXIT = 3
# A report must fit one atomic pipe write (PIPE_BUF, 4096 bytes), so that reports of processes
# failing together never interleave.
_REPORT_CHARS = 1500
# How long a rank whose read from a loader process failed waits to see that process dead.
_DEATH_GRACE_S = 2.0


class LoaderProcessError(RuntimeError):
    """A loader process raised outside a sample's read (that is a DataLoadError), or sending its batch.

    Reported under the loader's own exception type (`reported_type`, read by events.describe), so
    the job's error names it and workers/attempt/end.NOT_RETRIED judges it as if the rank had raised
    it: an object pickle refuses (TypeError, PicklingError) fails again on a restart, an OSError may not.
    """

    def __init__(self, reported_type: str, message: str) -> None:
        super().__init__(message)
        self.reported_type = reported_type

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.reported_type, str(self))


@named(Failure.LOADER_PROCESS_DIED)
class LoaderProcessDied(RuntimeError):
    """A loader process ended without an exception: killed by a signal (the OOM killer's) or exited.

    Retried: an OOM kill or a kill from outside need not come again; a dataset that crashes the
    interpreter every time uses up the job's restarts, each ending at once.
    """


@named(Failure.LOADER_TIMEOUT)
class LoaderTimeout(RuntimeError):
    """No batch came from the living loader processes within data.loader_timeout_seconds.

    Retried: a loader stuck on a read (network storage) usually is not stuck the next time.
    """


@dataclass(frozen=True)
class LoaderReport:
    """What a loader process sends to its rank before it ends (plain values: it crosses processes)."""

    worker_id: int
    pid: int
    what: str  # "sending a batch"
    error_type: str
    message: str


# The watches of this process's DataLoaders (a rank has one for training, one for evaluation).
_WATCHES: weakref.WeakSet[LoaderWatch] = weakref.WeakSet()


class LoaderWatch:
    """A DataLoader's `worker_init_fn` and its pipe: loader processes write reports, the rank reads them."""

    def __init__(self) -> None:
        # A plain pipe: what goes through it is a few strings, never a file descriptor, so it needs
        # none of the sockets whose failure it reports.
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._got: list[LoaderReport] = []
        _WATCHES.add(self)

    def __getstate__(self) -> dict[str, Any]:
        # A spawned loader process gets the writing end only (fork, torch's default here, copies all).
        return {"_reader": None, "_writer": self._writer, "_got": []}

    def __call__(self, worker_id: int) -> None:
        """In loader process `worker_id`: report a batch that cannot be sent to the rank, then end."""
        writer = self._writer

        def lost(exc: Exception, obj: object) -> None:
            # Called by the queue's feeder thread for the message `obj` that it failed to pickle or
            # write (multiprocessing's own hook for this, which by default prints and drops it).
            pid = os.getpid()
            print(
                f"loader process {worker_id} (pid {pid}) could not send a batch to its rank:", file=sys.stderr
            )
            traceback.print_exception(exc, file=sys.stderr)
            sys.stderr.flush()
            report = LoaderReport(
                worker_id, pid, "sending a batch", type(exc).__name__, str(exc)[:_REPORT_CHARS]
            )
            with contextlib.suppress(Exception):  # the rank is gone: nobody is left to tell
                writer.send(report)
            os._exit(SEND_FAILED_EXIT)

        # Class-wide, but in this process only: its queues are the ones carrying batches to the rank.
        setattr(multiprocessing.queues.Queue, "_on_queue_feeder_error", staticmethod(lost))  # noqa: B010

    def reports(self) -> list[LoaderReport]:
        """Every report that has come so far, without waiting."""
        with contextlib.suppress(EOFError, OSError):
            while self._reader is not None and self._reader.poll(0):
                self._got.append(self._reader.recv())
        # Kept, not handed out once: when two loader processes fail together, torch reports the
        # second death too, perhaps while the first's error unwinds, and it must be typed the same.
        return list(self._got)


def loader_reports() -> list[LoaderReport]:
    """Every report this process's loader processes have sent, oldest first per loader."""
    return [r for watch in list(_WATCHES) for r in watch.reports()]


# torch's messages (torch/utils/data/dataloader.py, its SIGCHLD handler in C++, torch/_utils.py).
_WRAPPED = re.compile(
    r"Caught (\w+) (in DataLoader worker process (\d+)|in pin memory thread[^.]*)\.\nOriginal "
)
_DIED = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) "
    r"(?:exited unexpectedly(?: with exit code (-?\d+))?|is killed by signal: ([^.]*))"
)
_TIMED_OUT = re.compile(r"DataLoader timed out after ([\d.]+) seconds")
_SIGNAL_NAMES = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}


def loader_failure(
    exc: BaseException,
    *,
    rank: int,
    during: str = "",
    processes: Sequence[Any] = (),
    watch: LoaderWatch | None = None,
) -> BaseException | None:
    """The typed error for `exc` if it is torch's report of a failed loader process, else None.

    Where the caller knows them: `during`, what the rank was doing ("waiting for the batch of step
    7"); `processes`, the loader's processes (multiprocessing's); `watch`, the loader's own watch
    (else the reports of every loader of this process count).
    """
    if isinstance(exc, LoaderProcessError | LoaderProcessDied | LoaderTimeout):
        return None
    text = str(exc)
    when = f"; {during}" if during else ""
    if m := _WRAPPED.match(text):
        name, worker = m.group(1), m.group(3)
        who = f"loader process {worker}" if worker is not None else "pin memory thread"
        return LoaderProcessError(name, f"{_original_message(text, name)} (in rank {rank}'s {who}{when})")
    died, timed_out = _DIED.search(text), _TIMED_OUT.search(text)
    if isinstance(exc, RuntimeError) and (died is not None or timed_out is not None):
        if (reported := _reported(rank, when, watch)) is not None:
            return reported
        if died is not None:
            pids, code, sig = died.group(1), died.group(2), died.group(3)
            # torch's own check names no cause; the process, reaped by that check, tells it.
            told = (
                _dead(processes, rank=rank, during=during, watch=watch, wait=0.0)
                if code is None and sig is None
                else None
            )
            if told is not None:
                return told
            how = (
                _killed_by(sig.strip())
                if sig is not None
                else "exited" + (f" with code {code}" if code else "")
            )
            return LoaderProcessDied(f"rank {rank}'s loader process (pid {pids}) {how}{_comma(during)}")
        assert timed_out is not None
        return LoaderTimeout(
            f"rank {rank} got no batch from its loader processes in {float(timed_out.group(1)):g} s "
            f"(data.loader_timeout_seconds){_comma(during)}: they are alive but sent nothing, stuck in "
            "a read or a lock, or one batch takes longer than that"
        )
    if isinstance(exc, OSError | EOFError) and processes:
        # A batch's tensors come through a socket of the process that made them; when that process
        # dies first, the rank's read fails before torch has noticed the death (it reaps children
        # only now and then): the dead process is the error, not the socket.
        return _dead(processes, rank=rank, during=during, watch=watch)
    return None


def failed_loader(
    exc: BaseException, loader: Any, iterator: Any, *, rank: int, during: str
) -> BaseException | None:
    """The typed error for `exc`, raised by `next(iterator)` of `loader`, if a loader process failed.

    The loader's other processes are ended first: they are of no more use, and one stuck in a read
    would hold torch's shutdown 5 s (which asks each in turn to finish).
    """
    # torch's iterator keeps its processes in `_workers` (none without loader processes).
    processes = getattr(iterator, "_workers", ())
    watch = getattr(loader, "worker_init_fn", None)
    failure = loader_failure(
        exc,
        rank=rank,
        during=during,
        processes=processes,
        watch=watch if isinstance(watch, LoaderWatch) else None,
    )
    if failure is not None:
        end_processes(iterator, processes)
    return failure


def end_processes(iterator: Any, processes: Sequence[Any]) -> None:
    """Terminate a failed loader's processes that still run (each exits quietly on its parent's SIGTERM)."""
    # torch's SIGCHLD handler raises for any registered loader process that dies by a signal, at
    # whatever line the rank is on then (the iterator's own shutdown, say). Unregister them first,
    # as torch's shutdown does before its own terminate, so the deaths asked for here are not errors.
    handling = sys.modules.get("torch.utils.data._utils.signal_handling")  # loaded with any iterator
    if handling is not None and getattr(iterator, "_worker_pids_set", False):
        with contextlib.suppress(Exception):
            handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
    for p in processes:
        with contextlib.suppress(Exception):  # already gone, or never started
            if p.is_alive():
                p.terminate()


def _dead(
    processes: Sequence[Any],
    *,
    rank: int,
    during: str,
    watch: LoaderWatch | None,
    wait: float = _DEATH_GRACE_S,
) -> BaseException | None:
    deadline = time.monotonic() + wait
    while True:
        try:
            for p in processes:
                if p.exitcode is not None:
                    if (reported := _reported(rank, f"; {during}" if during else "", watch)) is not None:
                        return reported
                    code = int(p.exitcode)
                    if code < 0:
                        how = _killed_by(signal.strsignal(-code) or f"signal {-code}")
                    else:
                        how = f"exited with code {code}"
                    return LoaderProcessDied(
                        f"rank {rank}'s loader process (pid {p.pid}) {how}{_comma(during)}"
                    )
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        except RuntimeError as exc:  # torch's SIGCHLD handler, telling the same death
            return loader_failure(exc, rank=rank, during=during, watch=watch)


def _reported(rank: int, when: str, watch: LoaderWatch | None) -> LoaderProcessError | None:
    # A loader process that reported its exception ended right after: the exception is the news.
    if not (reports := watch.reports() if watch is not None else loader_reports()):
        return None
    r = reports[0]
    return LoaderProcessError(
        r.error_type,
        f"{r.message} (in rank {rank}'s loader process {r.worker_id}, pid {r.pid}, {r.what}{when})",
    )


def _killed_by(description: str) -> str:
    how = f"was killed by {_SIGNAL_NAMES.get(description, description)}"
    if description == signal.strsignal(signal.SIGKILL):
        how += " (the kernel's OOM killer sends it when memory runs out)"
    return how


def _comma(during: str) -> str:
    return f", {during}" if during else ""


def _original_message(text: str, name: str) -> str:
    # The wrapped text ends with the loader's traceback; its last block, "Name: message" (the name
    # perhaps dotted, the message perhaps several lines), is what the loader process raised.
    lines = text.rstrip("\n").splitlines()
    head = re.compile(rf"(?:[\w.]+\.)?{re.escape(name)}(?::\s?(.*))?")
    for i in range(len(lines) - 1, 0, -1):
        if (m := head.fullmatch(lines[i])) is not None:
            return "\n".join([m.group(1) or "", *lines[i + 1 :]]).strip()
    return lines[0]
