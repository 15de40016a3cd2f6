"""Private PostgreSQL and Redis servers that a fault test may stop and start at will.

Fault tests never restart the machine's shared servers: other test runs use them at the same time.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from sqlalchemy import create_engine, text

from tests.conftest import free_port


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return path


class PrivatePostgres:
    """A throwaway cluster on a free port in a temp dir; `stop()`/`start()` restart it with its data."""

    def __init__(self, *, listen: tuple[str, ...] = ("127.0.0.1",), trust: str | None = None) -> None:
        """`listen`: its addresses; `trust`: a further network (CIDR) allowed in without a password."""
        self.listen = listen
        # Not under pytest's tmp_path: its parents are private to root, and initdb refuses to run as
        # root, so the cluster belongs to the `postgres` user when the tests run as root.
        self.dir = Path(tempfile.mkdtemp(prefix="dptrain-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        if trust is not None:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {trust} trust\n")

    def _run(self, *cmd: str) -> None:
        proc = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        listen = ",".join(self.listen)
        opts = f"-c listen_addresses={listen} -c port={self.port} -c unix_socket_directories={self.dir}"
        opts += " -c fsync=off"
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: open connections are closed, as in a real restart."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        """A migrated database on this cluster; returns its URL."""
        from migrations import upgrade

        admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        upgrade(self.url(name))
        return self.url(name)

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    """`redis-server` without persistence on a free port, as a child process."""

    def __init__(self, log_dir: Path, *, bind: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.bind = bind
        self.port = free_port()
        self.log = log_dir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        cmd = [binary, "--port", str(self.port), "--bind", *self.bind, "--save", "", "--appendonly", "no"]
        cmd += ["--protected-mode", "no"]  # other addresses than loopback: the test's own network
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
