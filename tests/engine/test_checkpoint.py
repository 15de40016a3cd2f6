"""The checkpoint manager's one-pass I/O: hashed while written, verified before it is deserialised."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from workers.engine import checkpoint, hashed_file
from workers.engine.checkpoint import (
    CheckpointManager,
    checkpoint_files,
    checkpoint_name,
    step_of,
    temp_path,
)

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def _takes_o_direct(directory: Path) -> bool:
    """Whether files in `directory` open with O_DIRECT (tmpfs, for one, refuses it)."""
    if not _O_DIRECT:
        return False
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        (directory / "probe").unlink(missing_ok=True)
    return True


def _with_sidecars(path: Path) -> list[str]:
    """The names a saved checkpoint leaves in its directory, sorted."""
    return sorted(p.name for p in (path, *CheckpointManager.sidecars(path)))


def _state(step: int) -> dict[str, Any]:
    """Tensors below, at and across the (shrunk) staging-buffer size, plus plain values."""
    g = torch.Generator().manual_seed(step)
    model = {
        "tiny": torch.rand(3, generator=g),
        "exact": torch.rand(2048, generator=g),  # 8 KiB: one whole (shrunk) buffer
        "odd": torch.rand(2500, generator=g),  # not a multiple of a buffer or a block
        "big": torch.rand(64, 257, generator=g),  # wraps the ring of buffers several times
    }
    return {"model": model, "optimizer": {"state": {}, "param_groups": []}, "iter": step}


@pytest.fixture
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the staging buffers so a few KiB exercise the ring, the reuse and a partial last one."""
    monkeypatch.setattr(hashed_file, "BUFFER_BYTES", 8192)
    monkeypatch.setattr(hashed_file, "BUFFERS", 2)


