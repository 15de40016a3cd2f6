"""How one node's ranks of an attempt are started, stopped, watched and ended: the runner's one seam.

The runner (workers/attempt/runner.py) asks a `Ranks` for all of it and knows nothing of how the
ranks run. Today's is `LocalTorchrun`: torchrun on this host in a session of its own, in the
bubblewrap sandbox where the node has one (workers/sandbox/bubblewrap.py). What changes how ranks
are started (the node's resources, a network namespace, a cluster manager's launcher) is another
`Ranks`, chosen once per attempt by the `Launcher` the runner is given.
"""

from __future__ import annotations

import logging
import subprocess
from typing import Any, Protocol

from rank_contract.files import create_beneath
from service.config import Settings
from service.files import PRIVATE_UMASK
from workers.attempt.launch import torchrun_command
from workers.attempt.node_run import NodeRun, RunPaths
from workers.sandbox import bubblewrap
from workers.sandbox.procs import kill_group, stop_group, sweep_ranks
from workers.sandbox.rank_setup import RankSetup

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The ranks of one node's part of an attempt, however they are started."""

    def unsandboxed(self) -> str | None:
        """Why these ranks would run outside the sandbox (workers/sandbox/bubblewrap.py); None if inside."""
        ...

    def clear_earlier(self) -> None:
        """End what an earlier attempt of this job left running on this node (its worker died first)."""
        ...

    def start(self, setup: RankSetup) -> None:
        """Start the ranks as `setup` says: their folder, variables, interpreter, sandbox and user."""
        ...

    def poll(self) -> int | None:
        """Their exit code once they have ended (a signal's negative number), None while they run."""
        ...

    def stop(self, *, grace: float) -> None:
        """Ask every rank to stop (SIGTERM), and kill what is left after `grace` seconds."""
        ...

    def end(self) -> int:
        """Kill whatever is left of them, wait until it is gone, and return their exit code."""
        ...


class Launcher(Protocol):
    """What makes the `Ranks` of this worker node's part of `run` (a class such as `LocalTorchrun`)."""

    def __call__(self, *, settings: Settings, run: NodeRun, paths: RunPaths) -> Ranks: ...


class LocalTorchrun:
    """torchrun on this host in a session of its own: in bubblewrap, else as the ranks' user."""

    def __init__(self, *, settings: Settings, run: NodeRun, paths: RunPaths) -> None:
        self.settings, self.run, self.paths = settings, run, paths
        self.node, self.job_id = settings.node, run.att.job_id
        self._proc: subprocess.Popen[bytes] | None = None
        self._sandboxed = False

    def unsandboxed(self) -> str | None:
        """Why bubblewrap cannot contain them under DPTRAIN_SANDBOX, None if it can."""
        # Probed once per worker process, for real (the worker's start did it already).
        return bubblewrap.unavailable(self.settings.sandbox)

    def clear_earlier(self) -> None:
        """Kill the ranks an earlier attempt's dead worker left: they must not write checkpoints beside ours.

        torchrun runs in a session of its own, so a SIGKILLed worker leaves them running. Only this
        node's: other nodes of the job may share this host (tests, small setups).
        """
        if left := sweep_ranks(self.job_id, node=self.node):
            log.warning("job %s: killed %d processes of an earlier attempt", self.job_id, left)

    def start(self, setup: RankSetup) -> None:
        """Build torchrun's command line and environment, start it, and note its pid."""
        run, paths = self.run, self.paths
        spec = run.spec
        argv = torchrun_command(
            job_id=self.job_id,
            node=self.node,
            nproc=spec.resources.processes_per_node,
            spec_path=str(paths.run.spec),
            run_dir=str(paths.run.folder),
            checkpoint_dir=str(paths.job.checkpoints),
            nnodes=run.nnodes,
            rendezvous=run.rendezvous,
            local_addr=run.address or None,
            device=spec.resources.device,
            command=spec.command,
        )
        if setup.python is not None:
            argv[0] = str(setup.python)  # the job's environment: its interpreter is every rank's `python`
        # What torchrun and the ranks write is private whoever runs this (a worker, a test): umask 077.
        user: dict[str, Any] = {"umask": PRIVATE_UMASK}
        if setup.box is not None:
            # bwrap starts as the worker; a root worker's sandbox switches to the ranks' user inside.
            argv = bubblewrap.bwrap_argv(setup.box, argv)
        elif setup.run_as is not None:
            user |= setup.run_as.popen_args()
        self._sandboxed = setup.box is not None
        log_path = paths.run.launcher_log
        launcher_out = create_beneath(log_path.parent, log_path.name)
        if launcher_out is None:
            why = "is a link or not a regular file: the launcher's output is not put there"
            raise OSError(f"{log_path} {why}")
        with launcher_out:
            # A session of its own: cancelling or cleaning up signals torchrun's group; torchrun forwards
            # it to the ranks (each in a session of its own) and sweep_ranks kills any left behind.
            self._proc = proc = subprocess.Popen(
                argv,
                stdout=launcher_out,
                stderr=subprocess.STDOUT,
                env=setup.env,
                cwd=setup.cwd,
                start_new_session=True,
                **user,
            )
        # For operators (and a recovering worker on another machine's tooling): which group to kill.
        # Never a reason to lose track of the group just started; never written through a link or a FIFO
        # the ranks put in its place (rank_contract.files).
        if (pid_file := create_beneath(paths.run.folder, paths.run.pid.name, append=False)) is not None:
            with pid_file:
                pid_file.write(f"{proc.pid}\n".encode())

    def poll(self) -> int | None:
        """torchrun's exit code (bwrap's, which passes it on), None while it runs."""
        return self._started().poll()

    def stop(self, *, grace: float) -> None:
        """SIGTERM torchrun's group (in a sandbox the group inside it), SIGKILL what is left after `grace`."""
        stop_group(self._started(), grace=grace, sandboxed=self._sandboxed)

    def end(self) -> int:
        """SIGKILL torchrun's group (a sandbox: everything in it), then the ranks that outlived torchrun."""
        proc = self._started()
        kill_group(proc, sandboxed=self._sandboxed)
        if left := sweep_ranks(self.job_id, node=self.node):
            log.warning("job %s: killed %d rank processes left behind by torchrun", self.job_id, left)
        return proc.returncode

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"job {self.job_id}: its ranks were never started")
        return self._proc
