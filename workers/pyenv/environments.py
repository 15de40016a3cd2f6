"""A job's Python environment on this worker: its requirements, its key, and the cache that keeps it.

One environment per key (the sha256 of the normalised requirements, the worker's Python, torch and
numpy versions and its package sources), built once per host in `DPTRAIN_ENV_CACHE_DIR/<key>` and
reused by every attempt and node that needs it. Each key has a lock file (fcntl.flock): the builder
holds it exclusively, so concurrent attempts and the nodes of a multi-node job on one host build
once and the others wait, then use it; every user holds it shared while its ranks run, so eviction
(least recently used first, past DPTRAIN_ENV_CACHE_MAX_BYTES) never removes one in use. An
environment is complete once its manifest exists (written last); a folder without one is the
remains of a build that died, removed by the next builder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from api_schemas import JobError, JobSpec
from rank_contract.failures import Failure
from rank_contract.files import create_beneath, read_beneath
from service.config import Settings
from service.jobs import requirements

MANIFEST = "dptrain-env.json"
_MAX_MANIFEST_BYTES = 1 << 16
LOCK_POLL_SECONDS = 0.1


class EnvironmentFailed(Exception):
    """The job's environment cannot be had; `error` is the job's error (never retried)."""

    def __init__(self, error: JobError) -> None:
        super().__init__(error.message)
        self.error = error


class Aborted(Exception):
    """The wait or the build was given up: the attempt is being stopped (cancel, fenced)."""


@dataclass(frozen=True)
class Environment:
    """A built environment held for use: its folder, its interpreter, and how it was had."""

    key: str
    root: Path
    hit: bool
    seconds: float

    @property
    def python(self) -> Path:
        """The environment's interpreter: the worker's, with the job's packages first on its path."""
        return self.root / "bin" / "python"


def requirement_lines(spec: JobSpec, *, code_dir: Path | None, settings: Settings) -> list[str] | None:
    """The job's requirement lines (from the spec or its requirements file), checked; None without any.

    EnvironmentFailed when the file is missing from the code or a line is refused (a spec stored
    before a rule, or a requirements file, which the API does not read).
    """
    env = spec.environment
    if env is None:
        return None
    if env.requirements is not None:
        lines = list(env.requirements)
    else:
        assert env.requirements_file is not None
        path = (code_dir / env.requirements_file) if code_dir is not None else None
        # Inside the code tree even through a link (the unpacker keeps none that lead out; checked anyway).
        inside = path is not None and code_dir is not None and code_dir.resolve() in path.resolve().parents
        if path is None or not path.is_file() or not inside:
            message = (
                f"environment.requirements_file {env.requirements_file!r} is not a file in the job's code"
            )
            raise EnvironmentFailed(JobError(type=Failure.REQUIREMENTS_FILE_MISSING, message=message))
        lines = requirements.parse_lines(path.read_text(errors="replace"))
    found = requirements.problems(lines, allow_options=settings.pip_allow_options)
    if found:
        first = found[0]
        message = f"requirement {first.line!r} is refused: {first.reason}"
        raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message))
    return lines


