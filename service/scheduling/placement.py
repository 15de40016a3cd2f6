"""Where queued jobs run: the placement decision itself, pure (no SQL), so its rules are tested directly.

The rules, in order:
- Jobs are considered in the order given: highest `priority` first, then, within a priority and
  device kind, each owner's first queued job, then each owner's second, and so on (`fair_key`,
  service/scheduling/queue.py), then oldest first.
- A job whose owner already has `max_running` jobs running waits, without holding up anyone else.
- A job is placed all-or-nothing: `nodes` live nodes of its device kind, each with
  `processes_per_node` free slots, or none at all. Nothing is ever reserved for a job that is not
  placed, so two jobs can never each hold part of what both need (no partial-admission deadlock).
- A job that no set of live nodes could ever hold (`never_fits`: fewer than `nodes` live nodes of
  its device kind with `processes_per_node` slots) is *unplaceable*: it says so, first, and blocks
  nobody. A job that could run on the live nodes but not now (they are busy) blocks the jobs after
  it of the same device kind, so small jobs never starve a large one.
- Nodes are chosen best-fit (fewest free slots that suffice, then by name), keeping large nodes free
  for large jobs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Node:
    """A live worker node: its capacity and what placement has not handed out yet."""

    name: str
    device: str
    slots: int
    free: int
    address: str = ""


@dataclass(frozen=True)
class Pending:
    """A queued job as placement needs it."""

    job_id: str
    owner_id: int
    device: str
    nodes: int
    processes_per_node: int


@dataclass
class Decision:
    """Where a job goes (node names in node-rank order), or why it waits."""

    job_id: str
    nodes: list[Node] = field(default_factory=list)
    reason: str | None = None
    # No set of the live nodes could ever hold it (`reason` is then `never_fits`'s answer).
    unplaceable: bool = False

    @property
    def placed(self) -> bool:
        """Whether the job got its nodes."""
        return bool(self.nodes)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def wanted(job: Pending) -> str:
    """What a job needs, in words."""
    return (
        f"{_plural(job.nodes, 'node')} with {_plural(job.processes_per_node, 'free ' + job.device + ' slot')}"
    )


def never_fits(job: Pending, nodes: Sequence[Node]) -> str | None:
    """Why no set of `nodes` could ever hold `job`, whatever they run; None if one could.

    Counts slots, not free slots: the submit answer and every placement round ask the same question
    of the live nodes, and its answer changes only when nodes come, go or change their slots.
    """
    kind = [n for n in nodes if n.device == job.device]
    able = [n for n in kind if n.slots >= job.processes_per_node]
    if len(able) >= job.nodes:
        return None
    live = _plural(len(kind), f"live {job.device} node")
    if not kind:
        offer = f"no live {job.device} node"
    elif not able:
        offer = f"{live}, the largest with {_plural(max(n.slots for n in kind), 'slot')}"
    else:
        offer = f"{live}, {len(able)} of them with {_plural(job.processes_per_node, 'slot')}"
    return f"no live node can hold this job: it needs {wanted(job)}; {offer}"


def decide(
    pending: Sequence[Pending], *, nodes: Sequence[Node], running: dict[int, int], max_running: int
) -> list[Decision]:
    """Decide for each of `pending` (in placement order) where it runs or why it waits.

    `nodes` are the live nodes with their free slots (updated in place as jobs are placed);
    `running` counts running jobs per owner (also updated).
    """
    state = _Round(nodes=nodes, running=running, max_running=max_running)
    return [state.decide(job) for job in pending]


class _Round:
    """What one round has decided so far: the device kinds blocked, and `never_fits` per job shape."""

    def __init__(self, *, nodes: Sequence[Node], running: dict[int, int], max_running: int) -> None:
        self.running, self.max_running = running, max_running
        self.by_device: dict[str, list[Node]] = {}
        for n in nodes:
            self.by_device.setdefault(n.device, []).append(n)
        self.blocked: set[str] = set()
        # Jobs of a round share a handful of shapes; each asks never_fits once, not once per job
        # (with a thousand nodes and hundreds of jobs that was most of a round).
        self.never: dict[tuple[str, int, int], str | None] = {}

    def never_fits(self, job: Pending) -> str | None:
        shape = (job.device, job.nodes, job.processes_per_node)
        if shape not in self.never:
            self.never[shape] = never_fits(job, self.by_device.get(job.device, []))
        return self.never[shape]

    def decide(self, job: Pending) -> Decision:
        # Before the owner's limit: that wait ends by itself, this one only when the cluster changes.
        if (never := self.never_fits(job)) is not None:
            return Decision(job.job_id, reason=never, unplaceable=True)
        if self.running.get(job.owner_id, 0) >= self.max_running:
            return Decision(
                job.job_id,
                reason=f"waiting: its owner has {self.running[job.owner_id]} jobs running, "
                f"the limit is {self.max_running}",
            )
        if job.device in self.blocked:
            return Decision(job.job_id, reason=f"waiting for {wanted(job)}: behind earlier {job.device} jobs")
        fit = heapq.nsmallest(
            job.nodes,
            (n for n in self.by_device.get(job.device, []) if n.free >= job.processes_per_node),
            key=lambda n: (n.free, n.name),
        )
        if len(fit) < job.nodes:
            self.blocked.add(job.device)
            return Decision(job.job_id, reason=f"waiting for {wanted(job)}: {len(fit)} such now")
        for n in fit:
            n.free -= job.processes_per_node
        self.running[job.owner_id] = self.running.get(job.owner_id, 0) + 1
        return Decision(job.job_id, nodes=fit)
