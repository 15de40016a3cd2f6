"""Which user code a submitted job may run: DPTRAIN_USER_CODE, the user's grant, allow-list, archive."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api_schemas import JobSpec, entrypoint_allowed
from service.code import repository as code_repository
from service.code import storage
from service.code.service import refuse_unless_may_run_code
from service.config import Settings
from service.errors import Forbidden, invalid_field
from service.models import User
from service.models.base import utcnow


def runs_user_code(spec: JobSpec) -> bool:
    """Whether the spec runs code of the user's choosing rather than a built-in recipe."""
    return spec.entrypoint is not None or spec.command is not None or spec.code is not None


def check_user_code(session: Session, *, user: User, spec: JobSpec, settings: Settings) -> None:
    """Refuse (403, or 422 naming the field) a spec whose code this server or this user may not run.

    Marks a referred archive used, so retention keeps it; whatever passes here can be fetched by
    the workers (nothing accepted fails later for a reason the API could see).
    """
    if not runs_user_code(spec):
        return
    mode = settings.user_code
    if mode == "off":
        raise Forbidden("this server runs no user code (DPTRAIN_USER_CODE=off)")
    refuse_unless_may_run_code(user)
    if mode == "allowlist" and (spec.code is not None or spec.command is not None):
        raise Forbidden(
            "this server runs only pre-installed entrypoints (DPTRAIN_USER_CODE=allowlist): "
            "no uploaded code, no command"
        )
    # An entrypoint inside an uploaded tree is resolved there; without one it names installed code.
    if spec.entrypoint is not None and spec.code is None:
        _check_allowed(spec.entrypoint, settings)
    if spec.code is not None:
        sha = spec.code.sha256
        stored = storage.archive_path(settings.artifacts, sha).is_file()
        if not stored or not code_repository.touch(session, sha256=sha, now=utcnow()):
            missing = f"no code archive {sha}; upload it first with PUT /v1/code/{sha}"
            raise invalid_field(("body", "code", "sha256"), missing, sha)


def _check_allowed(entrypoint: str, settings: Settings) -> None:
    if not entrypoint_allowed(entrypoint, settings.entrypoint_prefixes):
        shown = ", ".join(settings.entrypoint_prefixes) or "none"
        reason = f"module is not under an allowed prefix (DPTRAIN_ALLOWED_ENTRYPOINTS: {shown})"
        raise invalid_field(("body", "entrypoint"), reason, entrypoint)
