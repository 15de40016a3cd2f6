"""Each running attempt's ranks have a uid of their own (workers/sandbox/rank_uids.py), never nobody's.

A root worker leases each attempt a uid of DPTRAIN_RANK_UID_RANGE with an flock'd file per uid; the
allocator is tried here with real flocks in two processes, and whole attempts run in this process
as a worker node would (tests/workers/runs.py), sandboxed, as root, as CI runs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.models import LogLine
from tests.workers.runs import job_row, node_fixtures, run_in_thread, submit_as_admin
from workers.sandbox import bubblewrap, rank_uids

pytestmark = pytest.mark.e2e

settings, sessions = node_fixtures()

# Outside the default range: attempts of other tests on this host lease from that one, and a uid
# here must have no process but the test's own.
SPARE_UID = 70_417
NOBODY = bubblewrap.nobody()[0]


@pytest.fixture(autouse=True)
def _root() -> None:
    assert os.getuid() == 0, "leasing uids needs a root worker: run the tests as root, as CI does"


def _lines(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    with sessions() as s:
        return [r.line for r in s.query(LogLine).filter_by(job_id=job_id).order_by(LogLine.id)]


def _facts(sessions: sessionmaker[Session], job_id: str) -> dict[str, float]:
    said = [line for line in _lines(sessions, job_id) if line.startswith("FACTS ")]
    assert said, _lines(sessions, job_id)
    return json.loads(said[0].removeprefix("FACTS "))


def test_two_jobs_running_at_once_have_uids_of_their_own(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    # Each rank says who it is and when it ran; the second fact is printed after a pause, so both
    # attempts hold their uid at once.
    code = (
        "import json, os, time; t = time.time(); time.sleep(8); "
        "print('FACTS', json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'from': t, 'to': time.time()}))"
    )
    spec = {"name": "uid", "command": ["python", "-c", code], "hyperparameters": {"steps": 1}}
    jobs = [
        submit_as_admin(sessions, spec, settings=settings),
        submit_as_admin(sessions, spec, settings=settings),
    ]
    runs = [run_in_thread(settings, job_id) for job_id in jobs]
    for thread, _ in runs:
        thread.join(timeout=180)
    assert [out for _, out in runs] == [[JobStatus.SUCCEEDED]] * 2, [job_row(sessions, j).error for j in jobs]
    first, second = (_facts(sessions, job_id) for job_id in jobs)
    assert first["from"] < second["to"] and second["from"] < first["to"], (
        f"they ran at once: {first} {second}"
    )
    assert first["uid"] != second["uid"], f"two attempts running at once share a uid: {first} {second}"
    low, high = settings.rank_uids
    for facts in (first, second):
        assert facts["uid"] != NOBODY and low <= facts["uid"] <= high, f"a uid of {low}-{high}: {facts}"
        assert facts["gid"] == facts["uid"], facts
        # Released after the attempt's end: nothing of the uid runs, and its files are the worker's.
        assert rank_uids.processes_of(int(facts["uid"])) == []
    for job_id in jobs:
        job_dir = settings.artifacts / "jobs" / job_id
        owners = {p.lstat().st_uid for p in [job_dir, *job_dir.rglob("*")]}
        assert owners == {0}, f"the attempt's files are the worker's again: {owners}"


HOLDER = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from workers.sandbox import rank_uids
    uid, locks, owned = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    lease = rank_uids.acquire((uid, uid), lock_dir=locks)
    lease.own([owned])
    os.chown(owned / "secret.txt", uid, uid)
    # A process of the uid in a session of its own: it outlives this holder if the holder dies.
    sleeper = subprocess.Popen(
        ["sleep", "600.417"], user=uid, group=uid, extra_groups=[], start_new_session=True
    )
    print("held", sleeper.pid, flush=True)
    if sys.stdin.readline().strip() == "release":
        rank_uids.release(lease)
        print("released", flush=True)
    sys.stdin.readline()
    """
)


