"""Where a job's files live under the artifact root: every folder and file name, defined once.

    <artifact root>/
      code/<sha256>.tar.gz              uploaded code archives (service.code)
      jobs/<job id>/                    one folder per job
        checkpoints/ckpt-<step>.pt      DPTRAIN_CHECKPOINT_DIR, shared by the job's attempts
        outputs/                        DPTRAIN_OUTPUT_DIR: what the job keeps, its artifacts
        init/ckpt-<step>.pt             the `init_from` checkpoint pinned at submit (read-only to ranks)
        attempt-<n>/node-<r>/           DPTRAIN_RUN_DIR of node r of attempt n (`RunFiles`)
          spec.json  torchrun.pid  stop  stacks-taken
          logs/rank<k>.log  logs/launcher.log  logs/setup.log
          events/rank<k>.jsonl  exceptions/rank<k>.json  finished/rank<k>
          work/  tmp/  home/            the ranks' scratch, removed when the attempt ends

The API (downloads, `init_from` pins, code uploads), the worker and the ranks (the engine, the SDK,
the command wrapper) all build these paths here, so a job's files are found wherever they are
looked for. The names inside the checkpoint folder are the checkpoint format's
(`rank_contract.checkpoints`, `workers.engine.checkpoint`). A rank knows only its run directory
(DPTRAIN_RUN_DIR), so `RunFiles` stands on its own. Standard library only: the ranks import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rank_contract.checkpoints import checkpoint_name

__all__ = [
    "EVENTS_FOLDER",
    "EVENTS_GLOB",
    "LOGS_FOLDER",
    "LOGS_GLOB",
    "NAMES",
    "JobFiles",
    "RunFiles",
    "code_archive",
    "code_folder",
    "rank_of",
]

_CODE = "code"
_JOBS = "jobs"
_CHECKPOINTS = "checkpoints"
_OUTPUTS = "outputs"
_INIT = "init"
_ATTEMPT_PREFIX, _NODE_PREFIX = "attempt-", "node-"
_SPEC = "spec.json"
_PID = "torchrun.pid"
_STOP = "stop"
_STACKS_TAKEN = "stacks-taken"
LOGS_FOLDER = "logs"
EVENTS_FOLDER = "events"
_EXCEPTIONS = "exceptions"
_FINISHED = "finished"
_LAUNCHER_LOG = "launcher.log"
_SETUP_LOG = "setup.log"
_WORK, _TMP, _HOME = "work", "tmp", "home"
# What the worker reads in `logs/` and `events/`: every log file (with no rank: the launcher's and
# the environment build's), the ranks' event files.
LOGS_GLOB, EVENTS_GLOB = "*.log", "rank*.jsonl"
_RANK_FILE = re.compile(r"rank(\d+)\.")

# Every fixed name above: tests/test_architecture.py refuses them in path-building code elsewhere.
NAMES = frozenset({
    _CODE, _JOBS, _CHECKPOINTS, _OUTPUTS, _INIT, _SPEC, _PID, _STOP, _STACKS_TAKEN, LOGS_FOLDER,
    EVENTS_FOLDER, _EXCEPTIONS, _FINISHED, _LAUNCHER_LOG, _SETUP_LOG, _WORK, _TMP, _HOME,
})  # fmt: skip

# What service.jobs makes (uuid4().hex): one path component, never `..` or a separator, whatever
# a caller passes in.
_JOB_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rank_of(name: str) -> int | None:
    """The rank a log or event file's name stands for (`rank3.log`: 3); None for the others."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m else None


def code_folder(root: Path) -> Path:
    """The folder of every code archive (and of uploads still being written)."""
    return root / _CODE


