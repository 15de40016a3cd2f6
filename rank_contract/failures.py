"""Every failure type dptrain names itself: a job error's `type` on the wire, and whether a restart may help.

One home for the names that the node writes (a stall, a deadline, an output cap) and that a rank
reports (the command wrapper's CommandNotFound, the engine's CompileUnavailable): both sides import
this module, stdlib only. A type is declared once, with its retry decision beside it, and every
producer uses the member (or, for an exception class, the class decorated with `named`), so that
renaming a type cannot leave a stale copy of its name in the retry rule (workers/attempt/end.py).

Exceptions that are not ours (ValueError, pydantic's ValidationError, ...) keep their own names and
are judged by them in workers/attempt/end.py.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TypeVar

__all__ = ["Failure", "named"]

E = TypeVar("E", bound=type[BaseException])


class Failure(StrEnum):
    """A failure type of dptrain's own; `retried` is False where a restart would only meet it again."""

    retried: bool

    def __new__(cls, name: str, retried: bool = True) -> Failure:
        member = str.__new__(cls, name)
        member._value_ = name
        member.retried = retried
        return member

    # Not retried: the job's own setup, code or data, which the same attempt meets again.
    # Its checkpoint folder lost a checkpoint the job recorded: never restart silently from scratch.
    CHECKPOINT_MISSING = "CheckpointMissing", False
    # The job's code archive is hostile, damaged or gone (workers/sandbox/code_cache.py).
    UNSAFE_ARCHIVE = "UnsafeArchive", False
    CODE_CORRUPT = "CodeCorrupt", False
    CODE_MISSING = "CodeMissing", False
    # Its command names no program, or one that cannot run (workers/command/main.py).
    COMMAND_NOT_FOUND = "CommandNotFound", False
    COMMAND_NOT_EXECUTABLE = "CommandNotExecutable", False
    # engine.compile's backend cannot run on the worker (no C++ compiler, no Triton).
    COMPILE_UNAVAILABLE = "CompileUnavailable", False
    # A data path outside the data root (or no data root on the worker); a sample the plan's dataset
    # cannot read for a reason other than I/O (DATA_READ_ERROR, an OSError's, is retried).
    DATA_PATH_ERROR = "DataPathError", False
    DATA_LOAD_ERROR = "DataLoadError", False
    # DPTRAIN_OUTPUT_DIR over its limits (workers/attempt/outputs.py): the same script writes as much.
    OUTPUT_TOO_LARGE = "OutputTooLarge", False
    # The checkpoint folder over DPTRAIN_MAX_CHECKPOINT_BYTES_PER_JOB (workers/attempt/checkpoint_cap.py).
    CHECKPOINT_TOO_LARGE = "CheckpointTooLarge", False
    # The init_from checkpoint is gone or not the bytes recorded at submit
    # (workers/attempt/init_checkpoint.py).
    INIT_CHECKPOINT_MISMATCH = "InitCheckpointMismatch", False
    INIT_CHECKPOINT_MISSING = "InitCheckpointMissing", False
    # The job's environment cannot be built, its requirements file is not in the code, or the build
    # wrote past DPTRAIN_MAX_ENV_BYTES (workers/pyenv/): the same requirements meet the same index.
    ENVIRONMENT_BUILD_FAILED = "EnvironmentBuildFailed", False
    REQUIREMENTS_FILE_MISSING = "RequirementsFileMissing", False
    ENVIRONMENT_TOO_LARGE = "EnvironmentTooLarge", False

    # Retried while the job has restarts left: the host, the network or chance, which need not repeat.
    # The launcher itself failed, or the nodes did not all join torchrun's rendezvous.
    LAUNCHER_ERROR = "LauncherError"
    RENDEZVOUS_FAILED = "RendezvousFailed"
    # A rank ended by an exit code or a signal and said nothing of why (workers/command/failure.py).
    PROCESS_EXITED = "ProcessExited"
    PROCESS_KILLED = "ProcessKilled"
    # No rank reported a step or wrote a log line for the job's stall timeout.
    STALLED = "Stalled"
    # The node's pool of uids for ranks is used up, or it cannot sandbox though told to.
    NO_FREE_UID = "NoFreeUid"
    SANDBOX_UNAVAILABLE = "SandboxUnavailable"
    # A sample's read failed with an OSError; a loader process died or sent nothing in time
    # (workers/engine/batch_loader.py, loader_faults.py).
    DATA_READ_ERROR = "DataReadError"
    LOADER_PROCESS_DIED = "LoaderProcessDied"
    LOADER_TIMEOUT = "LoaderTimeout"
    # Its worker died (the reconciler took the attempt back): charged, nobody can tell it from a
    # crash the job provoked.
    WORKER_LOST = "WorkerLost"
    # Its worker was told to stop: requeued whatever the job's budget, not charged (workers/attempt/end.py).
    WORKER_STOPPED = "WorkerStopped"

    # Ending the job wherever they arise, never asked about a restart.
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # A stored spec the current JobSpec refuses; a stored error body that is not a JobError
    # (service/jobs/stored.py).
    INVALID_SPEC = "InvalidSpec"
    INVALID_ERROR = "InvalidError"


def named(failure: Failure) -> Callable[[E], E]:
    """Declare an exception class as `failure`, which its class name is on the wire; refuse another name.

    A rank reports an exception by its class name (workers/engine/events.py): renaming the class
    would otherwise change the type the job fails with, and with it the retry decision.
    """

    def check(cls: E) -> E:
        if cls.__name__ != failure.value:
            raise TypeError(
                f"{cls.__qualname__} is declared as failure type {failure.value!r}: rename one of them"
            )
        return cls

    return check
