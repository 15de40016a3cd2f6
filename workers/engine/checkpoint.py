"""Atomic, verified, retained checkpoints (`ckpt-{step:09d}.pt` + a sha256sum-style sidecar)."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_CHUNK = 1 << 20


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` optimizer steps."""
    return f"ckpt-{step:09d}.pt"


def sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


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
    """A checkpoint read back and verified."""

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
            with open(tmp, "wb") as f:
                torch.save(dict(state), f)
                f.flush()
                os.fsync(f.fileno())
            # Hash what is actually in the file, read back, rather than what we meant to write.
            digest, size = sha256_file(tmp)
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
        state = torch.load(path, weights_only=True, map_location="cpu")
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
