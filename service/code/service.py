"""The rules of the code domain: who may upload, read and run uploaded code. Services only flush."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from rank_contract.layout import code_archive
from service.code import repository, storage
from service.config import Settings
from service.errors import Forbidden, NotFound, invalid_field
from service.models import User
from service.models.base import utcnow


def may_run_code(user: User) -> bool:
    """Admins, and users an admin granted `can_run_code`."""
    return user.is_admin or user.can_run_code


def refuse_unless_may_run_code(user: User, *, doing: str = "run code") -> None:
    """Forbidden, naming the grant command, for a user who may not run code (or do what `doing` says)."""
    if not may_run_code(user):
        raise Forbidden(
            f"user {user.name} may not {doing}: an admin grants it with "
            f"`dptrain users grant {user.name} --can-run-code` (or PATCH /v1/users/{user.name}/permissions)"
        )


def check_may_upload(*, user: User, settings: Settings) -> None:
    """Forbidden unless this server takes uploaded code and the user may run code."""
    if settings.user_code != "uploaded":
        raise Forbidden(f"this server does not accept uploaded code (DPTRAIN_USER_CODE={settings.user_code})")
    refuse_unless_may_run_code(user)


def too_large_message(settings: Settings) -> str:
    """Why an archive over DPTRAIN_CODE_MAX_BYTES is refused, naming the limit."""
    limit = settings.code_max_bytes
    return (
        f"code archive exceeds DPTRAIN_CODE_MAX_BYTES = {limit} bytes ({limit / (1 << 20):g} MiB); "
        "leave large files out with .dptrainignore"
    )


def stored_size(session: Session, *, sha256: str, artifacts: Path) -> int | None:
    """The size of the archive if the server has it (its row and its file), else None."""
    size = repository.size_of(session, sha256=sha256)
    if size is None or not code_archive(artifacts, sha256).is_file():
        return None
    return size


def may_use(session: Session, *, user: User, sha256: str) -> bool:
    """Whether the user may name the archive in a spec, fetch it, or learn it exists: admins, uploaders."""
    # Hashes are no secret (every spec, CI log and job listing shows one), so knowing a hash proves
    # nothing; having uploaded the bytes does. Owning a job that names the archive is not enough
    # either: the job could only name it because its owner uploaded it (`check_named`).
    return user.is_admin or repository.is_uploader(session, sha256=sha256, user_id=user.id)


def usable_size(session: Session, *, user: User, sha256: str, artifacts: Path) -> int | None:
    """The archive's size if it is stored and the user may use it; None alike when either fails."""
    if not may_use(session, user=user, sha256=sha256):
        return None  # the same answer as for an unknown archive: existence is not revealed
    return stored_size(session, sha256=sha256, artifacts=artifacts)


def check_named(
    session: Session, *, user: User, sha256: str, artifacts: Path, loc: tuple[str | int, ...]
) -> None:
    """The rule for an archive a spec names: stored and usable by the submitter, else 422 at `loc`.

    Every submit path (a job, a sweep and each of its trials, a continuation) calls it through the
    jobs policy. The refusal reads the same whether the archive is missing or someone else's. Marks
    the archive used, so retention keeps it.
    """
    usable = usable_size(session, user=user, sha256=sha256, artifacts=artifacts) is not None
    # touch() decides last: it locks the row, so a retention sweep that deleted it meanwhile is seen.
    if not usable or not repository.touch(session, sha256=sha256, now=utcnow()):
        reason = f"no code archive {sha256} uploaded by you; upload it first with PUT /v1/code/{sha256}"
        raise invalid_field(loc, reason, sha256)


def reuse(session: Session, *, user: User, sha256: str, artifacts: Path) -> bool:
    """True if the user may already use the stored archive (recorded as an uploader): no bytes needed.

    Anyone else sends the bytes (`store`), which proves they hold them: a hash alone is no claim.
    """
    size = usable_size(session, user=user, sha256=sha256, artifacts=artifacts)
    if size is None:
        return False
    repository.record(session, sha256=sha256, size_bytes=size, user_id=user.id, now=utcnow())
    return True


def store(session: Session, *, user: User, sha256: str, received: storage.Received, artifacts: Path) -> None:
    """Put a received upload in place as the archive `sha256` and record the user as an uploader.

    422 (and nothing kept) when its content does not hash to `sha256` or is not gzip. The same
    bytes stored already are simply replaced by themselves (an atomic rename).
    """
    problem = None
    if received.sha256 != sha256:
        problem = invalid_field(
            ("path", "sha256"),
            f"the body's sha256 is {received.sha256}, not {sha256} as the path says",
            sha256,
        )
    elif received.head != storage.GZIP_MAGIC:
        problem = invalid_field(("body",), "not gzip: a code archive is a .tar.gz", received.head.hex())
    if problem is not None:
        received.discard()
        raise problem
    received.keep(artifacts)
    repository.record(session, sha256=sha256, size_bytes=received.size, user_id=user.id, now=utcnow())


def readable_archive(session: Session, *, user: User, sha256: str, artifacts: Path) -> Path:
    """The archive's file for an admin or an uploader; NotFound for anyone else, as for an unknown one."""
    if usable_size(session, user=user, sha256=sha256, artifacts=artifacts) is None:
        raise NotFound(f"no code archive {sha256}")
    return code_archive(artifacts, sha256)
