"""Which frame names where a rank is, which errors are a collective timeout, a dump py-spy cannot make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api_schemas import StackFrame
from rank_contract.stacks import collective_timed_out
from workers.reporting import stacks
from workers.reporting.stacks import Library, describe

LIB = Library(python=("/py/",), ours=("/repo/workers/",))


def _frames(*spec: tuple[str, str, int]) -> list[StackFrame]:
    return [StackFrame(name=n, file=f, line=ln) for n, f, ln in spec]


def test_the_call_the_users_code_made_is_named_past_decorator_wrappers() -> None:
    frames = _frames(
        ("all_reduce", "/py/site-packages/torch/distributed/distributed_c10d.py", 2900),
        ("_exception_logger.<locals>.wrapper", "/py/site-packages/torch/distributed/c10d_logger.py", 81),
        ("main", "/code/train.py", 88),
        ("<module>", "/code/train.py", 95),
        ("_run_code", "/py/lib/runpy.py", 86),
    )
    assert describe(frames, library=LIB) == "all_reduce (train.py:88)"


def test_users_code_running_its_own_line_is_named_itself() -> None:
    frames = _frames(("wait_for_peer", "/code/train.py", 9), ("<module>", "/code/train.py", 18))
    assert describe(frames, library=LIB) == "wait_for_peer (train.py:9)"


def test_an_engine_rank_without_user_code_is_named_by_dptrains_own_frame() -> None:
    frames = _frames(
        ("_BaseDataLoaderIter.__next__", "/py/site-packages/torch/utils/data/dataloader.py", 708),
        ("train", "/repo/workers/engine/loop.py", 40),
        ("<frozen runpy>", "<frozen runpy>", 1),
    )
    assert describe(frames, library=LIB) == "_BaseDataLoaderIter.__next__ (loop.py:40)"


def test_only_library_frames_name_the_innermost() -> None:
    frames = _frames(("select", "/py/lib/selectors.py", 415), ("run", "/py/lib/threading.py", 982))
    assert describe(frames, library=LIB) == "select (selectors.py:415)"
    assert describe([], library=LIB) is None


@pytest.mark.parametrize(
    ("message", "timed_out"),
    [
        (
            "[/x/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv",
            True,
        ),
        ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)", True),
        ("urlopen error timed out", False),
        ("CUDA out of memory", False),
    ],
)
def test_gloo_and_nccl_collective_timeouts_are_recognised(message: str, timed_out: bool) -> None:
    assert collective_timed_out(message) is timed_out


def test_without_py_spy_the_dump_says_so_and_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    monkeypatch.setattr(
        stacks, "targets", lambda job_id, node: [stacks.Target(pid=4711, rank=0, command="python")]
    )
    dump = stacks.dump("job", node="n1", attempt=1, reason="request")
    assert dump.note == stacks.PY_SPY_MISSING and dump.processes[0].error == stacks.PY_SPY_MISSING
    assert stacks.summary(dump) == stacks.PY_SPY_MISSING


@pytest.mark.e2e
def test_a_refused_ptrace_is_noted_with_py_spys_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # py-spy as an unprivileged worker meets it (Yama's ptrace_scope, another uid): its own words.
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(stacks, "py_spy", lambda: str(fake))
    monkeypatch.setattr(
        stacks, "targets", lambda job_id, node: [stacks.Target(pid=os.getpid(), rank=1, command="python")]
    )
    dump = stacks.dump("job", node="n1", attempt=1, reason="stall")
    assert dump.processes[0].error == "Error: Permission denied (os error 13)"
    assert dump.note is not None and "could not be read" in dump.note and "docs/security.md" in dump.note
