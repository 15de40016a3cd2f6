"""A uid of its own for each running attempt on this host, leased from a range reserved for dptrain.

A root worker's sandboxed ranks would otherwise all run as `nobody`: every job on the host would
share one process limit (RLIMIT_NPROC counts per uid), whatever files that user may read, and one
identity to every peer that checks SO_PEERCRED. Like systemd's DynamicUser (61184-65519, which the
default range stays clear of), each attempt leases one uid of `DPTRAIN_RANK_UID_RANGE` (its gid is
the same number) for its life; no user or group is created: setpriv and Popen take numbers.

Leases are files in LOCK_DIR, a root-owned folder on /run (tmpfs: gone at a reboot, as every
process of a uid is), one `<uid>.lock` per uid, held by an exclusive flock for the attempt's life.
flock belongs to the open file description, so two attempts of one worker process exclude each
other as two worker processes on one host do, and a worker that dies releases its leases with its
last file descriptor: the kernel does, whatever the crash. A uid is leased only if no process of it
is alive (a dead worker's strays may still be dying) and no user or group of the host has it.

What a holder handed to its uid (the folders `Lease.own` names, written into the lock file before
they are handed over) is taken back before the uid is free again: at the lease's end, after every
process of the uid is gone; or, when its holder died without ending it, by the next one to lease it.
So the next holder never finds files of an earlier attempt that are still its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import json
import logging
import os
import pwd
import signal
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

# Host-wide, whatever each worker's DPTRAIN_HOME: uids are the host's, so every worker process on
# it must agree on who holds which.
LOCK_DIR = Path("/run/dptrain/rank-uids")
RANGE_SETTING = "DPTRAIN_RANK_UID_RANGE"  # parsed and checked by service.config.Settings
# How long the lease's end waits for the uid's last processes to die after SIGKILL.
END_TIMEOUT_S = 30.0


class NoFreeUid(Exception):
    """Every uid of the range is held by a running attempt on this host (or unusable)."""


@dataclass
class Lease:
    """One uid (and the gid of the same number) held by this attempt until the lease ends."""

    uid: int
    fd: int
    owned: list[Path] = field(default_factory=list)
    # A multi-node attempt's lease (`acquire_shared`): the attempt it is held for, and the gate its
    # holders on this host take turns through; None for a lease of this host's range.
    holder: str | None = None
    gate: Path | None = None

    @property
    def gid(self) -> int:
        """The group the ranks run as: the uid's number, as systemd's DynamicUser does."""
        return self.uid

    def own(self, folders: Iterable[Path]) -> None:
        """Note `folders` as about to be handed to the uid: taken back before the uid is leased again."""
        self.owned += [Path(f) for f in folders if Path(f) not in self.owned]
        if self.gate is None:
            _record(self.fd, self.owned)
            return
        # One record for every node of the attempt on this host: the last to release takes back all.
        with _gated(self.gate):
            _record(self.fd, [*_recorded(self.fd), *self.owned], holder=self.holder)


def processes_of(uid: int) -> list[psutil.Process]:
    """The live processes whose real, effective or saved uid is `uid` (zombies, which run nothing, aside)."""
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        uids = p.info.get("uids")
        if uids is not None and uid in uids and p.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _is_named(uid: int) -> bool:
    """Whether a user or group of this host has the number `uid` (the operator's range overlaps one)."""
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return True
    except KeyError:
        return False


def _lock_dir(path: Path) -> Path:
    """`path`, made if missing: a folder of this process's user, 0700, never a link (NoFreeUid if not)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise NoFreeUid(f"{path} must be a folder of the worker's own user (it holds the ranks' uid leases)")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _try(uid: int, folder: Path) -> Lease | None:
    """The lease of `uid` if no one holds it and nothing of it lives on; None otherwise."""
    fd = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    if processes_of(uid) or _is_named(uid):
        # Strays of a holder that died (their end is near) or a user of the host: never shared.
        os.close(fd)
        return None
    lease = Lease(uid=uid, fd=fd)
    left = _recorded(fd)
    if left:
        # Its last holder died before taking back what it had handed over.
        log.warning("uid %d: taking back %d folders its last holder (a dead worker) left", uid, len(left))
        _take_back(uid, left)
        os.ftruncate(fd, 0)
    return lease


def _read(fd: int) -> dict[str, object]:
    """A lock file's record: the folders its holders handed over, and a shared lease's holder."""
    raw = os.pread(fd, 1 << 20, 0)
    try:
        record = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    # A host lease writes the bare list of folders.
    return {"owned": record} if isinstance(record, list) else record if isinstance(record, dict) else {}


def _recorded(fd: int) -> list[Path]:
    owned = _read(fd).get("owned")
    return [Path(p) for p in owned if isinstance(p, str)] if isinstance(owned, list) else []


def _record(fd: int, owned: Iterable[Path], *, holder: str | None = None) -> None:
    paths = sorted({str(p) for p in owned})
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(paths if holder is None else {"holder": holder, "owned": paths}).encode(), 0)


def acquire(uid_range: tuple[int, int], *, lock_dir: Path = LOCK_DIR) -> Lease:
    """Lease a uid of `uid_range` no live attempt on this host holds; NoFreeUid when there is none."""
    folder = _lock_dir(lock_dir)
    low, high = uid_range
    count = high - low + 1
    # Start anywhere: a uid just given back is then seldom the next one leased (its lock file is
    # kept, so the scan costs one open and one flock per held uid).
    start = int.from_bytes(os.urandom(4), "little") % count
    for i in range(count):
        lease = _try(low + (start + i) % count, folder)
        if lease is not None:
            return lease
    raise NoFreeUid(
        f"all {count} uids of {RANGE_SETTING} ({low}-{high}) are held by attempts running on this host"
    )


def release(lease: Lease) -> None:
    """End `lease`: kill what still runs as its uid, take back what it owned, then free the uid."""
    if lease.gate is not None:
        _release_shared(lease, gate=lease.gate)
    elif _end(lease, lease.owned):
        os.close(lease.fd)


def _end(lease: Lease, owned: Iterable[Path]) -> bool:
    """Kill what runs as the lease's uid and take back `owned`; False if the uid must stay held.

    A process that SIGKILL does not end (stuck in the kernel), or a take-back that failed: the uid
    stays held by this worker process rather than be lent to another attempt beside it.
    """
    try:
        if not _end_processes(lease.uid):
            log.error(
                "uid %d: processes outlived SIGKILL; the uid stays held until this worker exits", lease.uid
            )
            return False
        _take_back(lease.uid, owned)
        os.ftruncate(lease.fd, 0)
    except BaseException:
        log.exception(
            "uid %d: its lease could not end cleanly; it stays held until this worker exits", lease.uid
        )
        return False
    return True


@contextlib.contextmanager
def leased(uid_range: tuple[int, int], *, lock_dir: Path = LOCK_DIR) -> Iterator[Lease]:
    """A uid of `uid_range` for the block's life (`acquire`, then `release` whatever happens)."""
    lease = acquire(uid_range, lock_dir=lock_dir)
    try:
        yield lease
    finally:
        release(lease)


def _end_processes(uid: int) -> bool:
    """SIGKILL every process of `uid` until none is left; False if some outlive END_TIMEOUT_S."""
    deadline = time.monotonic() + END_TIMEOUT_S
    while procs := processes_of(uid):
        if time.monotonic() > deadline:
            return False
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=1)
    return True


