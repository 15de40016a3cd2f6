"""dptrain.finish() and dptrain.finishing() in-process: the safe teardown, harmless anywhere, idempotent."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import dptrain
from rank_contract.env import RUN_DIR_ENV
from rank_contract.layout import RunFiles


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An active SDK as rank 1 of a run in tmp_path/run."""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv("RANK", "1")
    return tmp_path / "run"


@pytest.fixture
def group() -> Iterator[object]:
    """A one-rank gloo process group in this process (no peer to start), destroyed if a test left it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_outside_dptrain_and_without_a_group_finish_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized()
    dptrain.finish()
    dptrain.finish()
    with dptrain.finishing():
        pass
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


def test_finish_never_imports_torch_for_a_script_that_did_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A script without torch.distributed has no process group: finish() must not pay torch's import.
    monkeypatch.delitem(sys.modules, "torch.distributed")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    dptrain.finish()
    assert "torch.distributed" not in sys.modules
    assert RunFiles(tmp_path).finished(0).exists()


def test_finish_destroys_the_group_marks_the_rank_and_a_second_call_is_a_no_op(
    run_dir: Path, group: object
) -> None:
    assert not RunFiles(run_dir).finished(1).exists()
    dptrain.finish()
    assert not dist.is_initialized(), "the process group is destroyed"
    assert RunFiles(run_dir).finished(1).exists(), "the rank wrapper can tell this rank ended cleanly"
    dptrain.finish()
    assert not dist.is_initialized() and RunFiles(run_dir).finished(1).exists()


def test_finishing_finishes_a_block_that_ends_normally(run_dir: Path, group: object) -> None:
    with dptrain.finishing():
        assert dist.is_initialized()
    assert not dist.is_initialized() and RunFiles(run_dir).finished(1).exists()


def test_finishing_lets_an_error_through_without_the_barrier_or_the_mark(
    run_dir: Path, group: object
) -> None:
    with pytest.raises(ValueError, match="bad step"), dptrain.finishing():
        raise ValueError("bad step")
    # No barrier the other ranks might never reach, and no mark: a crash after this is a failure.
    assert dist.is_initialized()
    assert not RunFiles(run_dir).finished(1).exists()


def test_finishing_is_also_a_decorator(run_dir: Path, group: object) -> None:
    @dptrain.finishing()
    def main() -> int:
        return 7

    assert main() == 7
    assert not dist.is_initialized() and RunFiles(run_dir).finished(1).exists()