@functools.cache
def worker_versions() -> dict[str, str]:
    """What the worker brings underneath every environment: its Python, torch and numpy."""
    found = {"python": sys.version}
    for name in ("torch", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def environment_key(lines: list[str], *, settings: Settings) -> str:
    """The sha256 naming the environment of `lines` on this worker (its versions and package sources)."""
    what = {
        "requirements": requirements.normalised(lines),
        "worker": worker_versions(),
        # The worker's own environment, which the job's is layered over.
        "prefix": sys.prefix,
        "index": settings.pip_index_url,
        "find_links": settings.pip_find_links,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _lock(fd: int, kind: int, *, poll: Callable[[], bool]) -> None:
    """flock `fd` with `kind`, polling so that `poll` (False: give up, Aborted) runs while it waits."""
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if not poll():
            raise Aborted
        time.sleep(LOCK_POLL_SECONDS)


def manifest(root: Path) -> dict[str, object] | None:
    """The manifest of a complete environment at `root`, None if there is none (absent or unfinished)."""
    # The build ran the job's code as the ranks' user in this folder: no link followed, a bound read.
    data = read_beneath(root, MANIFEST, limit=_MAX_MANIFEST_BYTES)
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


@contextlib.contextmanager
def held(
    *,
    cache: Path,
    key: str,
    build: Callable[[Path], None],
    poll: Callable[[], bool],
    max_bytes: int,
) -> Iterator[Environment]:
    """The environment `key`, built by `build(root)` unless the cache has it, held (shared) while in use.

    `build` raises EnvironmentFailed (or Aborted); `poll` runs while waiting for another builder.
    """
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / key
    started = time.monotonic()
    fd = os.open(cache / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(fd, fcntl.LOCK_SH, poll=poll)
        hit = manifest(root) is not None
        if not hit:
            fcntl.flock(fd, fcntl.LOCK_UN)
            _lock(fd, fcntl.LOCK_EX, poll=poll)
            # Another attempt may have built it while this one waited for the lock.
            hit = manifest(root) is not None
            if not hit:
                shutil.rmtree(root, ignore_errors=True)  # a build that died midway
                root.mkdir(mode=0o755)
                try:
                    build(root)
                except BaseException:
                    shutil.rmtree(root, ignore_errors=True)
                    raise
                seconds = time.monotonic() - started
                record = {"key": key, "bytes": size_of(root), "build_seconds": round(seconds, 3)}
                _write_manifest(root, record)
            fcntl.flock(fd, fcntl.LOCK_SH)
        # Least recently used: the manifest's mtime is the environment's last use.
        with contextlib.suppress(OSError):
            os.utime(root / MANIFEST, follow_symlinks=False)
        if not hit:
            evict(cache, max_bytes=max_bytes, keep=key)
        yield Environment(key=key, root=root, hit=hit, seconds=time.monotonic() - started)
    finally:
        os.close(fd)  # releases the lock


def _write_manifest(root: Path, record: dict[str, object]) -> None:
    # The build's code owned `root` a moment ago and may have left a link (to a host file) or a FIFO
    # under the temporary name: created beneath `root` without following one, its mode set on the fd.
    tmp = f".{MANIFEST}.tmp"
    f = create_beneath(root, tmp, append=False)
    if f is None:
        message = f"the build left {tmp} in the environment as a link or not a regular file"
        raise EnvironmentFailed(JobError(type=Failure.ENVIRONMENT_BUILD_FAILED, message=message))
    with f:
        f.write(json.dumps(record).encode())
        os.fchmod(f.fileno(), 0o644)
    os.replace(root / tmp, root / MANIFEST)


def cached(cache: Path) -> list[dict[str, object]]:
    """The complete environments in `cache`: each manifest, with its last use (`used_at`, Unix time)."""
    found = []
    for root in cache.iterdir() if cache.is_dir() else ():
        if root.is_dir() and (record := manifest(root)) is not None:
            with contextlib.suppress(OSError):
                found.append({**record, "used_at": (root / MANIFEST).lstat().st_mtime})
    return found


def listed_environments(cache: Path) -> list[dict[str, object]]:
    """`cached(cache)` as GET /v1/workers shows it (used_at as ISO-8601), most recently used first."""
    found = sorted(cached(cache), key=lambda e: float(e["used_at"]), reverse=True)  # type: ignore[arg-type]
    return [
        {**e, "used_at": datetime.fromtimestamp(float(e["used_at"]), UTC).isoformat()}  # type: ignore[arg-type]
        for e in found
    ]


def evict(cache: Path, *, max_bytes: int, keep: str) -> list[str]:
    """Remove the least recently used environments not in use until the cache fits `max_bytes`."""
    entries = sorted(cached(cache), key=lambda e: float(e["used_at"]))  # type: ignore[arg-type]
    total = sum(int(e["bytes"]) for e in entries)  # type: ignore[call-overload]
    removed = []
    for entry in entries:
        if total <= max_bytes:
            break
        key = str(entry["key"])
        if key == keep:
            continue
        fd = os.open(cache / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use by an attempt's ranks (or being rebuilt): never evicted
            # The manifest first: a reader that finds the folder without it rebuilds, never uses half.
            with contextlib.suppress(FileNotFoundError):
                (cache / key / MANIFEST).unlink()
            shutil.rmtree(cache / key, ignore_errors=True)
            total -= int(entry["bytes"])  # type: ignore[call-overload]
            removed.append(key)
        finally:
            os.close(fd)
    return removed


def size_of(root: Path) -> int:
    """The bytes of the regular files under `root`, never following a link (what the cache counts)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
