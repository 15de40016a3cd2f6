"""The SDK's typed errors: one class per answer a caller handles differently.

Every refusal of the API is an `ApiError` carrying the status code and what the server said; the
subclasses let a caller catch just the case it can act on (`except dptrain.NotFound`). Waiting
that ends without the job ending raises `WaitTimeout` or `Unplaceable`, both carrying the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api_schemas import Job

__all__ = [
    "ApiError",
    "Conflict",
    "DataLeftOut",
    "FieldError",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "Refused",
    "Unauthorized",
    "Unplaceable",
    "WaitTimeout",
]


class ApiError(Exception):
    """The API answered with an error: `status_code`, and `detail` as it said it."""

    status_code: int

    def __init__(self, status_code: int, detail: Any, *, error: str | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        # The server's error class (`{"error": "NotFound", ...}`), when it named one.
        self.error = error


class Unauthorized(ApiError):
    """401: no token, or one the server does not know (revoked, mistyped)."""


class Forbidden(ApiError):
    """403: the token is valid, its user may not do this."""


class NotFound(ApiError):
    """404: no such job, checkpoint or code (or not one this user may see)."""


class Conflict(ApiError):
    """409: the request contradicts the current state (an Idempotency-Key reused with another spec...)."""


class PayloadTooLarge(ApiError):
    """413: the body (a code archive) is over the server's limit."""


class RateLimited(ApiError):
    """429: too many requests; `retry_after` seconds is when the server suggests trying again."""

    def __init__(
        self, status_code: int, detail: Any, *, error: str | None = None, retry_after: float
    ) -> None:
        super().__init__(status_code, detail, error=error)
        self.retry_after = retry_after


@dataclass(frozen=True)
class FieldError:
    """One refused field: where (`loc`, e.g. `("hyperparameters", "lr")`), why, and pydantic's type."""

    loc: tuple[str | int, ...]
    msg: str
    type: str

    @property
    def path(self) -> str:
        """The field's dotted path, as the CLI prints it (`hyperparameters.lr`)."""
        return ".".join(str(p) for p in self.loc)


class Refused(ApiError):
    """422: the request is invalid; `errors` lists each refused field (the body prefix dropped)."""

    def __init__(self, status_code: int, detail: Any, *, error: str | None = None) -> None:
        super().__init__(status_code, detail, error=error)
        self.errors: list[FieldError] = []
        for item in detail if isinstance(detail, list) else []:
            if not isinstance(item, dict):
                continue
            loc = tuple(p for p in item.get("loc", []) if p != "body")
            self.errors.append(
                FieldError(loc=loc, msg=str(item.get("msg", "")), type=str(item.get("type", "")))
            )


_BY_STATUS: dict[int, type[ApiError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: Refused,
}


def api_error(
    status_code: int, detail: Any, *, error: str | None = None, retry_after: float = 1.0
) -> ApiError:
    """The typed error for an answer with `status_code`."""
    if status_code == 429:
        return RateLimited(status_code, detail, error=error, retry_after=retry_after)
    return _BY_STATUS.get(status_code, ApiError)(status_code, detail, error=error)


class WaitTimeout(TimeoutError):
    """`Client.wait` gave up after its timeout; the job (as last seen) keeps running."""

    def __init__(self, job: Job, timeout: float) -> None:
        super().__init__(f"job {job.id} is still {job.status.value} after {timeout:g} s")
        self.job = job


class Unplaceable(Exception):
    """`Client.wait` gave up: no live node could hold the job for `timeout` seconds (it stays queued)."""

    def __init__(self, job: Job, timeout: float) -> None:
        super().__init__(f"job {job.id}: no live node can hold it (for {timeout:g} s)")
        self.job = job


class DataLeftOut(UserWarning):
    """`Client.submit(workdir=...)` left out files that look like data or weights: its ignore rules did."""
