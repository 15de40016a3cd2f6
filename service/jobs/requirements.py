"""Which requirement lines of a job's `environment` a server accepts: the API's 422s and the worker's check.

torch, numpy and dptrain's own packages always come from the worker's environment: a second torch
in a job would load a second CUDA runtime beside the worker's and bypass the engine's guarantees,
and a package named like ours would shadow the engine, the SDK or the rank contract inside the
ranks. Options that point pip elsewhere (`--index-url`, `-f`, a local path, a URL) are refused
unless the operator allows them (DPTRAIN_PIP_ALLOW_OPTIONS): the index is the operator's choice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

# Distributions the worker provides and a job may never replace (canonical names).
WORKER_DISTRIBUTIONS = frozenset({"torch", "numpy", "dptrain"})
# Top-level import names of dptrain's own packages: a distribution named like one of them (or
# `dptrain-*`) is refused by name here, and a build whose files provide one is refused after it.
OUR_PACKAGES = frozenset({"api_schemas", "service", "workers", "rank_contract", "dptrain", "dptrain_cli"})
OUR_PREFIX = "dptrain"
# pip options an operator may allow in requirements (each line one option and its value).
ALLOWABLE_OPTIONS = frozenset(
    {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--no-index", "--pre", "--trusted-host"}
)
_LOCAL = re.compile(r"^(\.{0,2}/|~|file:)|\.(whl|zip|tar\.gz|tgz|tar\.bz2)$", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    """Line `index` (0-based) of the requirements is refused, for `reason`."""

    index: int
    line: str
    reason: str


def protected(name: str) -> bool:
    """Whether the distribution `name` is one the worker provides (torch, numpy, dptrain's own packages)."""
    canonical = canonicalize_name(name)
    underscored = canonical.replace("-", "_")
    return (
        canonical in WORKER_DISTRIBUTIONS or underscored in OUR_PACKAGES or canonical.startswith(OUR_PREFIX)
    )


def parse_lines(text: str) -> list[str]:
    """A requirements file's lines: comments, blank lines and trailing comments dropped."""
    lines = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if line:
            lines.append(line)
    return lines


def problems(lines: list[str], *, allow_options: bool) -> list[Problem]:
    """Every refused line of `lines`, each with why (empty: all accepted)."""
    found = []
    for i, line in enumerate(lines):
        if (reason := _problem(line, allow_options=allow_options)) is not None:
            found.append(Problem(index=i, line=line, reason=reason))
    return found


def _problem(line: str, *, allow_options: bool) -> str | None:
    if line.startswith("-"):
        option = re.split(r"[\s=]", line, maxsplit=1)[0]
        if option not in ALLOWABLE_OPTIONS:
            return f"pip option {option!r} is not accepted in requirements"
        if not allow_options:
            return f"pip option {option!r} is refused: this server installs only from its own index " + _HINT
        return None
    try:
        req = Requirement(line)
    except InvalidRequirement as exc:
        if _LOCAL.search(line) or "://" in line:
            return None if allow_options else f"a local path or URL is refused {_HINT}"
        return f"not a PEP 508 requirement: {str(exc).splitlines()[0]}"
    if protected(req.name):
        return (
            f"{req.name!r} always comes from the worker's environment (torch, numpy and dptrain's own "
            "packages are never replaced by a job's)"
        )
    if req.url and not allow_options:
        return f"a requirement from a URL ({req.name} @ ...) is refused {_HINT}"
    return None


_HINT = "(DPTRAIN_PIP_ALLOW_OPTIONS lets an operator allow options, URLs and local paths)"


def normalised(lines: list[str]) -> list[str]:
    """`lines` in one canonical form each (names canonical, specifiers sorted), in a stable order."""
    out = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            out.append(line.strip())
            continue
        req.name = canonicalize_name(req.name)
        out.append(str(req))
    # Options first, in their order (their order matters to pip); requirements sorted.
    options = [line for line in out if line.startswith("-")]
    return options + sorted(line for line in out if not line.startswith("-"))
