"""Write a file once, hashing it on the way out and bypassing the page cache (O_DIRECT) where it can."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import xxhash

# What is written is copied into staging buffers; each full one is sha256ed on one worker thread while
# another XXH3-hashes and writes it to disk, so the copying, the hashing and the disk all overlap.
BUFFER_BYTES = 4 << 20
BUFFERS = 4
# O_DIRECT wants the buffer address, file offset and length aligned to the device's block size:
# 4 KiB covers 512-byte and 4K-native devices. mmap buffers are page-aligned.
_ALIGN = 4096
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def _open(path: Path) -> tuple[int, bool]:
    # Without the page cache a large write neither waits for the kernel to find it fresh pages (slow
    # on a VM that hands freed memory back to its host) nor pushes the training data out of the
    # cache, and the final fsync has nothing left to write back. tmpfs and some others refuse it.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    # 0600 whatever the umask: a checkpoint is the job owner's work, never other local accounts'.
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


@dataclass(frozen=True)
class Digests:
    """What a finished file hashed to: sha256 (what users verify) and XXH3-128 (what loads verify)."""

    sha256: str
    xxh128: str
    size: int


class HashedFileWriter:
    """A write-only file object for torch.save that writes `path` and hashes exactly its bytes.

    torch's zip writer only ever appends (it never seeks or tells; this has no `seek`, so a torch
    that tried would fail loudly rather than get a wrong digest), so the digest is the file's.
    """

    def __init__(self, path: Path) -> None:
        ring = memoryview(mmap.mmap(-1, BUFFERS * BUFFER_BYTES))
        self._free = [ring[i * BUFFER_BYTES : (i + 1) * BUFFER_BYTES] for i in range(BUFFERS)]
        self._in_flight: deque[tuple[memoryview, Future[None], Future[None]]] = deque()
        self._buf = self._free.pop()
        self._fill = 0  # bytes in _buf
        self.size = 0  # bytes accepted so far; the file offset of _buf is size - _fill
        self._padded = False
        self._failed: BaseException | None = None  # a disk error: no write after it is taken
        self._sha = hashlib.sha256()
        self._xxh = xxhash.xxh3_128()
        self._fd, self.direct = _open(path)  # last: nothing after it can fail and leak the descriptor
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256")
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")

    def write(self, data: Any) -> int:
        """Take one buffer from torch (copied at once: torch may free it on return); returns its length."""
        if self._failed is not None:
            # torch still writes its end-of-file records after an error; they must not go into
            # a buffer that may still be in flight.
            raise OSError("an earlier write of this file failed") from self._failed
        src = memoryview(data).cast("B")
        pos = 0
        while pos < src.nbytes:
            n = min(BUFFER_BYTES - self._fill, src.nbytes - pos)
            self._buf[self._fill : self._fill + n] = src[pos : pos + n]
            self._fill += n
            self.size += n
            pos += n
            if self._fill == BUFFER_BYTES:
                self._submit()
                self._buf = self._next_free()
        return src.nbytes

    def flush(self) -> None:
        """Nothing to do: `finish()` writes out the last partial buffer (torch calls this at the end)."""

    def _submit(self) -> None:
        n = self._fill
        view = self._buf
        end = n
        if self.direct and n % _ALIGN:
            # Only the last buffer can be partial: pad it to a block, finish() truncates the padding.
            end = n + _ALIGN - n % _ALIGN
            view[n:end] = bytes(end - n)
            self._padded = True
        offset = self.size - n
        hashed = self._hasher.submit(self._sha.update, view[:n])  # one worker: hashed in order
        written = self._disk.submit(self._write, view, n, end, offset)
        self._in_flight.append((view, hashed, written))
        self._fill = 0

    def _next_free(self) -> memoryview:
        if self._free:
            return self._free.pop()
        view, hashed, written = self._in_flight.popleft()
        try:
            hashed.result()
            written.result()  # a disk error (ENOSPC...) surfaces here, inside torch.save
        except BaseException as exc:
            self._failed = exc
            raise
        return view

    def _write(self, view: memoryview, n: int, end: int, offset: int) -> None:
        # XXH3 (a tenth of sha256's time) on the disk thread, which otherwise only waits for the
        # device: the sha256 thread is the save's critical path, and this keeps it off it.
        self._xxh.update(view[:n])
        self._pwrite(view[:end], offset)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            try:
                n = os.pwrite(self._fd, view, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # Some filesystems take O_DIRECT at open and refuse it on write: use the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self.direct = False
                continue
            view, offset = view[n:], offset + n

    def finish(self) -> Digests:
        """Write out the rest, trim any padding and fsync; returns the file's digests and size."""
        if self._fill:
            self._submit()
        while self._in_flight:
            self._next_free()
        if self._padded:
            os.ftruncate(self._fd, self.size)
        os.fsync(self._fd)  # O_DIRECT skips the page cache, not the device's cache: still needed
        on_disk = os.fstat(self._fd).st_size
        if on_disk != self.size:  # cheap proof that the hashed stream is the whole file
            raise OSError(f"wrote {self.size} bytes but the file has {on_disk}")
        return Digests(sha256=self._sha.hexdigest(), xxh128=self._xxh.hexdigest(), size=self.size)

    def __enter__(self) -> HashedFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On an error, the workers may still be using the buffers and the descriptor: let them end.
        wait([f for _, hashed, written in self._in_flight for f in (hashed, written)])
        self._hasher.shutdown()
        self._disk.shutdown()
        os.close(self._fd)


_CHUNK = 8 << 20  # bytes hashed per call by the file hashers below


class _Hash(Protocol):
    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def fsync_dir(path: Path) -> None:
    """Make the renames into directory `path` durable (without it a power cut can lose a new entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file."""
    return _hash_file(path, hashlib.sha256())


def xxh128_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(hex XXH3-128, size in bytes) of a file (what `xxhsum -H2` prints)."""
    return _hash_file(path, xxhash.xxh3_128())


def _hash_file(path: str | os.PathLike[str], h: _Hash) -> tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        try:
            # Hashed from a mapping rather than read(): straight from the page cache, without a copy
            # of every byte into a buffer.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # an empty file, or a filesystem that cannot map
            buf = memoryview(bytearray(_CHUNK))
            size = 0
            while n := f.readinto(buf):
                h.update(buf[:n])
                size += n
            return h.hexdigest(), size
        with mapped:
            if hasattr(mapped, "madvise"):  # a long readahead keeps the disk busy while this hashes
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for start in range(0, len(view), _CHUNK):
                    h.update(view[start : start + _CHUNK])
            finally:
                view.release()
            return h.hexdigest(), len(mapped)
