"""The environment the worker sets for the ranks: every variable name, defined once.

Torch-free and cheap to import: the Celery worker's runner builds the environment from these; the
ranks' SDK (`dptrain`), the command wrapper (`workers.command.main`) and the engine read it.
"""

from __future__ import annotations

import os

__all__ = [
    "ALLOWED_ENTRYPOINTS_ENV",
    "ATTEMPT_ENV",
    "CHECKPOINT_DIR_ENV",
    "CODE_DIR_ENV",
    "DATA_ROOT_ENV",
    "EXCEPTION_FILE_ENV",
    "INIT_CHECKPOINT_ENV",
    "JOB_ID_ENV",
    "KEEP_LAST_ENV",
    "OUTPUT_DIR_ENV",
    "RUN_DIR_ENV",
    "SUPERVISOR_ENV",
    "sdk_env",
]

JOB_ID_ENV = "DPTRAIN_JOB_ID"
ATTEMPT_ENV = "DPTRAIN_ATTEMPT"
# Per attempt and node: events/ and logs/ live here. Its presence is what makes the SDK active.
RUN_DIR_ENV = "DPTRAIN_RUN_DIR"
# Per job, shared by its attempts, on storage every node sees: all ranks load from it.
CHECKPOINT_DIR_ENV = "DPTRAIN_CHECKPOINT_DIR"
KEEP_LAST_ENV = "DPTRAIN_KEEP_LAST"
# Per job, kept across its attempts, on the storage the checkpoints use: what rank 0 writes here
# becomes the job's artifacts (listed and downloadable); every rank may read it, so a script with its
# own resume logic finds what an earlier attempt saved.
OUTPUT_DIR_ENV = "DPTRAIN_OUTPUT_DIR"
# The operator's read-only data root on this worker (its own setting, passed to every rank): data
# paths of a spec are relative to it (rank_contract.data.data_path).
DATA_ROOT_ENV = "DPTRAIN_DATA_ROOT"
# "pid:start time" of the process supervising the ranks (the worker's runner). Each rank exits when
# it is gone: ranks of a SIGKILLed worker must not train on, writing checkpoints beside the next
# attempt's, and torchrun runs in a session of its own, so the worker's death does not reach them.
# workers.engine.process writes and watches the value.
SUPERVISOR_ENV = "DPTRAIN_SUPERVISOR"
# The unpacked code tree of a job with uploaded code: an entrypoint's module must come from there.
CODE_DIR_ENV = "DPTRAIN_CODE_DIR"
# The checkpoint file the job's spec names in `init_from` (pinned under the job's folder, verified
# by the worker, read-only in the sandbox); set only while the job has no checkpoint of its own.
# The engine starts from it, and `dptrain.load_checkpoint()` returns it, when CHECKPOINT_DIR is empty.
INIT_CHECKPOINT_ENV = "DPTRAIN_INIT_CHECKPOINT"
# The worker's own setting, passed through to the ranks: the module prefixes an entrypoint may name
# when the job uploaded no code (the engine checks it again where the code runs).
ALLOWED_ENTRYPOINTS_ENV = "DPTRAIN_ALLOWED_ENTRYPOINTS"
# Set by the command wrapper (workers/command/main.py) for its program alone: where dptrain's
# start-up hook in the program's interpreter (workers/command/rank_hook/sitecustomize.py) writes the
# exception that ended it, as JSON (type, message, traceback, rank).
EXCEPTION_FILE_ENV = "DPTRAIN_EXCEPTION_FILE"


def sdk_env(
    *,
    job_id: str,
    attempt: int,
    run_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    keep_last: int,
    supervisor: str | None,
    code_dir: str | os.PathLike[str] | None = None,
    data_root: str | os.PathLike[str] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    init_checkpoint: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """Every variable dptrain itself sets for the ranks of one node of one attempt.

    `supervisor` is None where the ranks cannot see the worker's pid (in the sandbox's PID namespace,
    whose --die-with-parent does that watch's work); `code_dir` and `data_root` only when the job has
    uploaded code and the worker a data root; `output_dir` is the job's (the worker always sets it);
    `init_checkpoint` only while the job starts from its `init_from` checkpoint.
    """
    env = {
        JOB_ID_ENV: job_id,
        ATTEMPT_ENV: str(attempt),
        RUN_DIR_ENV: os.fspath(run_dir),
        CHECKPOINT_DIR_ENV: os.fspath(checkpoint_dir),
        KEEP_LAST_ENV: str(keep_last),
    }
    optional = {
        SUPERVISOR_ENV: supervisor,
        CODE_DIR_ENV: code_dir,
        DATA_ROOT_ENV: data_root,
        OUTPUT_DIR_ENV: output_dir,
        INIT_CHECKPOINT_ENV: init_checkpoint,
    }
    env |= {name: os.fspath(value) for name, value in optional.items() if value is not None}
    return env
