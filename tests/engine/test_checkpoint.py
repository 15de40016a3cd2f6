"""The checkpoint manager's one-pass I/O: hashed while written, verified before it is deserialised."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine import checkpoint
from workers.engine.checkpoint import CheckpointManager


def _state(step: int) -> dict[str, Any]:
    """Tensors below, at and across the (shrunk) parallel-hash and slice sizes, plus plain values."""
    g = torch.Generator().manual_seed(step)
    model = {
        "tiny": torch.rand(3, generator=g),
        "exact": torch.rand(1024, generator=g),  # 4 KiB: exactly two slices
        "odd": torch.rand(2500, generator=g),  # not a multiple of the slice
        "big": torch.rand(64, 257, generator=g),
    }
    return {"model": model, "optimizer": {"state": {}, "param_groups": []}, "iter": step}


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the size thresholds so a few KiB exercise the worker-thread and slicing paths."""
    monkeypatch.setattr(checkpoint, "_PARALLEL_MIN", 1024)
    monkeypatch.setattr(checkpoint, "_SLICE", 2048)
    monkeypatch.setattr(checkpoint, "_WRITEBACK_EVERY", 4096)


class TestHashWhileWriting:
    @pytest.mark.parametrize("writeback", [True, False], ids=["sync_file_range", "without"])
    def test_sidecar_is_the_sha256_of_the_file_on_disk(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_slices: None, writeback: bool
    ) -> None:
        real = checkpoint._sync_file_range
        if writeback and real is None:
            pytest.skip("no sync_file_range on this platform")
        calls: list[tuple[int, int]] = []

        def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
            calls.append((offset, nbytes))
            assert real is not None
            return real(fd, offset, nbytes, flags)

        monkeypatch.setattr(checkpoint, "_sync_file_range", spy if writeback else None)
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        saved = mgr.save(3, _state(3))
        assert saved is not None
        if writeback:
            assert calls and all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:], strict=False)), (
                f"expected writeback started on consecutive ranges, got {calls}"
            )
        data = saved.path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        assert mgr.sidecar_for(saved.path).read_text() == f"{digest}  {saved.path.name}\n", (
            f"expected the sidecar to hold the sha256 of the file's bytes ({digest})"
        )
        assert (saved.sha256, saved.size_bytes) == (digest, len(data)), (
            f"expected sha256/size {digest}/{len(data)}, got {saved.sha256}/{saved.size_bytes}"
        )

    def test_the_file_is_never_read_back(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def no_read_back(*_: Any, **__: Any) -> Any:
            raise AssertionError("save() hashed the file by reading it back")

        monkeypatch.setattr(checkpoint, "sha256_file", no_read_back)
        saved = CheckpointManager(tmp_path, keep_last=1, is_main=True).save(1, _state(1))
        assert saved is not None and saved.sha256 == hashlib.sha256(saved.path.read_bytes()).hexdigest()

    def test_a_failed_write_leaves_nothing_behind(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_slices: None
    ) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        assert mgr.save(1, _state(1)) is not None
        real_write = checkpoint._HashingWriter._write_large

        def full_disk(self: Any, view: memoryview) -> None:
            real_write(self, view[:1500])  # part of a tensor goes out, hashes in flight, then ENOSPC
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoint._HashingWriter, "_write_large", full_disk)
        # torch's writer then fails its own end-of-file check, so the OSError may arrive wrapped.
        with pytest.raises((OSError, RuntimeError)):
            mgr.save(2, _state(2))
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["ckpt-000000001.pt", "ckpt-000000001.pt.sha256"], f"left behind: {names}"


class TestVerifiedRead:
    def test_round_trip_is_bitwise(self, tmp_path: Path, small_slices: None) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        mgr.save(5, _state(5))
        loaded = mgr.read(5)
        for name, want in _state(5)["model"].items():
            assert torch.equal(loaded.state["model"][name], want), f"model.{name}: expected the saved values"
        assert loaded.state["iter"] == 5

    @pytest.mark.parametrize("where", [0.5, -1], ids=["tensor-data", "last-byte"])
    def test_a_corrupt_file_is_refused_before_it_is_deserialised(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: float
    ) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        mgr.save(1, _state(1))
        path = mgr.path_for(1)
        data = bytearray(path.read_bytes())
        i = int(len(data) * where) if where >= 0 else len(data) - 1
        data[i] ^= 0x01
        path.write_bytes(bytes(data))

        def no_load(*_: Any, **__: Any) -> Any:
            raise AssertionError("torch.load ran on bytes that fail their checksum")

        monkeypatch.setattr(torch, "load", no_load)
        with pytest.raises(ValueError, match=r"ckpt-000000001\.pt: sha256 [0-9a-f]{64} != sidecar's"):
            mgr.read(1)

    def test_loaded_tensors_are_private_and_outlive_the_file(self, tmp_path: Path) -> None:
        # The state is mapped from the file copy-on-write: writing to it leaves the checkpoint as it
        # was, and pruning the file (unlink) does not pull the data from under a resumed trainer.
        mgr = CheckpointManager(tmp_path, keep_last=1, is_main=True)
        mgr.save(1, _state(1))
        loaded = mgr.read(1)
        loaded.state["model"]["big"].add_(1.0)
        assert torch.equal(mgr.read(1).state["model"]["big"], _state(1)["model"]["big"]), (
            "expected an in-place change of a loaded tensor to leave the file unchanged"
        )
        mgr.save(2, _state(2))
        assert not mgr.path_for(1).exists(), "expected keep_last=1 to prune step 1"
        assert torch.equal(loaded.state["model"]["odd"], _state(1)["model"]["odd"]), (
            "expected the loaded state to stay intact after its file was pruned"
        )
