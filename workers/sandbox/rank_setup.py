"""What a node prepares before its ranks start: the code tree, the environment, and whose they are.

Kept apart from the runner's supervision loop: everything here happens once per attempt and node,
before torchrun starts, and anything that fails here fails the attempt with an error naming why.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api_schemas import JobError, JobSpec
from rank_contract.env import sdk_env
from rank_contract.failures import Failure
from rank_contract.layout import code_archive
from service.config import Settings
from workers.attempt.init_checkpoint import InitCheckpoint, unshare
from workers.attempt.init_checkpoint import verify as verify_init
from workers.attempt.node_run import RunPaths
from workers.engine.process import supervisor_id
from workers.sandbox import bubblewrap, rank_uids
from workers.sandbox.code_cache import CodeArchiveError, unpack_cached
from workers.sandbox.rank_env import rank_environment
from workers.sandbox.scratch import make_scratch, short_tmp


class SetupFailed(Exception):
    """The ranks cannot start; `error` says why (the job's error)."""

    def __init__(self, error: JobError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class RunAs:
    """The unprivileged user the ranks run as: DPTRAIN_RUN_AS's, or a uid leased for this attempt alone."""

    name: str
    uid: int
    gid: int
    # The attempt's own uid's lease (workers/sandbox/rank_uids.py); None for DPTRAIN_RUN_AS's user.
    lease: rank_uids.Lease | None = None
    # Whether the worker's processes switch to this user (a root worker's do: bwrap's setpriv, the
    # installer's Popen). A worker that is not root cannot: its DPTRAIN_RUN_AS names only itself.
    switched: bool = True

    @classmethod
    def named(cls, name: str, *, switched: bool) -> RunAs:
        """The user `name` of this host; SetupFailed if there is none."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            message = f"DPTRAIN_RUN_AS names no user of this host: {name!r}"
            raise SetupFailed(JobError(type=Failure.LAUNCHER_ERROR, message=message)) from None
        return cls(name=name, uid=entry.pw_uid, gid=entry.pw_gid, switched=switched)

    def popen_args(self) -> dict[str, Any]:
        """subprocess.Popen's arguments that start torchrun (and so every rank) as this user."""
        # umask 077: what the ranks write (checkpoints, logs) is theirs and the worker's alone.
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "umask": 0o077}

    @classmethod
    def leased(cls, lease: rank_uids.Lease) -> RunAs:
        """The attempt's own uid (no user of the host has it: named by its number)."""
        return cls(name=f"uid {lease.uid}", uid=lease.uid, gid=lease.gid, lease=lease)


def ranks_user(
    *,
    settings: Settings,
    sandboxed: bool,
    multi_node: bool,
    hold: contextlib.ExitStack,
    attempt: str,
    cluster_uid: int | None = None,
) -> RunAs | None:
    """Who the attempt's ranks and its environment's build run as: the one place that decides it.

    DPTRAIN_RUN_AS's user where the operator names one; else, for a root worker's sandboxed ranks, a
    uid leased until `hold` closes: for one node, any uid of DPTRAIN_RANK_UID_RANGE that no other
    attempt on this host holds; for a multi-node attempt, `cluster_uid`, the one placement gave it
    for every node, held in the name `attempt` beside its other nodes on this host (nobody for an
    attempt placed before placement gave uids). Else None, the worker's own user (a worker that is
    not root; a root worker's unsandboxed ranks, which the sandbox's absence already leaves with the
    worker's rights).
    """
    root = os.getuid() == 0
    if settings.run_as:
        return RunAs.named(settings.run_as, switched=root)
    if not root or not sandboxed:
        return None
    try:
        if not multi_node:
            lease = hold.enter_context(rank_uids.leased(settings.rank_uids))
        elif cluster_uid is not None:
            # Every node's ranks read the job's one checkpoint folder (shared storage, or one host
            # in small setups), which each node hands to its ranks' user: the same uid on every
            # node, which no other running attempt in the cluster holds (placement's choice).
            lease = rank_uids.acquire_shared(cluster_uid, holder=attempt, within=settings.cluster_rank_uids)
            hold.callback(rank_uids.release, lease)
        else:
            uid, gid = bubblewrap.nobody()
            return RunAs(name="nobody", uid=uid, gid=gid)
    except rank_uids.NoFreeUid as exc:
        raise SetupFailed(JobError(type=Failure.NO_FREE_UID, message=str(exc))) from exc
    return RunAs.leased(lease)


@dataclass(frozen=True)
class RankSetup:
    """Where and how the ranks of one node of an attempt start."""

    cwd: Path
    env: dict[str, str]
    run_as: RunAs | None
    # The sandbox the ranks run in; None: they run unsandboxed, for the reason in `unsandboxed`.
    box: bubblewrap.Box | None = None
    unsandboxed: str | None = None
    # The job's unpacked code tree, and the interpreter that starts torchrun (None: the worker's;
    # a job's environment's otherwise, workers/pyenv/provision.py).
    code_dir: Path | None = None
    python: Path | None = None


def unpack_code(settings: Settings, spec: JobSpec) -> Path | None:
    """The job's unpacked code tree (unpacked once per sha256 on this host), None for a job without code."""
    if spec.code is None:
        return None
    sha256 = spec.code.sha256
    try:
        return unpack_cached(
            archive=code_archive(settings.artifacts, sha256),
            sha256=sha256,
            cache_dir=settings.code_cache,
            max_unpacked_bytes=settings.code_max_unpacked_bytes,
        )
    except CodeArchiveError as exc:
        raise SetupFailed(JobError(type=type(exc).__name__, message=str(exc))) from exc


def prepare(
    *,
    settings: Settings,
    spec: JobSpec,
    paths: RunPaths,
    unsandboxed: str | None,
    hold: contextlib.ExitStack,
    multi_node: bool = False,
    cluster_uid: int | None = None,
    interface: str | None = None,
    init: InitCheckpoint | None = None,
) -> RankSetup:
    """Unpack the code, make the scratch, choose the ranks' user and hand the run's folders to it.

    `paths`: the job's folders and this node's run directory of the attempt;
    `unsandboxed` says why this worker cannot sandbox the ranks (`bubblewrap.unavailable`), None if it can;
    `hold` keeps the ranks' own uid leased (`ranks_user`) until it closes, after the attempt's end;
    `multi_node` says the attempt has other nodes, `cluster_uid` the uid placement gave all of them;
    `interface` is the network interface of this node's address in a multi-node attempt; `init` the
    job's init_from checkpoint when its ranks start from it (verified here first, SetupFailed if not).
    """
    if init is not None and (mismatch := verify_init(init)) is not None:
        raise SetupFailed(mismatch)
    why = unsandboxed
    if why is not None and settings.sandbox == "required":
        raise SetupFailed(JobError(type=Failure.SANDBOX_UNAVAILABLE, message=why))
    run_dir, checkpoint_dir, output_dir = paths.run.folder, paths.job.checkpoints, paths.job.outputs
    code_dir = unpack_code(settings, spec)
    scratch = make_scratch(run_dir, code_dir)
    # Never root inside the sandbox: a root worker's sandboxed ranks always get a user here.
    run_as = ranks_user(
        settings=settings,
        sandboxed=why is None,
        multi_node=multi_node,
        cluster_uid=cluster_uid,
        hold=hold,
        attempt=f"{paths.job.job_id}/{paths.attempt}",
    )
    if run_as is not None:
        if init is not None:
            unshare(init.folder)
        # The init folder too, its files unshared from the source's first (init_checkpoint.unshare).
        owned = (run_dir, checkpoint_dir, output_dir, *([init.folder] if init else []))
        if run_as.lease is not None:
            # Noted before they are handed over: what the uid owns is the worker's again before
            # another attempt leases it, even if this worker dies first.
            run_as.lease.own(owned)
        # A root bwrap binds what the ranks need whatever its folders' modes: only an unsandboxed
        # rank must be able to walk the artifact root to its run directory.
        _hand_over(run_as, paths=paths, owned=owned, reach=why is not None)
    ours = sdk_env(
        job_id=paths.job.job_id,
        attempt=paths.attempt,
        run_dir=run_dir,
        checkpoint_dir=checkpoint_dir,
        keep_last=spec.checkpoint.keep_last,
        # The worker's pid means nothing in the sandbox's PID namespace; --die-with-parent does its work.
        supervisor=supervisor_id() if why is not None else None,
        code_dir=code_dir,
        data_root=settings.data_root,
        output_dir=output_dir,
        init_checkpoint=init.path if init is not None else None,
    )
    # TMPDIR is short whatever the home's length: AF_UNIX paths (multiprocessing's) fit in 108 bytes.
    tmp = Path(bubblewrap.SANDBOX_TMP) if why is None else short_tmp(run_dir)
    env = rank_environment(
        worker_env=os.environ,
        dptrain=ours,
        user=spec.env,
        home=scratch.home,
        tmp=tmp,
        code_dir=code_dir,
        shared_cores=settings.node_slots > (os.cpu_count() or 1),
        interface=interface,
    )
    box = None
    if why is None:
        switch_to = run_as if run_as is not None and run_as.switched else None
        box = bubblewrap.Box(
            workdir=scratch.workdir,
            tmp_dir=scratch.tmp,
            # The attempt's run directory, the job's checkpoints and its DPTRAIN_OUTPUT_DIR.
            writable=(run_dir, checkpoint_dir, output_dir),
            # The job's code tree, the data root and the folder of its pinned init_from checkpoint;
            # its Python environment joins them once it has one (workers/pyenv/provision.py).
            read_only=tuple(
                p for p in (code_dir, settings.data_root, init.folder if init else None) if p is not None
            ),
            gpus=spec.resources.device == "cuda",
            uid=switch_to.uid if switch_to else None,
            gid=switch_to.gid if switch_to else None,
        )
    return RankSetup(cwd=scratch.workdir, env=env, run_as=run_as, box=box, unsandboxed=why, code_dir=code_dir)


def _own(top: Path, uid: int, gid: int) -> None:
    """Give the tree at `top` to uid:gid, `top` itself private to its owner (0700)."""
    for root, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(root, name), uid, gid)
    os.chown(top, uid, gid)
    os.chmod(top, 0o700)


