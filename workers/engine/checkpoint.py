"""Atomic, verified, retained checkpoints (`ckpt-{step:09d}.pt` + sha256sum- and xxhsum-style sidecars).

The names of sidecars and of temp files are defined here and nowhere else; the names of checkpoint
files and the step a name stands for live in `rank_contract.checkpoints` (re-exported here), which
the API reads too. torch is imported only where a checkpoint is written or read, so that the Celery
worker process, which lists and matches checkpoint files (`workers/attempt/checkpoint_rows.py`), can use
the same functions without loading torch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

from rank_contract.checkpoints import MAX_STEP, checkpoint_name, step_of  # noqa: F401 - re-exported
from rank_contract.files import read_file
from workers.engine.events import CheckpointEvent
from workers.engine.hashed_file import HashedFileWriter, fsync_dir, sha256_file, xxh128_file

_TEMP_GLOB = ".ckpt-*.tmp-*"
# A sidecar holds one digest and a name: anything longer is not one.
_MAX_SIDECAR_BYTES = 4096
# Unlinking a file frees its blocks, which takes time in proportion to its size: a pruned
# checkpoint at least this big is renamed out of sight at once and unlinked by a background thread,
# so the save does not wait; smaller ones go inline.
_UNLINK_IN_BACKGROUND_BYTES = 64 << 20


def best_marker(directory: str | os.PathLike[str]) -> Path:
    """The file naming the step of the best checkpoint (checkpoint.keep_best), one line: the step."""
    return Path(directory) / "best-step"


def read_best_step(directory: str | os.PathLike[str]) -> int | None:
    """The step the best marker names, if there is a marker and its checkpoint file; else None."""
    # The ranks write the folder: no link followed, a few bytes read at most (rank_contract.files).
    data = read_file(best_marker(directory), limit=64)
    if data is None:
        return None
    text = data.decode("ascii", "replace").strip()
    if not text.isascii() or not text.isdigit():
        return None
    step = int(text)
    return step if step <= MAX_STEP and (Path(directory) / checkpoint_name(step)).exists() else None


def checkpoint_files(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """The checkpoint files in `directory` by step, oldest first (empty if there is no such directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found = {step: p for p in directory.iterdir() if (step := step_of(p)) is not None}
    return dict(sorted(found.items()))


def temp_path(path: Path, *, tag: str = "") -> Path:
    """Where `path` is written (or a pruned checkpoint waits for its unlink) before it is visible.

    A dot name that is no checkpoint's, with this process's id, so concurrent writers never collide
    and the next writer can sweep what a killed one left (`temp_files`).
    """
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{tag}")


def temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Temp files of checkpoints and sidecars in `directory` (left behind by a writer that died)."""
    return sorted(Path(directory).glob(_TEMP_GLOB))


def sidecar_digest(sidecar: Path) -> str:
    """The digest a `sha256sum`/`xxhsum`-style sidecar records ("" for an empty file)."""
    # Read as the ranks left it: no link followed, a bounded read (rank_contract.files).
    data = read_file(sidecar, limit=_MAX_SIDECAR_BYTES) or b""
    words = data.decode("ascii", "replace").split()
    return words[0] if words else ""


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    # torch.save computes a CRC32 of every record before writing it: a serial pass over each tensor
    # on the main thread (a third of the hashing's cost) that nothing here uses, since the sidecars'
    # digests cover every byte and read() checks one before each load. torch.load ignores the field
    # (its docs say so); only generic zip tools such as `unzip -t` would flag the zeros.
    import torch  # here, not at the top: see the module's docstring

    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # a torch older than the option always computes it
        yield
        return
    before = get()
    set_(False)
    try:
        yield
    finally:
        set_(before)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = temp_path(path)
    try:
        # 0600 like the checkpoint itself (hashed_file), whatever the umask of the rank.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
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
    best: bool = False

    def event(self) -> CheckpointEvent:
        """The event that tells the runner of this save (a job checkpoint row, and the pruned ones gone)."""
        return CheckpointEvent(
            step=self.step,
            size_bytes=self.size_bytes,
            sha256=self.sha256,
            deleted=[s for p in self.deleted if (s := step_of(p)) is not None],
            best=self.best,
        )


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back and verified; its tensors are mapped from the file, copy-on-write."""

    step: int
    path: Path
    state: dict[str, Any]


class CheckpointManager:
    """Saves full training state from rank 0, keeps the newest `keep_last`, loads with fallback."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int,
        is_main: bool,
        every_steps: int = 1,
        *,
        training_state: bool = True,
        keep_best: Literal["min", "max"] | None = None,
    ) -> None:
        if keep_last < 1 or every_steps < 1:
            raise ValueError(f"keep_last ({keep_last}) and every_steps ({every_steps}) must be >= 1")
        self.directory = Path(directory).resolve()
        self.keep_last = keep_last
        self.is_main = is_main
        self.every_steps = every_steps
        # The engine's checkpoints are training states ('model' and an int 'iter'), which read()
        # checks; the SDK's (dptrain.save_checkpoint) are whatever dict the user's script saved.
        self.training_state = training_state
        # checkpoint.keep_best: whether a lower or a higher figure is better, and the best (step, figure)
        # so far, which the training state carries across a restart (`best_state`, `restore_best`).
        self.keep_best = keep_best
        self.best: tuple[int, float] | None = None
        self._unlinker: ThreadPoolExecutor | None = None
        self._unlinking: list[Future[None]] = []
        if is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Leftovers of a writer that died mid-save; never visible as checkpoints, but they take space.
            for tmp in temp_files(self.directory):
                tmp.unlink(missing_ok=True)

    def path_for(self, step: int) -> Path:
        """Absolute path of the checkpoint for `step`."""
        return self.directory / checkpoint_name(step)

    def steps(self) -> list[int]:
        """Steps that have a checkpoint file, oldest first."""
        return list(checkpoint_files(self.directory))

    def is_better(self, value: float) -> bool:
        """Whether an evaluation figure beats the best so far (never for NaN; always for the first)."""
        if self.keep_best is None or math.isnan(value):
            return False
        if self.best is None:
            return True
        return value < self.best[1] if self.keep_best == "min" else value > self.best[1]

    def consider_best(self, step: int, figures: Mapping[str, float], metric: str) -> bool:
        """Make `step` the best if its figure for `metric` beats the best so far; whether it did."""
        if metric not in figures:
            raise ValueError(
                f"checkpoint.keep_best.metric {metric!r} is not among the evaluation's figures "
                f"({', '.join(sorted(figures))})"
            )
        if not self.is_better(figures[metric]):
            return False
        self.best = (step, figures[metric])
        return True

    def best_state(self) -> dict[str, Any]:
        """The best so far as weights_only-safe values for the training state ({} if none)."""
        return {} if self.best is None else {"best": {"step": self.best[0], "value": self.best[1]}}

    def restore_best(self, state: Mapping[str, Any]) -> None:
        """Take the best so far from a loaded training state (every rank: the same decisions follow)."""
        best = state.get("best")
        if self.keep_best is None or not isinstance(best, dict):
            return
        step, value = best.get("step"), best.get("value")
        if isinstance(step, int) and isinstance(value, float):
            self.best = (step, value)

    def should_save(self, step: int, last: bool = False) -> bool:
        """Every `every_steps` steps, and always at the last step."""
        return last or step % self.every_steps == 0

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        last: bool = False,
        *,
        best: bool = False,
        announce: Callable[[CheckpointEvent], None] | None = None,
    ) -> SavedCheckpoint | None:
        """Write `state` for `step` if due or `best` (and on rank 0); returns what was written, else None.

        `best`: this is the best checkpoint so far (set `self.best` first): the marker names it, and
        pruning keeps it besides the newest `keep_last`. `announce` gets the save's event once the
        file is in place and before the older ones are pruned: a kill in between then leaves files
        not yet listed, which the worker lists at the attempt's end, never listed ones that are gone.
        """
        if not self.is_main or not (best or self.should_save(step, last)):
            return None
        import torch  # here, not at the top: see the module's docstring

        path = self.path_for(step)
        tmp = temp_path(path)
        try:
            with HashedFileWriter(tmp) as out:
                # Hashed on the way out (and fsynced): the file is written once and never read back.
                # Every load verifies the bytes on disk against this digest.
                with _without_zip_crc32():
                    torch.save(dict(state), cast(IO[bytes], out))  # torch calls only write() and flush()
                digests = out.finish()
            # Sidecars first: then every visible checkpoint already has its checksums next to it.
            _write_atomic(self.sidecar_for(path), f"{digests.sha256}  {path.name}\n".encode())
            _write_atomic(self.fast_sidecar_for(path), f"{digests.xxh128}  {path.name}\n".encode())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        if best:
            # After the file: the marker never names a checkpoint that is not there yet.
            _write_atomic(best_marker(self.directory), f"{step}\n".encode())
        fsync_dir(self.directory)
        saved = SavedCheckpoint(
            step=step,
            path=path,
            size_bytes=digests.size,
            sha256=digests.sha256,
            deleted=[self.path_for(s) for s in self._doomed()],
            best=best,
        )
        if announce is not None:
            announce(saved.event())
        self._prune(saved.deleted)
        return saved

    @staticmethod
    def sidecar_for(path: Path) -> Path:
        """Checksum file next to a checkpoint (`ckpt-....pt.sha256`, `sha256sum -c` compatible)."""
        return path.with_name(path.name + ".sha256")

    @staticmethod
    def fast_sidecar_for(path: Path) -> Path:
        """The XXH3-128 checksum file that loads verify (`ckpt-....pt.xxh128`, `xxhsum -c` compatible).

        Why two: the sha256 is what users check a downloaded checkpoint against (it is in the API
        and the download's header), but on one core it is slower than a fast disk, so it would be
        most of a load; XXH3 keeps up with the disk. It is not a cryptographic hash, and
        need not be here: the sidecars guard against torn, truncated and bit-rotted files, and
        whoever can rewrite a checkpoint can rewrite its sidecars too (`weights_only` loading is
        what makes a crafted file harmless).
        """
        return path.with_name(path.name + ".xxh128")

    @staticmethod
    def sidecars(path: Path) -> tuple[Path, Path]:
        """Both sidecars of a checkpoint: (`.sha256`, `.xxh128`)."""
        return CheckpointManager.sidecar_for(path), CheckpointManager.fast_sidecar_for(path)

    def _doomed(self) -> list[int]:
        """The steps pruning removes now: all but the newest `keep_last` and the best."""
        steps = self.steps()
        keep = self.best[0] if self.best is not None else None
        return [step for step in steps[: max(0, len(steps) - self.keep_last)] if step != keep]

    def _prune(self, paths: list[Path]) -> None:
        for path in paths:
            self._remove(path)
            # After the file: never a checkpoint without its sidecars.
            for sidecar in self.sidecars(path):
                sidecar.unlink(missing_ok=True)
        if paths:
            fsync_dir(self.directory)

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size < _UNLINK_IN_BACKGROUND_BYTES:
            path.unlink(missing_ok=True)
            return
        # A temp name: no longer a checkpoint, and swept by the next writer if this process dies
        # before the unlink. Worker threads are joined at interpreter exit, so it does not leak.
        doomed = temp_path(path, tag="-pruned")
        try:
            os.replace(path, doomed)
        except FileNotFoundError:
            return
        if self._unlinker is None:
            self._unlinker = ThreadPoolExecutor(1, thread_name_prefix="ckpt-unlink")
        self._unlinking = [f for f in self._unlinking if not f.done()]
        self._unlinking.append(self._unlinker.submit(doomed.unlink, missing_ok=True))

    def wait_pruned(self) -> None:
        """Wait until the files of pruned checkpoints are gone from the disk (see `_remove`)."""
        pending, self._unlinking = self._unlinking, []
        for unlinked in pending:
            unlinked.result()

    def read(self, step: int) -> LoadedCheckpoint:
        """Load and verify one checkpoint; raises if missing, corrupt or not the state expected."""
        import torch  # here, not at the top: see the module's docstring

        path = self.path_for(step)
        # The XXH3 sidecar where there is one; checkpoints written before it have only the sha256.
        for sidecar, name, digest_of in (
            (self.fast_sidecar_for(path), "xxh128", xxh128_file),
            (self.sidecar_for(path), "sha256", sha256_file),
        ):
            if sidecar.exists():
                expected = sidecar_digest(sidecar)
                actual, _ = digest_of(path)
                if actual != expected:
                    raise ValueError(f"{path.name}: {name} {actual} != sidecar's {expected or '(empty)'}")
                break
        # weights_only: a checkpoint is data, never code; map to CPU so any world/device can resume.
        # mmap: the tensors are mapped (copy-on-write) onto the page cache the hash has just filled,
        # so the file comes off the disk once and nothing is copied here; the one copy is the
        # consumer's (load_state_dict). They are the hashed bytes because a checkpoint is never
        # rewritten in place: saves write aside and rename, pruning unlinks.
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path.name}: not a checkpoint (holds a {type(state).__name__}, not a dict)")
        if self.training_state and ("model" not in state or not isinstance(state.get("iter"), int)):
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
