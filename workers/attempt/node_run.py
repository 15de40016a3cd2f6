"""What one node of an attempt runs with: the claimed attempt, its typed spec, its placement, its files.

Kept below the runner, the attempt's ending and the checkpoint rows, which all read these and
otherwise import none of each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from api_schemas import JobSpec
from rank_contract.files import create_beneath
from rank_contract.layout import JobFiles, RunFiles
from workers.attempt.init_checkpoint import InitCheckpoint
from workers.attempt.launch import Rendezvous


@dataclass(frozen=True)
class Attempt:
    """The claimed attempt: its number, fencing token and restart budget."""

    job_id: str
    number: int
    token: str
    max_restarts: int


@dataclass(frozen=True)
class RunPaths:
    """Where a node of an attempt keeps its files: checkpoints are per job, so a restart resumes from them.

    Multi-node jobs need the artifact root on storage every node shares (docs/cluster.md): rank 0
    writes the checkpoints and every rank reads them when it resumes.
    """

    job: JobFiles
    attempt: int
    node_rank: int = 0

    @property
    def run(self) -> RunFiles:
        """This node's run directory of this attempt."""
        return self.job.run(self.attempt, self.node_rank)

    def write_spec(self, spec: JobSpec) -> None:
        """Write the ranks' spec.json, which the engine validates into this same model (engine.config)."""
        # allow_nan=False: a non-finite number is refused here (a ValueError) rather than handed over
        # as `NaN`, which Python's json reads back without a word.
        text = json.dumps(spec.model_dump(mode="json"), indent=2, allow_nan=False)
        # The ranks' folder: never written through a link or a FIFO put in the file's place.
        path = self.run.spec
        f = create_beneath(path.parent, path.name, append=False)
        if f is None:
            raise OSError(f"{path} is a link or not a regular file: the spec is not written there")
        with f:
            f.write(text.encode())


@dataclass(frozen=True)
class NodeRun:
    """What one node of an attempt needs to launch its ranks: the spec validated once, at acceptance."""

    att: Attempt
    node_rank: int
    nnodes: int
    spec: JobSpec
    rendezvous: Rendezvous | None
    address: str
    # The job's `init_from` checkpoint, pinned at submit (None without one).
    init: InitCheckpoint | None = None
    # A multi-node attempt's uid, the same on every node (placement's, from
    # DPTRAIN_CLUSTER_RANK_UID_RANGE); None for one node, or an attempt placed before uids were.
    cluster_uid: int | None = None

    @property
    def is_primary(self) -> bool:
        """Node 0 syncs checkpoint rows before a restart (one node writes them, not all)."""
        return self.node_rank == 0
