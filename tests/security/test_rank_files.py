"""Files a job's ranks can write are read as hostile input (rank_contract.files, workers/reporting/tail.py).

A link at any component of the path, a FIFO, a device, a file swapped for a link between two reads,
a folder swapped for a link: nothing is read through any of them, nothing blocks, and reads stay
within their byte bound.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest

from rank_contract.files import create_beneath, open_beneath, read_beneath, read_file, touch_beneath
from workers.attempt.end import launcher_error
from workers.command.failure import from_hook_file, log_tail
from workers.pyenv import environments
from workers.reporting.tail import Tail, TailSet


@pytest.fixture
def secret(tmp_path: Path) -> tuple[Path, str]:
    """A host file (outside the ranks' folder) holding a random marker, and the marker."""
    marker = f"SECRET-{uuid.uuid4().hex}"
    host = tmp_path / "host"
    host.mkdir()
    path = host / "secret.log"
    path.write_text(f'{{"type": "{marker}", "message": "{marker}"}}\n{marker}\n')
    return path, marker


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A ranks' run directory with logs/ and events/."""
    run = tmp_path / "run"
    for sub in ("logs", "events"):
        (run / sub).mkdir(parents=True)
    return run


class TestOpenBeneath:
    def test_a_regular_file_is_read(self, run_dir: Path) -> None:
        (run_dir / "logs" / "rank0.log").write_bytes(b"hello\n")
        assert read_beneath(run_dir, "logs/rank0.log", limit=100) == b"hello\n"

    def test_a_link_as_the_file_is_refused(self, run_dir: Path, secret: tuple[Path, str]) -> None:
        (run_dir / "logs" / "x.log").symlink_to(secret[0])
        assert open_beneath(run_dir, "logs/x.log") is None
        assert read_file(run_dir / "logs" / "x.log", limit=1 << 20) is None

    def test_a_link_as_a_folder_on_the_way_is_refused(self, run_dir: Path, secret: tuple[Path, str]) -> None:
        (run_dir / "linked").symlink_to(secret[0].parent)
        assert open_beneath(run_dir, "linked/secret.log") is None
        assert read_file(run_dir / "linked" / "secret.log", limit=1 << 20) is None

    def test_a_link_as_the_root_itself_is_refused(self, tmp_path: Path, secret: tuple[Path, str]) -> None:
        (tmp_path / "root").symlink_to(secret[0].parent)
        assert open_beneath(tmp_path / "root", "secret.log") is None

    def test_dot_dot_and_absolute_parts_are_refused(self, run_dir: Path, secret: tuple[Path, str]) -> None:
        assert open_beneath(run_dir / "logs", "../../host/secret.log") is None
        assert open_beneath(run_dir, "/" + str(secret[0])) is None

    def test_a_fifo_is_refused_without_waiting_for_a_writer(self, run_dir: Path) -> None:
        os.mkfifo(run_dir / "logs" / "rank0.log")
        done: list[object] = []
        reader = threading.Thread(
            target=lambda: done.append(read_beneath(run_dir, "logs/rank0.log", limit=10))
        )
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "opening a FIFO waited for a writer"
        assert done == [None]

    def test_a_device_is_refused(self) -> None:
        assert open_beneath(Path("/dev"), "zero") is None, "/dev/zero is no regular file"

    def test_reads_stop_at_their_bound(self, run_dir: Path) -> None:
        (run_dir / "logs" / "big.log").write_bytes(b"a" * 1000 + b"z" * 1000)
        assert read_beneath(run_dir, "logs/big.log", limit=10) == b"a" * 10
        assert read_beneath(run_dir, "logs/big.log", limit=10, from_end=True) == b"z" * 10


class TestWritesIntoTheRanksFolder:
    def test_a_link_in_the_files_place_is_never_written_through(self, run_dir: Path, tmp_path: Path) -> None:
        target = tmp_path / "host" / "created-by-root"
        (run_dir / "stop").symlink_to(target)
        assert touch_beneath(run_dir, "stop") is False
        assert create_beneath(run_dir, "stop", append=False) is None
        assert not target.exists(), "the worker created a file through the ranks' link"

    def test_a_fifo_in_the_files_place_does_not_block(self, run_dir: Path) -> None:
        os.mkfifo(run_dir / "torchrun.pid")
        assert create_beneath(run_dir, "torchrun.pid", append=False) is None

    def test_a_regular_file_is_created_private(self, run_dir: Path) -> None:
        f = create_beneath(run_dir, "logs/launcher.log")
        assert f is not None
        with f:
            f.write(b"x\n")
        assert (run_dir / "logs" / "launcher.log").stat().st_mode & 0o777 == 0o600


class TestTails:
    def test_a_file_swapped_for_a_link_between_reads_is_not_followed(
        self, run_dir: Path, secret: tuple[Path, str]
    ) -> None:
        log = run_dir / "logs" / "rank0.log"
        log.write_text("first\n")
        tails = TailSet(run_dir, "logs", "*.log")
        assert [line for _, line in tails.read()] == ["first"]
        log.unlink()
        log.symlink_to(secret[0])
        (run_dir / "logs" / "x.log").symlink_to(secret[0])
        (run_dir / "logs" / "d.log").symlink_to(secret[0].parent)
        got = [line for _, line in tails.read(final=True)]
        assert not any(secret[1] in line for line in got), got
        assert tails.refused == ["d.log", "rank0.log", "x.log"]

    def test_a_folder_swapped_for_a_link_yields_nothing(
        self, run_dir: Path, secret: tuple[Path, str]
    ) -> None:
        tails = TailSet(run_dir, "logs", "*.log")
        assert tails.read() == []
        (run_dir / "logs").rename(run_dir / "logs.old")
        (run_dir / "logs").symlink_to(secret[0].parent)
        assert tails.read(final=True) == [], "the tails read the linked folder"

    def test_another_file_under_the_same_name_is_read_from_its_start(self, run_dir: Path) -> None:
        log = run_dir / "logs" / "rank0.log"
        log.write_text("one\ntwo\n")
        tail = Tail(log)
        assert tail.read_lines() == ["one", "two"]
        log.unlink()
        log.write_text("three\n")
        assert tail.read_lines() == ["three"]

    def test_a_file_past_its_budget_is_counted_then_emptied(self, run_dir: Path) -> None:
        log = run_dir / "logs" / "rank0.log"
        budget = 1 << 20
        line = b"y" * 63 + b"\n"  # 64 bytes: the budget holds a whole number of lines
        with log.open("ab") as f:  # O_APPEND, as the ranks write
            f.write(line * (5 * budget // len(line)))
            f.flush()
            tail = Tail(log, truncate_past=budget)
            lines = tail.read_lines()
            assert len(lines) == budget // len(line), "one budget of lines handed over"
            assert log.stat().st_size == 0, "the file was emptied once read past its budget"
            assert tail.take_dropped() == (4 * budget // len(line), 4 * budget)
            f.write(b"later\n")
            f.flush()
            assert log.stat().st_size == len(b"later\n"), "the writer's next line lands at the new start"
            assert tail.read_lines() == [], "past its budget a file's lines are counted, not read"
            assert tail.take_dropped() == (1, 6)
            assert log.stat().st_size == 6, "less than a chunk past the budget: kept"


class TestRankSideReaders:
    def test_the_exception_file_and_log_tail_follow_no_link(
        self, run_dir: Path, secret: tuple[Path, str]
    ) -> None:
        exc = run_dir / "exception.json"
        exc.symlink_to(secret[0])
        assert from_hook_file(exc) is None
        log = run_dir / "logs" / "rank0.log"
        log.symlink_to(secret[0])
        assert log_tail(log) == []

    def test_the_launcher_log_is_never_read_through_a_link(
        self, run_dir: Path, secret: tuple[Path, str]
    ) -> None:
        (run_dir / "logs" / "launcher.log").symlink_to(secret[0])
        error = launcher_error(run_dir / "logs" / "launcher.log", rc=1, started=False)
        assert secret[1] not in (error.traceback or ""), error


class TestEnvironmentBuild:
    def test_a_link_left_by_the_build_is_never_written_nor_chmodded_through(self, tmp_path: Path) -> None:
        # The build runs the job's code as the ranks' user in the environment's folder: a link it
        # leaves under the manifest's temporary name must not make the worker write or chmod a host file.
        host = tmp_path / "host-file"
        host.write_text("host\n")
        host.chmod(0o600)

        def build(root: Path) -> None:
            (root / f".{environments.MANIFEST}.tmp").symlink_to(host)

        with (
            pytest.raises(environments.EnvironmentFailed, match="as a link or not a regular file"),
            environments.held(
                cache=tmp_path / "cache", key="k", build=build, poll=lambda: True, max_bytes=1 << 30
            ),
        ):
            pass
        assert host.read_text() == "host\n", "the worker wrote through the build's link"
        assert host.stat().st_mode & 0o777 == 0o600, (
            "the worker chmodded the host file through the build's link"
        )
