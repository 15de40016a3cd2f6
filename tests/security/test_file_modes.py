"""What the service and its workers write is readable by their own account only (docs/security.md)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from service.config import Settings
from service.dispatch import celery_config
from service.files import write_private
from tests.backends import sqlite_app
from workers.engine.checkpoint import CheckpointManager
from workers.engine.process import redirect_output
from workers.node.celery_app import _private_files, app

GROUP_OR_OTHER = 0o077


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """Run the block under `mask`, then give the test process its own back."""
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def _code_archive() -> tuple[bytes, str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("train.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"1\n"))
    return buf.getvalue(), hashlib.sha256(buf.getvalue()).hexdigest()


def _write_everything(home: Path) -> None:
    """What a service writes: its database and WAL, the queue file, a code archive, a checkpoint, a token."""
    home.mkdir()
    with sqlite_app(home) as api:
        body, sha = _code_archive()
        r = api.put(f"/v1/code/{sha}", content=body, headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (home / "dptrain.db-wal").exists(), "expected the app's connection to hold a WAL"
        celery_config(Settings(home=home, broker_url=f"sqla+sqlite:///{home / 'broker.db'}"))
    job = home / "artifacts" / "jobs" / "j"
    checkpoints = CheckpointManager(job / "checkpoints", keep_last=2, is_main=True)
    checkpoints.save(1, {"model": {"w": torch.zeros(2)}, "iter": 1}, best=True)
    undo = redirect_output(job / "attempt-1" / "logs" / "rank0.log")
    undo()
    (home / "token").write_text("an older release's token\n")  # 0644 under a usual umask
    write_private(home / "token", "a-token\n")


def _modes(home: Path) -> dict[str, str]:
    found = {}
    for path in [home, *home.rglob("*")]:
        found[str(path.relative_to(home))] = oct(stat.S_IMODE(path.lstat().st_mode))
    return found


class TestFileModes:
    def test_files_are_private_whatever_the_umask(self, tmp_path: Path) -> None:
        with umask(0o022):  # a usual umask: folders come out 0755, which is the umask's business
            _write_everything(tmp_path / "home")
        home = tmp_path / "home"
        files = {name: mode for name, mode in _modes(home).items() if (home / name).is_file()}
        expected = {
            "dptrain.db",
            "dptrain.db-wal",
            "broker.db",
            "token",
            "artifacts/jobs/j/checkpoints/best-step",
        }
        assert expected <= set(files), f"expected {sorted(expected)} among {sorted(files)}"
        assert any(n.startswith("artifacts/code/") for n in files), f"no code archive in {sorted(files)}"
        wrong = {name: mode for name, mode in files.items() if int(mode, 8) & GROUP_OR_OTHER}
        assert not wrong, f"expected 0600 for the database, queue, archives, checkpoints, logs: {wrong}"

    def test_under_the_worker_s_umask_every_file_and_folder_is_private(self, tmp_path: Path) -> None:
        before = os.umask(0o022)
        try:
            # The worker's own start (a Celery worker_init handler) sets the umask its ranks inherit.
            _private_files(sender=SimpleNamespace(app=app))
            assert os.umask(0o077) == 0o077, "expected the worker's start to set umask 077"
            _write_everything(tmp_path / "home")
        finally:
            os.umask(before)
        modes = _modes(tmp_path / "home")
        wrong = {name: mode for name, mode in modes.items() if int(mode, 8) & GROUP_OR_OTHER}
        assert not wrong, f"expected no group or other bit on any file or folder: {wrong}"
