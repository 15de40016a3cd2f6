"""What this server checks of a submitted spec beyond the spec's own rules: which user code it may run
(DPTRAIN_USER_CODE, the user's grant, the allow-list, the archive) and whether its data files exist."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api_schemas import JobSpec, entrypoint_allowed
from api_schemas.data import OutsideDataRoot, TokenFileSource, UnresolvableDataPath, resolve_in_root
from service.code import service as code
from service.code.service import refuse_unless_may_run_code
from service.config import Settings
from service.errors import Forbidden, invalid_field
from service.jobs import requirements
from service.models import User


def runs_user_code(spec: JobSpec) -> bool:
    """Whether the spec runs code of the user's choosing rather than a built-in recipe."""
    return spec.entrypoint is not None or spec.command is not None or spec.code is not None


def check_user_code(
    session: Session,
    *,
    user: User,
    spec: JobSpec,
    settings: Settings,
    code_at: tuple[str | int, ...] = ("body", "code", "sha256"),
) -> None:
    """Refuse (403, or 422 naming the field) a spec whose code or `env` this server or this user may not run.

    An archive the spec names must be one the user uploaded (an admin's may name any): 422 at
    `code_at`, alike for another's archive and a missing one. Marks a referred archive used, so
    retention keeps it; whatever passes here can be fetched by the workers (nothing accepted fails
    later for a reason the API could see).
    """
    if spec.env:
        check_env_grant(user)
    if spec.environment is not None:
        check_environment(user=user, spec=spec, settings=settings)
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
        code.check_named(
            session, user=user, sha256=spec.code.sha256, artifacts=settings.artifacts, loc=code_at
        )


def check_env_grant(user: User) -> None:
    """Refuse (403, naming the grant) a job `env` from a user who may not run code."""
    # A variable reaches every program a rank starts, the compilers torch runs for a recipe
    # included, so setting any is running code: the same grant. Which names are refused is the
    # spec's own rule (api_schemas/env.py), for everyone.
    refuse_unless_may_run_code(user, doing="set `env` (the ranks' variables steer what they run)")


def check_environment_grant(user: User, settings: Settings) -> None:
    """Refuse (403) a job `environment` from a user who may not run code, or where uploaded code is off."""
    # Installing a package runs its build and, in the ranks, its code: the same grant as uploaded code.
    if settings.user_code != "uploaded":
        raise Forbidden(
            f"this server installs no job packages (DPTRAIN_USER_CODE={settings.user_code}): no `environment`"
        )
    refuse_unless_may_run_code(user, doing="set `environment` (installing packages runs their code)")


def check_environment(*, user: User, spec: JobSpec, settings: Settings) -> None:
    """Refuse (403, or 422 naming the line) an `environment` this user or this server may not have built."""
    check_environment_grant(user, settings)
    lines = spec.environment.requirements if spec.environment is not None else None
    if not lines:
        return  # a requirements_file is checked by the worker, which reads it from the code
    found = requirements.problems(lines, allow_options=settings.pip_allow_options)
    if found:
        first = found[0]
        loc = ("body", "environment", "requirements", first.index)
        raise invalid_field(loc, f"requirement {first.line!r}: {first.reason}", first.line)


def _check_allowed(entrypoint: str, settings: Settings) -> None:
    if not entrypoint_allowed(entrypoint, settings.entrypoint_prefixes):
        shown = ", ".join(settings.entrypoint_prefixes) or "none"
        reason = f"module is not under an allowed prefix (DPTRAIN_ALLOWED_ENTRYPOINTS: {shown})"
        raise invalid_field(("body", "entrypoint"), reason, entrypoint)


def check_data_paths(*, spec: JobSpec, settings: Settings) -> None:
    """Refuse (422 at the field) data paths that this server's DPTRAIN_DATA_ROOT does not hold.

    Only where the API host has the data root too (the workers' is the one that counts, and the
    spec's own rules keep every path inside it lexically); here a symlink out of it, a missing path
    or a file where a directory belongs is caught at submit instead of failing the job later.
    """
    root = settings.data_root
    if root is None or not root.is_dir():
        return
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None:
            continue
        loc = ("body", "data", split, source.kind, "path")
        want_file = isinstance(source, TokenFileSource)
        try:
            path = resolve_in_root(root, source.path)
            found = path.is_file() if want_file else path.is_dir()
        except OutsideDataRoot:
            reason = "the path leads out of the data root (through a symbolic link)"
            raise invalid_field(loc, reason, source.path) from None
        except (UnresolvableDataPath, OSError):
            # Not the exception's text: it names the server's own paths.
            reason = "the path cannot be resolved in the data root (a symbolic link loop, or no access)"
            raise invalid_field(loc, reason, source.path) from None
        if not found:
            what = "file" if want_file else "directory"
            raise invalid_field(loc, f"no such {what} in the data root (DPTRAIN_DATA_ROOT)", source.path)