def _holder(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A second process holding SPARE_UID's lease, with a sleep running as that uid; (it, the sleep's pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(SPARE_UID), str(tmp_path / "locks"), str(tmp_path / "owned")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    said = proc.stdout.readline().split()
    assert said[:1] == ["held"], f"the holder took the lease: {said}"
    return proc, int(said[1])


def _owned(tmp_path: Path) -> Path:
    folder = tmp_path / "owned"
    folder.mkdir()
    (folder / "secret.txt").write_text("the last holder's")
    return folder


def test_a_uid_held_by_another_process_or_still_running_is_not_leased(tmp_path: Path) -> None:
    folder = _owned(tmp_path)
    holder, sleeper = _holder(tmp_path)
    try:
        with pytest.raises(rank_uids.NoFreeUid, match="DPTRAIN_RANK_UID_RANGE"):
            rank_uids.acquire((SPARE_UID, SPARE_UID), lock_dir=tmp_path / "locks")
        # The holder dies (a worker's crash): the kernel frees its flock, but its uid's process lives on.
        holder.kill()
        holder.wait(timeout=10)
        assert psutil.pid_exists(sleeper)
        with pytest.raises(rank_uids.NoFreeUid):
            rank_uids.acquire((SPARE_UID, SPARE_UID), lock_dir=tmp_path / "locks")
        assert (folder / "secret.txt").stat().st_uid == SPARE_UID
    finally:
        holder.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(sleeper).wait(timeout=10)
    # Its processes gone, the uid is leased again, and what the dead holder handed over is taken
    # back first: the next holder finds nothing of the last one's that is its own.
    lease = rank_uids.acquire((SPARE_UID, SPARE_UID), lock_dir=tmp_path / "locks")
    try:
        assert lease.uid == SPARE_UID
        assert (folder / "secret.txt").stat().st_uid == 0, "the dead holder's file is the worker's again"
    finally:
        rank_uids.release(lease)


def test_a_released_uid_has_no_process_left_and_is_free_again(tmp_path: Path) -> None:
    folder = _owned(tmp_path)
    holder, sleeper = _holder(tmp_path)
    try:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        # The holder still runs: only its release let go of the uid, after killing its process.
        assert not psutil.pid_exists(sleeper) or psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE
        assert (folder / "secret.txt").stat().st_uid == 0
        fd = os.open(tmp_path / "locks" / f"{SPARE_UID}.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no OSError
        finally:
            os.close(fd)
        rank_uids.release(rank_uids.acquire((SPARE_UID, SPARE_UID), lock_dir=tmp_path / "locks"))
    finally:
        holder.kill()
        holder.wait(timeout=10)


@pytest.mark.parametrize("text", ["65000-66000", "65535-70000", "10-2000", "70000-69000", "abc", "70000"])
def test_a_range_with_nobody_a_system_uid_or_no_order_is_refused(text: str) -> None:
    with pytest.raises(ValidationError, match="DPTRAIN_RANK_UID_RANGE"):
        Settings(rank_uid_range=text)


def test_overlapping_host_and_cluster_ranges_are_refused() -> None:
    with pytest.raises(ValidationError, match="must not overlap"):
        Settings(rank_uid_range="70000-70999", cluster_rank_uid_range="70500-71500")
    with pytest.raises(ValidationError, match="DPTRAIN_CLUSTER_RANK_UID_RANGE"):
        Settings(cluster_rank_uid_range="65000-66000")


def _sleep_as(uid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sleep", "600.418"], user=uid, group=uid, extra_groups=[], start_new_session=True
    )


def test_a_multi_node_uid_is_shared_by_its_nodes_on_one_host_and_ended_by_the_last(tmp_path: Path) -> None:
    # Two nodes of one attempt on this host (as in small clusters) hold placement's uid together;
    # another attempt waits for it; the last of the two to release ends what runs as it.
    locks, within = tmp_path / "locks", (SPARE_UID, SPARE_UID)
    first = rank_uids.acquire_shared(SPARE_UID, holder="job-a/1", within=within, lock_dir=locks)
    second = rank_uids.acquire_shared(SPARE_UID, holder="job-a/1", within=within, lock_dir=locks)
    first.own([_owned(tmp_path)])
    shared = tmp_path / "checkpoints"
    shared.mkdir()
    second.own([shared])
    for folder in (tmp_path / "owned", shared):
        os.chown(folder, SPARE_UID, SPARE_UID)
    sleeper = _sleep_as(SPARE_UID)
    try:
        with pytest.raises(rank_uids.NoFreeUid, match="still held"):
            rank_uids.acquire_shared(SPARE_UID, holder="job-b/1", within=within, lock_dir=locks, wait_s=1)
        rank_uids.release(first)
        assert sleeper.poll() is None, "the other node's processes run on after the first node's release"
        assert shared.stat().st_uid == SPARE_UID
        rank_uids.release(second)
        assert rank_uids.processes_of(SPARE_UID) == [], "the last release ends the uid's processes"
        assert {p.stat().st_uid for p in (tmp_path / "owned", shared)} == {0}, (
            "both nodes' folders taken back"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            sleeper.kill()
        sleeper.wait(timeout=10)
    rank_uids.release(rank_uids.acquire_shared(SPARE_UID, holder="job-b/1", within=within, lock_dir=locks))


def test_a_multi_node_uid_outside_the_cluster_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(rank_uids.NoFreeUid, match="outside this worker's DPTRAIN_CLUSTER_RANK_UID_RANGE"):
        rank_uids.acquire_shared(SPARE_UID, holder="x/1", within=(70_000, 70_010), lock_dir=tmp_path)
    with pytest.raises(rank_uids.NoFreeUid, match="belongs to a user or group"):
        rank_uids.acquire_shared(NOBODY, holder="x/1", within=(NOBODY, NOBODY), lock_dir=tmp_path)