def _hand_over(run_as: RunAs, *, paths: RunPaths, owned: tuple[Path, ...], reach: bool) -> None:
    # The run-as user owns `owned`: this attempt's run directory, the job's checkpoints and outputs
    # (0700). With `reach` it may also pass through the artifact root, the jobs folder and this job's
    # folder (0711: enter, not list, so other jobs' names stay hidden). Other jobs' folders are the
    # worker's again once their attempts end (`take_back`), so their files cannot be read.
    job = paths.job
    for folder in (job.root, job.jobs, job.folder, job.attempt(paths.attempt)) if reach else ():
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o711)
    for folder in owned:
        folder.mkdir(parents=True, exist_ok=True)
        _own(folder, run_as.uid, run_as.gid)


def take_back(*, paths: RunPaths, primary: bool) -> None:
    """Make an ended attempt's files the worker's again, unreadable to the run-as user's later ranks.

    The job's own folders (its checkpoints, outputs and pinned init_from folder, which `prepare`
    handed over too) only on the `primary` node, whose rank 0 writes them.
    """
    uid, gid = os.getuid(), os.getgid()
    job = paths.job
    for owned in (paths.run.folder, *((job.checkpoints, job.outputs, job.init) if primary else ())):
        if owned.exists():
            _own(owned, uid, gid)
