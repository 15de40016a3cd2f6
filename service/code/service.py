"""The rules of the code domain: who may upload, read and run uploaded code. Services only flush."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

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
    if size is None or not storage.archive_path(artifacts, sha256).is_file():
        return None
    return size


def reuse(session: Session, *, user: User, sha256: str, artifacts: Path) -> bool:
    """If the archive is already stored, record `user` as an uploader too and return True."""
    size = stored_size(session, sha256=sha256, artifacts=artifacts)
    if size is None:
        return False
    repository.record(session, sha256=sha256, size_bytes=size, user_id=user.id, now=utcnow())
    return True


def store(session: Session, *, user: User, sha256: str, received: storage.Received, artifacts: Path) -> bool:
    """Put a received upload in place as the archive `sha256` and record it; True if it is new.

    422 (and nothing kept) when its content does not hash to `sha256` or is not gzip.
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
    return repository.record(session, sha256=sha256, size_bytes=received.size, user_id=user.id, now=utcnow())


def readable_archive(session: Session, *, user: User, sha256: str, artifacts: Path) -> Path:
    """The archive's file for an admin, an uploader, or the owner of a job using it; else NotFound."""
    missing = NotFound(f"no code archive {sha256}")
    if not user.is_admin and not repository.may_read(session, sha256=sha256, user_id=user.id):
        raise missing  # the same answer as for an unknown archive: existence is not revealed
    if stored_size(session, sha256=sha256, artifacts=artifacts) is None:
        raise missing
    return storage.archive_path(artifacts, sha256)
