"""An attempt's scratch: the ranks' working directory, /tmp and HOME, made at its start, removed at its end.

They live in the node's run directory, beside what stays (spec.json, logs/, events/): the ranks
reach them through its mount (workers/sandbox/bubblewrap.py), and the hand-over
(workers/sandbox/rank_setup.py) gives them to the ranks' user with the rest. Only what the ranks
write on purpose outlives the attempt: checkpoints, logs and events.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rank_contract.layout import JobFiles, RunFiles

# Where unsandboxed ranks' TMPDIR points: a short link to the attempt's tmp. multiprocessing makes
# its sockets under TMPDIR, and an AF_UNIX path has 108 bytes: a run directory under an ordinary
# DPTRAIN_HOME is already too deep for a DataLoader's workers. (In the sandbox TMPDIR is /tmp.)
SHORT_TMP_PARENT = Path("/tmp")


@dataclass(frozen=True)
class Scratch:
    """The scratch folders of one node of an attempt."""

    workdir: Path  # the ranks' working directory: a writable copy of the job's code tree
    tmp: Path  # the ranks' /tmp (TMPDIR)
    home: Path  # the ranks' HOME


def make_scratch(run_dir: Path, code_dir: Path | None) -> Scratch:
    """Make the attempt's scratch folders; the working directory holds a copy of `code_dir`'s files.

    A copy, not the tree itself: a script that writes relative paths (its outputs, a resume state)
    writes into its own attempt's folder, never into the cache that the next job with the same code
    runs from.
    """
    files = RunFiles(run_dir)
    scratch = Scratch(workdir=files.workdir, tmp=files.tmp, home=files.home)
    # A delivery of the same attempt again (after a worker's crash) starts from a clean slate.
    remove_scratch(run_dir)
    for folder in (scratch.tmp, scratch.home):
        folder.mkdir(parents=True)
    if code_dir is None:
        scratch.workdir.mkdir()
    else:
        # The cache's files are read-only (0444/0555): the copy's are writable by their owner.
        shutil.copytree(code_dir, scratch.workdir, symlinks=True, copy_function=shutil.copyfile)
        _writable(scratch.workdir, code_dir)
    return scratch


def _writable(copy: Path, source: Path) -> None:
    """Make the copy its owner's to change: folders 0700, files 0600 (0700 if executable)."""
    for root, dirs, files in os.walk(copy):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                executable = os.stat(source / os.path.relpath(path, copy)).st_mode & stat.S_IXUSR
                os.chmod(path, 0o700 if executable else 0o600)
    os.chmod(copy, 0o700)


def short_tmp(run_dir: Path) -> Path:
    """A short path for the ranks' TMPDIR outside the sandbox: a link to `run_dir`'s tmp, or the tmp itself.

    Named after the run directory, so the attempt's end finds it again (`remove_scratch`). Only a link
    this worker may replace is used: where another account's file holds the name, the tmp itself.
    """
    target = RunFiles(run_dir).tmp
    link = _short_link(run_dir)
    try:
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    except OSError:
        return target
    return link


def _short_link(run_dir: Path) -> Path:
    return SHORT_TMP_PARENT / f"dptrain-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]}"


def remove_scratch(run_dir: Path) -> None:
    """Delete the scratch folders of the attempt in `run_dir` (quiet about those already gone)."""
    files = RunFiles(run_dir)
    for folder in files.scratch:
        remove_tree(folder)
    link = _short_link(run_dir)
    with contextlib.suppress(OSError):
        if link.is_symlink() and Path(os.readlink(link)) == files.tmp:
            link.unlink()


def remove_earlier(job: JobFiles, *, attempt: int, node_rank: int) -> None:
    """Delete scratch this node's earlier attempts of the job left (their worker died before removing it)."""
    for earlier in range(1, attempt):
        remove_scratch(job.run(earlier, node_rank).folder)


def remove_tree(path: Path) -> None:
    """Delete `path` and everything below it, folders a job made read-only too; quiet if it is gone."""

    def unlock(_func: Callable[..., object], failed: str, exc: object) -> None:
        if isinstance(exc, tuple) and isinstance(exc[1], FileNotFoundError):
            return  # removed meanwhile (an ending attempt's own cleanup)
        # A folder without write or execute permission (the job's chmod): open it up and retry.
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
            shutil.rmtree(failed, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(failed)

    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=unlock)
