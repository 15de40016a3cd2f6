"""Build the torchrun command line for an engine run (importable without importing torch)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

# The rank entry point, by absolute path: torchrun's --run-path wants a file, not a module name.
ENGINE_MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "main.py")


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous of a multi-node attempt, hosted by node 0's agent."""

    endpoint: str  # "address:port" of node 0
    run_id: str  # unique per attempt, so a late node of an old attempt never joins a new one
    is_host: bool  # node 0 runs the store; explicit, because its address may not be its host name's
    timeout_seconds: float

    def args(self, nnodes: int) -> list[str]:
        """torchrun's rendezvous options: every node joins, or the attempt fails after the timeout."""
        conf = f"is_host={int(self.is_host)},join_timeout={int(self.timeout_seconds)}"
        return [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            # A failed rank ends the attempt on every node; dptrain restarts it from a checkpoint.
            "--max-restarts=0",
        ]


def torchrun_command(
    *,
    job_id: str,
    nproc: int,
    spec_path: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    node: str = "",
    nnodes: int = 1,
    rendezvous: Rendezvous | None = None,
    local_addr: str | None = None,
    device: str = "cpu",
    command: Sequence[str] | None = None,
) -> list[str]:
    """The argv that launches `nproc` ranks on this node for one job (of `nnodes` nodes).

    Engine ranks on CPU are forked from a warm agent (workers.engine.agent: torch imported once, not
    once per rank); CUDA ranks start as fresh interpreters under plain torchrun, since CUDA does not
    survive a fork of a process that may have touched the driver. A `command` job's ranks are
    `workers.command.main` under plain torchrun, each starting the user's program.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if (nnodes > 1) != (rendezvous is not None):
        raise ValueError("a rendezvous is needed exactly when a job has more than one node")
    if rendezvous is None:
        # One node: torchrun's own local rendezvous on a free port, no address to agree on.
        where = ["--standalone"]
    else:
        where = rendezvous.args(nnodes) + ([f"--local-addr={local_addr}"] if local_addr else [])
    per_node = [*where, f"--nproc-per-node={nproc}"]
    ids = ["--job-id", job_id, "--on-node", node, "--run-dir", os.fspath(run_dir)]
    if command is not None:
        # The user's program gets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) as under
        # their own torchrun; the wrapper keeps the job id on a command line procs can find.
        run = ["torch.distributed.run", *per_node, "-m", "workers.command.main"]
        # torchrun reads each argument as a string.Template (`$$` becomes `$`, `${local_rank}` the
        # local rank): doubled, every `$` reaches the wrapper as written, and only the wrapper
        # expands (`$(NAME)`, workers/command/args.py).
        return [sys.executable, "-m", *run, *ids, "--", *(arg.replace("$", "$$") for arg in command)]
    if device == "cpu":
        # Each forked rank runs main.py by path (runpy); its arguments below stay on the agent's
        # command line, which is where procs.rank_processes looks for the job id.
        launcher = ["workers.engine.agent", *per_node, "--start-method=fork", "--run-path", ENGINE_MAIN]
    else:
        launcher = ["torch.distributed.run", *per_node, "-m", "workers.engine.main"]
    return [
        sys.executable,
        "-m",
        *launcher,
        # --on-node: which worker node's ranks these are (several nodes of a job may share a host).
        *ids,
        "--spec",
        os.fspath(spec_path),
        "--checkpoint-dir",
        os.fspath(checkpoint_dir),
    ]
