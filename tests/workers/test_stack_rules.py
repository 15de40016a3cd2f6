"""Which frame names where a rank is, and which errors are a collective's timeout (workers/stacks.py)."""

from __future__ import annotations

import pytest

from api_schemas import StackFrame
from rank_contract.stacks import collective_timed_out
from workers.stacks import Library, describe

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
