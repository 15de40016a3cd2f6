"""Atomic, verified, retained checkpoints (`ckpt-{step:09d}.pt` + a sha256sum-style sidecar)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_CHUNK = 1 << 20
# Writes at least this big (tensor data) are hashed on a worker thread while they are written;
# smaller ones (zip headers, the pickle) are hashed inline, where a hand-off would cost more.
_PARALLEL_MIN = 1 << 20
# A large write goes out in slices of this size: small enough to stay in the CPU cache between
# being hashed and being written.
_SLICE = 4 << 20
# Writeback of what has been written is started every this many bytes.
_WRITEBACK_EVERY = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` optimizer steps."""
    return f"ckpt-{step:09d}.pt"


def sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file."""
    h, size = hashlib.sha256(), 0
    buf = memoryview(bytearray(_CHUNK))  # one buffer, reused: no allocation per chunk
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):  # a larger readahead keeps the disk busy while this hashes
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            h.update(buf[:n])
            size += n
    return h.hexdigest(), size


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    # Linux's sync_file_range (not in the os module): starts writeback of a range without waiting.
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sync_file_range = _load_sync_file_range()


class _HashingWriter:
    """The file object torch.save writes to: passes every byte on to `f` and sha256es it on the way.

    torch's zip writer only ever appends (it never seeks or tells; this has no `seek`, so a torch
    that tried would fail loudly rather than get a wrong digest), so the digest is that of the file.
    """

    def __init__(self, f: BinaryIO, hasher: ThreadPoolExecutor) -> None:
        self._f = f
        self._fd = f.fileno()
        self._hasher = hasher
        self._sha = hashlib.sha256()
        self._writeback_from = 0
        self.size = 0

    def write(self, data: Any) -> int:
        """Write and hash one buffer torch hands over; returns its length."""
        view = memoryview(data).cast("B")
        if view.nbytes < _PARALLEL_MIN:
            self._sha.update(view)
            self._f.write(view)
        else:
            self._write_large(view)
        self.size += view.nbytes
        return view.nbytes

    def _write_large(self, view: memoryview) -> None:
        # The worker hashes each slice while this thread writes the same slice (both release the
        # GIL), so a tensor costs about max(hash, write) rather than their sum, and the slice is read
        # from memory once: whichever side is second finds it in the cache. The buffer is torch's and
        # may be freed once write() returns, so no hash of it is ever left running, even on error.
        for start in range(0, view.nbytes, _SLICE):
            part = view[start : start + _SLICE]
            hashed = self._hasher.submit(self._sha.update, part)
            try:
                self._f.write(part)
            finally:
                wait([hashed])
            hashed.result()
            self._start_writeback(self.size + start + part.nbytes)

    def _start_writeback(self, end: int) -> None:
        # Start the disk on what is written so far without waiting for it, so that the final fsync
        # finds little left to do; dd conv=fsync leaves it all to the end.
        if _sync_file_range is None or end - self._writeback_from < _WRITEBACK_EVERY:
            return
        self._f.flush()
        _sync_file_range(self._fd, self._writeback_from, end - self._writeback_from, _SYNC_FILE_RANGE_WRITE)
        self._writeback_from = end

    def flush(self) -> None:
        """Flush the underlying file (torch calls this when it is done)."""
        self._f.flush()

    def hexdigest(self) -> str:
        """sha256 of everything written so far."""
        return self._sha.hexdigest()


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; without it a power cut can lose the new directory entry.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a save produced (the launcher's checkpoint event is built from this)."""

    step: int
    path: Path
    size_bytes: int
    sha256: str
    deleted: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back and verified; its tensors are mapped from the file, copy-on-write."""

    step: int
    path: Path
    state: dict[str, Any]


class CheckpointManager:
    """Saves full training state from rank 0, keeps the newest `keep_last`, loads with fallback."""

    def __init__(
        self, directory: str | os.PathLike[str], keep_last: int, is_main: bool, every_steps: int = 1
    ) -> None:
        if keep_last < 1 or every_steps < 1:
            raise ValueError(f"keep_last ({keep_last}) and every_steps ({every_steps}) must be >= 1")
        self.directory = Path(directory).resolve()
        self.keep_last = keep_last
        self.is_main = is_main
        self.every_steps = every_steps
        if is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Leftovers of a writer that died mid-save; never visible as checkpoints, but they take space.
            for tmp in self.directory.glob(".ckpt-*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def path_for(self, step: int) -> Path:
        """Absolute path of the checkpoint for `step`."""
        return self.directory / checkpoint_name(step)

    def steps(self) -> list[int]:
        """Steps that have a checkpoint file, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def should_save(self, step: int, last: bool = False) -> bool:
        """Every `every_steps` steps, and always at the last step."""
        return last or step % self.every_steps == 0

    def save(self, step: int, state: Mapping[str, Any], last: bool = False) -> SavedCheckpoint | None:
        """Write `state` for `step` if due (and on rank 0); returns what was written, else None."""
        if not self.is_main or not self.should_save(step, last):
            return None
        path = self.path_for(step)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256") as hasher:
                # Hashed on the way out: the file is written once and never read back. Every load
                # verifies the bytes on disk against this digest.
                out = _HashingWriter(f, hasher)
                torch.save(dict(state), cast(IO[bytes], out))  # torch calls only write() and flush()
                f.flush()
                os.fsync(f.fileno())
                digest, size = out.hexdigest(), out.size
                on_disk = os.fstat(f.fileno()).st_size
                if size != on_disk:  # cheap proof that the hashed stream is the whole file
                    raise OSError(f"{tmp.name}: wrote {size} bytes but the file has {on_disk}")
            # Sidecar first: then every visible checkpoint already has its checksum next to it.
            _write_atomic(self.sidecar_for(path), f"{digest}  {path.name}\n".encode())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.directory)
        return SavedCheckpoint(step=step, path=path, size_bytes=size, sha256=digest, deleted=self._prune())

    @staticmethod
    def sidecar_for(path: Path) -> Path:
        """Checksum file next to a checkpoint (`ckpt-....pt.sha256`, `sha256sum -c` compatible)."""
        return path.with_name(path.name + ".sha256")

    def _prune(self) -> list[Path]:
        steps = self.steps()
        deleted = []
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            path = self.path_for(step)
            path.unlink(missing_ok=True)
            self.sidecar_for(path).unlink(missing_ok=True)
            deleted.append(path)
        if deleted:
            _fsync_dir(self.directory)
        return deleted

    def read(self, step: int) -> LoadedCheckpoint:
        """Load and verify one checkpoint; raises if missing, corrupt or not a training state."""
        path = self.path_for(step)
        sidecar = self.sidecar_for(path)
        if sidecar.exists():
            words = sidecar.read_text().split()
            expected = words[0] if words else ""
            actual, _ = sha256_file(path)
            if actual != expected:
                raise ValueError(f"{path.name}: sha256 {actual} != sidecar's {expected or '(empty)'}")
        # weights_only: a checkpoint is data, never code; map to CPU so any world/device can resume.
        # mmap: the tensors are mapped (copy-on-write) onto the page cache the hash has just filled,
        # so the file comes off the disk once and nothing is copied here; the one copy is the
        # consumer's (load_state_dict). They are the hashed bytes because a checkpoint is never
        # rewritten in place: saves write aside and rename, pruning unlinks.
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        if not isinstance(state, dict) or "model" not in state or not isinstance(state.get("iter"), int):
            raise ValueError(f"{path.name}: not a training checkpoint (needs 'model' and an int 'iter')")
        return LoadedCheckpoint(step=step, path=path, state=state)

    def load(self, latest: bool = True, step: int | None = None) -> LoadedCheckpoint | None:
        """Exactly `step` if given, else the newest (oldest if not `latest`) that loads, skipping bad ones.

        Returns None when the directory holds no checkpoint; raises when some exist but none loads,
        since silently restarting from scratch would later prune the evidence.
        """
        if step is not None:
            return self.read(step)
        candidates = self.steps()
        if latest:
            candidates.reverse()
        errors = []
        for s in candidates:
            try:
                return self.read(s)
            except Exception as exc:  # corrupt/truncated/foreign file: try the previous one
                print(f"checkpoint {checkpoint_name(s)} unusable, falling back: {exc}", file=sys.stderr)
                errors.append(f"{checkpoint_name(s)}: {exc}")
        if errors:
            raise RuntimeError("no loadable checkpoint in {}: {}".format(self.directory, "; ".join(errors)))
        return None