def _take_back(uid: int, folders: Iterable[Path]) -> None:
    """Give every entry of `folders` (never following a link) that `uid` owns to this process's user."""
    me, my_group = os.getuid(), os.getgid()

    def mine(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(path)
            if info.st_uid == uid or info.st_gid == uid:
                os.lchown(path, me, my_group)

    for top in folders:
        if not os.path.lexists(top) or os.path.islink(top):
            continue
        mine(str(top))
        for root, dirs, files in os.walk(top):
            for name in (*dirs, *files):
                mine(os.path.join(root, name))


# A multi-node attempt's uid. Its nodes read one checkpoint folder (shared storage), which each of
# them hands to its ranks' user: the uid must be the same on every node, so placement chooses it
# (DPTRAIN_CLUSTER_RANK_UID_RANGE, none other running holds it in the cluster) and each node leases
# that number here. Two nodes of one attempt may share a host (small clusters, the tests): they hold
# the uid's lock file shared, under the attempt's name, and the last of them to release it ends it.
# Each decision to take, join or end such a lease is made under an exclusive flock of `<uid>.gate`,
# so the lock file is held exclusively only there, for a moment.


@contextlib.contextmanager
def _gated(gate: Path) -> Iterator[None]:
    fd = os.open(gate, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def acquire_shared(
    uid: int,
    *,
    holder: str,
    within: tuple[int, int],
    lock_dir: Path = LOCK_DIR,
    wait_s: float = 2 * END_TIMEOUT_S,
) -> Lease:
    """Lease `uid` for attempt `holder` (placement's choice), beside its other nodes on this host.

    Placement frees a uid when an attempt's node rows go, which may be a moment before a node of
    that attempt has ended its lease here: so a uid another attempt holds is waited for up to
    `wait_s`. NoFreeUid if it stays held, lies outside `within` (this host's
    DPTRAIN_CLUSTER_RANK_UID_RANGE) or belongs to a user or group of the host.
    """
    low, high = within
    if not low <= uid <= high:
        raise NoFreeUid(f"uid {uid} lies outside this worker's DPTRAIN_CLUSTER_RANK_UID_RANGE ({low}-{high})")
    if _is_named(uid):
        raise NoFreeUid(
            f"uid {uid} of DPTRAIN_CLUSTER_RANK_UID_RANGE belongs to a user or group of this host"
        )
    folder = _lock_dir(lock_dir)
    gate = folder / f"{uid}.gate"
    deadline = time.monotonic() + wait_s
    while True:
        with _gated(gate):
            lease = _join(uid, holder=holder, folder=folder, gate=gate)
        if lease is not None:
            return lease
        if time.monotonic() > deadline:
            raise NoFreeUid(
                f"uid {uid}, this multi-node attempt's, is still held on this host after {wait_s:.0f} s"
            )
        time.sleep(0.5)


def _join(uid: int, *, holder: str, folder: Path, gate: Path) -> Lease | None:
    """Under the gate: `uid`'s lease for `holder`, taken or joined; None while another attempt holds it."""
    fd = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        if _read(fd).get("holder") == holder:
            # Another node of this attempt holds it here (shared: only the gate's holder takes it
            # exclusively, so this never blocks).
            fcntl.flock(fd, fcntl.LOCK_SH)
            return Lease(uid=uid, fd=fd, holder=holder, gate=gate)
        os.close(fd)
        return None
    if processes_of(uid):
        os.close(fd)  # strays of an earlier holder, still dying
        return None
    if left := _recorded(fd):
        log.warning("uid %d: taking back %d folders its last holder (a dead worker) left", uid, len(left))
        _take_back(uid, left)
    _record(fd, [], holder=holder)
    fcntl.flock(fd, fcntl.LOCK_SH)  # under the gate: no one takes it between
    return Lease(uid=uid, fd=fd, holder=holder, gate=gate)


def _release_shared(lease: Lease, *, gate: Path) -> None:
    """Let go of a multi-node attempt's uid; the last of its holders on this host ends the lease."""
    try:
        with _gated(gate):
            try:
                fcntl.flock(lease.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lease.fd)  # another node of the attempt runs on here: it ends the lease
                return
            if not _end(lease, _recorded(lease.fd)):
                # Kept, exclusively, in no attempt's name: nothing joins a uid whose processes are stuck.
                _record(lease.fd, _recorded(lease.fd), holder="")
                return
    except OSError:
        log.exception("uid %d: its lease could not end; it stays held until this worker exits", lease.uid)
        return
    os.close(lease.fd)