def code_archive(root: Path, sha256: str) -> Path:
    """The stored code archive whose content hashes to `sha256` (64 lower-case hex digits)."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a sha256 (64 lower-case hex digits): {sha256!r}")
    return code_folder(root) / f"{sha256}.tar.gz"


@dataclass(frozen=True)
class RunFiles:
    """One node's run directory of one attempt (DPTRAIN_RUN_DIR) and what the worker and ranks write in it."""

    folder: Path

    @property
    def spec(self) -> Path:
        """The ranks' spec.json, written by the worker before they start."""
        return self.folder / _SPEC

    @property
    def pid(self) -> Path:
        """The launcher's pid, its process group id: bwrap's (SIGKILL ends the sandbox), else torchrun's."""
        return self.folder / _PID

    @property
    def stop(self) -> Path:
        """Created by the worker on cancel or deadline, `cancel_grace_seconds` before it SIGTERMs the ranks.

        A script that polls `dptrain.should_stop()` saves and leaves in time.
        """
        return self.folder / _STOP

    @property
    def stacks_taken(self) -> Path:
        """Created by the worker once it has dumped the ranks' stacks (rank_contract.stacks)."""
        return self.folder / _STACKS_TAKEN

    @property
    def logs(self) -> Path:
        """The folder of every log file of this node: the ranks', the launcher's, the environment build's."""
        return self.folder / LOGS_FOLDER

    @property
    def events(self) -> Path:
        """The folder of the ranks' event files."""
        return self.folder / EVENTS_FOLDER

    @property
    def launcher_log(self) -> Path:
        """torchrun's own output (and bwrap's)."""
        return self.logs / _LAUNCHER_LOG

    @property
    def setup_log(self) -> Path:
        """The job's environment build's output: lines with no rank."""
        return self.logs / _SETUP_LOG

    def rank_log(self, rank: int) -> Path:
        """Where everything rank `rank` prints goes."""
        return self.logs / f"rank{rank}.log"

    def rank_events(self, rank: int) -> Path:
        """Where rank `rank` writes its events, one JSON object a line."""
        return self.events / f"rank{rank}.jsonl"

    def exception(self, rank: int) -> Path:
        """Where the program of rank `rank` records the exception that ended it."""
        return self.folder / _EXCEPTIONS / f"rank{rank}.json"

    def finished(self, rank: int) -> Path:
        """Left by `dptrain.finish()` once rank `rank` is past its final barrier.

        The rank wrapper (workers.clean_end) then takes a crash of the interpreter's exit for what it
        is, a teardown fault after the work was done, rather than a failed rank.
        """
        return self.folder / _FINISHED / f"rank{rank}"

    @property
    def workdir(self) -> Path:
        """Scratch: the ranks' working directory, a writable copy of the job's code tree."""
        return self.folder / _WORK

    @property
    def tmp(self) -> Path:
        """Scratch: the ranks' /tmp (TMPDIR)."""
        return self.folder / _TMP

    @property
    def home(self) -> Path:
        """Scratch: the ranks' HOME."""
        return self.folder / _HOME

    @property
    def scratch(self) -> tuple[Path, Path, Path]:
        """The folders removed whole when the attempt ends: only what the ranks write on purpose stays."""
        return self.workdir, self.tmp, self.home


@dataclass(frozen=True)
class JobFiles:
    """A job's folder on the artifact root and everything in it; `job_id` checked to be one of ours."""

    root: Path
    job_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not _JOB_ID.fullmatch(self.job_id):
            raise ValueError(f"not a job id (32 lower-case hex digits): {self.job_id!r}")

    @property
    def jobs(self) -> Path:
        """The folder of every job's folder."""
        return self.root / _JOBS

    @property
    def folder(self) -> Path:
        """This job's folder."""
        return self.jobs / self.job_id

    @property
    def checkpoints(self) -> Path:
        """DPTRAIN_CHECKPOINT_DIR: per job, so a restart resumes from what an earlier attempt saved."""
        return self.folder / _CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """The job's checkpoint file of `step` (ValueError for a step no checkpoint can have)."""
        return self.checkpoints / checkpoint_name(step)

    @property
    def outputs(self) -> Path:
        """DPTRAIN_OUTPUT_DIR: what the job's script writes to keep, across attempts; its artifacts."""
        return self.folder / _OUTPUTS

    @property
    def init(self) -> Path:
        """The pinned `init_from` checkpoint's folder (the file and its sidecars), read-only to the ranks."""
        return self.folder / _INIT

    def init_checkpoint(self, step: int) -> Path:
        """The pinned `init_from` checkpoint file of the source's `step`."""
        return self.init / checkpoint_name(step)

    def attempt(self, attempt: int) -> Path:
        """The folder of every node's run directory of attempt `attempt` (numbered from 1)."""
        if attempt < 1:
            raise ValueError(f"attempts are numbered from 1, not {attempt}")
        return self.folder / f"{_ATTEMPT_PREFIX}{attempt}"

    def run(self, attempt: int, node_rank: int = 0) -> RunFiles:
        """The run directory of node `node_rank` of attempt `attempt`."""
        if node_rank < 0:
            raise ValueError(f"node ranks are numbered from 0, not {node_rank}")
        return RunFiles(self.attempt(attempt) / f"{_NODE_PREFIX}{node_rank}")

    def relative(self, path: Path) -> str:
        """`path` (one of this job's) relative to the artifact root, '/'-separated: for `open_beneath`."""
        return path.relative_to(self.root).as_posix()
