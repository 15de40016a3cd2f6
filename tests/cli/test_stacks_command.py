"""`dptrain stacks ID`: a running job's latest dump, every frame inert; any other job is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from api_schemas import JobStatus, ProcessStack, StackDump, StackFrame, ThreadStack
from service.jobs import lifecycle
from service.models import RankStacks
from service.models.base import utcnow
from tests.backends import sessions_of
from tests.cli.conftest import dptrain

# A frame's name is what the job's code named its function: never markup, never a control sequence.
HOSTILE = "[bold red]evil[/] \x1b[2J"


def _dump() -> StackDump:
    frames = [StackFrame(name=HOSTILE, file="/code/train.py", line=7)]
    thread = ThreadStack(thread_id=42, name="MainThread", active=False, frames=frames)
    rank0 = ProcessStack(
        rank=0, pid=42, command="python train.py", where="all_reduce (train.py:16)", threads=[thread]
    )
    return StackDump(node="n1", attempt=1, reason="stall", taken_at=utcnow(), processes=[rank0])


def test_stacks_prints_each_ranks_frame_and_threads_inert(
    api: TestClient, spec_file: Callable[..., Path]
) -> None:
    job_id = dptrain("submit", spec_file(name="hangs")).stdout.strip()
    r = dptrain("stacks", job_id, "--wait", "0")
    assert r.exit_code == 3 and "409" in r.stderr and "only while it runs" in r.stderr, r.output

    dump = _dump()
    with sessions_of(api).begin() as s:
        lifecycle.transition(s, job_id=job_id, src=JobStatus.QUEUED, dst=JobStatus.RUNNING)
        s.add(
            RankStacks(
                job_id=job_id,
                attempt=1,
                node="n1",
                reason="stall",
                requested_at=None,
                taken_at=dump.taken_at,
                dump=dump.model_dump(mode="json"),
            )
        )
    r = dptrain("stacks", job_id, "--wait", "0")
    assert r.exit_code == 0, r.output
    assert "rank 0 pid 42: all_reduce (train.py:16)" in r.stdout
    assert "    [bold red]evil[/] [2J (/code/train.py:7)" in r.stdout and "\x1b" not in r.stdout
    assert "no fresh dump" in r.stderr, "a dump older than the request is said to be so"

    r = dptrain("stacks", job_id, "--wait", "0", "--output", "json")
    assert r.exit_code == 0 and '"where": "all_reduce (train.py:16)"' in r.stdout