class TestHashWhileWriting:
    @pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "page-cache"])
    def test_sidecar_is_the_sha256_of_the_file_on_disk(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None, direct: bool
    ) -> None:
        if not direct:
            monkeypatch.setattr(hashed_file, "_O_DIRECT", 0)
        # A filesystem that refuses O_DIRECT (tmpfs) takes the page-cache fallback: same file, same digest.
        direct = direct and _takes_o_direct(tmp_path)
        opened: list[bool] = []
        real_open = hashed_file._open

        def spy(path: Path) -> tuple[int, bool]:
            fd, was_direct = real_open(path)
            opened.append(was_direct)
            return fd, was_direct

        monkeypatch.setattr(hashed_file, "_open", spy)
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        saved = mgr.save(3, _state(3))
        assert saved is not None
        assert opened == [direct], f"expected the checkpoint opened with O_DIRECT={direct}, got {opened}"
        data = saved.path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        assert mgr.sidecar_for(saved.path).read_text() == f"{digest}  {saved.path.name}\n", (
            f"expected the sidecar to hold the sha256 of the file's bytes ({digest})"
        )
        fast = xxhash.xxh3_128(data).hexdigest()
        assert mgr.fast_sidecar_for(saved.path).read_text() == f"{fast}  {saved.path.name}\n", (
            f"expected the .xxh128 sidecar to hold the XXH3-128 of the file's bytes ({fast})"
        )
        assert (saved.sha256, saved.size_bytes) == (digest, len(data)), (
            f"expected sha256/size {digest}/{len(data)}, got {saved.sha256}/{saved.size_bytes}"
        )
        loaded = mgr.read(3)
        for name, want in _state(3)["model"].items():
            assert torch.equal(loaded.state["model"][name], want), f"model.{name}: expected the saved values"

    def test_the_file_is_never_read_back(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def no_read_back(*_: Any, **__: Any) -> Any:
            raise AssertionError("save() hashed the file by reading it back")

        monkeypatch.setattr(checkpoint, "sha256_file", no_read_back)
        saved = CheckpointManager(tmp_path, keep_last=1, is_main=True).save(1, _state(1))
        assert saved is not None and saved.sha256 == hashlib.sha256(saved.path.read_bytes()).hexdigest()

    def test_torch_crc32_setting_is_left_as_it_was(self, tmp_path: Path) -> None:
        get = torch.serialization.get_crc32_options  # torch 2.13 is pinned (constraints.txt)
        mgr = CheckpointManager(tmp_path, keep_last=1, is_main=True)
        mgr.save(1, _state(1))
        assert get() is True, "expected save() to restore torch's CRC32 default"
        with pytest.raises(AttributeError, match="pickle"):
            mgr.save(2, {"model": {}, "iter": 2, "bad": lambda: None})  # torch.save cannot pickle it
        assert get() is True, "expected a failed save() to restore torch's CRC32 default too"
        plain = torch.load(mgr.path_for(1), weights_only=True)  # the zip's CRC32 fields are not checked
        assert torch.equal(plain["model"]["odd"], _state(1)["model"]["odd"])

    def test_o_direct_refused_on_write_falls_back_to_the_page_cache(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None
    ) -> None:
        # Some filesystems accept O_DIRECT at open and refuse the writes: the save goes on without it.
        real_pwrite = os.pwrite
        refused: list[int] = []

        def picky_pwrite(fd: int, data: Any, offset: int) -> int:
            if _O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(hashed_file.os, "pwrite", picky_pwrite)
        mgr = CheckpointManager(tmp_path, keep_last=1, is_main=True)
        saved = mgr.save(1, _state(1))
        assert saved is not None
        assert saved.sha256 == hashlib.sha256(saved.path.read_bytes()).hexdigest(), "digest after fallback"
        assert torch.equal(mgr.read(1).state["model"]["big"], _state(1)["model"]["big"])
        want = 1 if _takes_o_direct(tmp_path) else 0
        assert len(refused) == want, f"expected {want} refused O_DIRECT write, got {len(refused)}"

    def test_a_failed_write_leaves_nothing_behind(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None
    ) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        assert mgr.save(1, _state(1)) is not None
        real_pwrite = os.pwrite
        calls: list[int] = []

        def full_disk(fd: int, data: Any, offset: int) -> int:
            calls.append(offset)
            if len(calls) > 1:  # the first buffer goes out, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(hashed_file.os, "pwrite", full_disk)
        # torch's writer then fails its own end-of-file check, so the OSError may arrive wrapped.
        with pytest.raises((OSError, RuntimeError)) as raised:
            mgr.save(2, _state(2))
        chain: list[BaseException] = []
        err: BaseException | None = raised.value
        while err is not None:
            chain.append(err)
            err = err.__cause__ or err.__context__
        assert any(getattr(e, "errno", None) == errno.ENOSPC for e in chain), f"expected ENOSPC in {chain}"
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == _with_sidecars(mgr.path_for(1)), f"left behind: {names}"
        monkeypatch.undo()
        assert mgr.read(1).state["iter"] == 1, "expected the previous checkpoint intact"


class TestVerifiedRead:
    def test_round_trip_is_bitwise(self, tmp_path: Path, small_buffers: None) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        mgr.save(5, _state(5))
        loaded = mgr.read(5)
        for name, want in _state(5)["model"].items():
            assert torch.equal(loaded.state["model"][name], want), f"model.{name}: expected the saved values"
        assert loaded.state["iter"] == 5

    @pytest.mark.parametrize("where", [0.5, -1], ids=["tensor-data", "last-byte"])
    @pytest.mark.parametrize("checked", ["xxh128", "sha256"], ids=["both-sidecars", "older-sha256-only"])
    def test_a_corrupt_file_is_refused_before_it_is_deserialised(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: float, checked: str
    ) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        mgr.save(1, _state(1))
        path = mgr.path_for(1)
        if checked == "sha256":  # as a checkpoint written before the .xxh128 sidecar existed
            mgr.fast_sidecar_for(path).unlink()
        data = bytearray(path.read_bytes())
        i = int(len(data) * where) if where >= 0 else len(data) - 1
        data[i] ^= 0x01
        path.write_bytes(bytes(data))

        def no_load(*_: Any, **__: Any) -> Any:
            raise AssertionError("torch.load ran on bytes that fail their checksum")

        monkeypatch.setattr(torch, "load", no_load)
        refused = rf"{re.escape(checkpoint_name(1))}: {checked} [0-9a-f]{{32,64}} != sidecar's"
        with pytest.raises(ValueError, match=refused):
            mgr.read(1)

    def test_a_load_checks_the_fast_sidecar_only(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=2, is_main=True)
        mgr.save(1, _state(1))

        def no_sha256(*_: Any, **__: Any) -> Any:
            raise AssertionError("read() computed the slow sha256 although an .xxh128 sidecar is there")

        monkeypatch.setattr(checkpoint, "sha256_file", no_sha256)
        assert mgr.read(1).state["iter"] == 1

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


class TestPruning:
    def test_a_large_pruned_file_is_out_of_sight_at_once_and_gone_after_wait(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(checkpoint, "_UNLINK_IN_BACKGROUND_BYTES", 0)  # every file counts as large
        mgr = CheckpointManager(tmp_path, keep_last=1, is_main=True)
        mgr.save(1, _state(1))
        saved = mgr.save(2, _state(2))
        assert saved is not None and saved.deleted == [mgr.path_for(1)], f"expected step 1 pruned: {saved}"
        assert mgr.steps() == [2], f"expected only step 2 listed right after the save, got {mgr.steps()}"
        for sidecar in mgr.sidecars(mgr.path_for(1)):
            assert not sidecar.exists(), f"expected the pruned sidecar {sidecar.name} gone"
        mgr.wait_pruned()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == _with_sidecars(mgr.path_for(2)), f"left behind: {names}"

    def test_a_writer_dying_before_the_unlink_leaves_a_file_the_next_one_sweeps(self, tmp_path: Path) -> None:
        mgr = CheckpointManager(tmp_path, keep_last=1, is_main=True)
        mgr.save(1, _state(1))
        leftover = temp_path(mgr.path_for(1), tag="-pruned")  # as a killed writer leaves it
        mgr.path_for(1).rename(leftover)
        CheckpointManager(tmp_path, keep_last=1, is_main=True)
        assert not leftover.exists(), "expected the next writer to sweep a pruned file left behind"


class TestNames:
    @pytest.mark.parametrize("step", [0, 1, 100, 999_999_999])
    def test_a_name_round_trips_to_its_step(self, tmp_path: Path, step: int) -> None:
        name = checkpoint_name(step)
        assert step_of(name) == step and step_of(tmp_path / name) == step, f"{name}: expected step {step}"

    @pytest.mark.parametrize("step", [-1, 10**9])
    def test_a_step_nine_digits_cannot_hold_has_no_name(self, step: int) -> None:
        with pytest.raises(ValueError, match="no checkpoint name"):
            checkpoint_name(step)

    @pytest.mark.parametrize(
        "name",
        [
            "ckpt-1.pt",
            "ckpt-0000000001.pt",
            "ckpt-00000000a.pt",
            "ckpt--00000001.pt",
            "ckpt-000000001.pth",
            "xckpt-000000001.pt",
            "ckpt-000000001.pt\n",
            "ckpt-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661.pt",  # Arabic-Indic digits
            "model.pt",
        ],
    )
    def test_a_foreign_name_has_no_step(self, name: str) -> None:
        assert step_of(name) is None, f"{name!r}: expected no step"

    def test_sidecars_and_temp_files_are_not_checkpoints(self, tmp_path: Path) -> None:
        path = tmp_path / checkpoint_name(7)
        others = [*CheckpointManager.sidecars(path), temp_path(path), temp_path(path, tag="-pruned")]
        assert [p.name for p in others] == [
            f"{path.name}.sha256",
            f"{path.name}.xxh128",
            f".{path.name}.tmp-{os.getpid()}",
            f".{path.name}.tmp-{os.getpid()}-pruned",
        ], others
        assert [step_of(p) for p in others] == [None] * 4, f"expected none of {others} taken for a checkpoint"

    def test_a_listing_holds_checkpoints_only_oldest_first(self, tmp_path: Path) -> None:
        for step in (10, 2):
            path = tmp_path / checkpoint_name(step)
            for p in (path, *CheckpointManager.sidecars(path), temp_path(path)):
                p.write_bytes(b"x")
        (tmp_path / "ckpt-3.pt").write_bytes(b"x")
        found = list(checkpoint_files(tmp_path).items())
        assert found == [(s, tmp_path / checkpoint_name(s)) for s in (2, 10)], f"got {found}"
        assert checkpoint_files(tmp_path / "absent") == {}, "no directory: expected no checkpoints"


@pytest.mark.parametrize("size", [0, 1, 8 << 20, (8 << 20) + 3])
def test_file_digests_match_the_libraries(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    got = checkpoint.sha256_file(tmp_path / "f")
    assert got == (hashlib.sha256(data).hexdigest(), size), f"{size} bytes: got {got}"
    got = checkpoint.xxh128_file(tmp_path / "f")
    assert got == (xxhash.xxh3_128(data).hexdigest(), size), f"{size} bytes: got xxh128 {got}"
