"""Job spec files: YAML (read as YAML 1.2 floats) or JSON, into the dict the API takes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SpecFileError", "init_from_arg", "load_spec"]


class SpecFileError(ValueError):
    """A spec file that does not hold a job spec object (or is not YAML/JSON)."""


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading `1e-4` as the float YAML 1.2 says it is.

    PyYAML follows YAML 1.1, where a float needs a dot (`1.0e-4`); `lr: 1e-4` would reach the API
    as the string "1e-4", which the spec's strict types refuse.
    """


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_spec(path: Path) -> dict[str, Any]:
    """The spec object in `path` (`.json` as JSON, anything else as YAML)."""
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_SpecLoader)
    except (ValueError, yaml.YAMLError) as exc:
        raise SpecFileError(
            f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise SpecFileError(f"{path} does not hold a job spec object")
    return data


def init_from_arg(text: str, *, resume: bool = False) -> dict[str, Any]:
    """`ID`, `ID:STEP` or `ID:best` (the CLI's --from) as the spec's `init_from`; ValueError if malformed."""
    job, sep, which = text.partition(":")
    init: dict[str, Any] = {"job": job, "resume": resume}
    if not job or (sep and not which):
        raise ValueError(f"expected ID, ID:STEP or ID:best, got {text!r}")
    if which == "best":
        init["best"] = True
    elif which:
        if not which.isascii() or not which.isdigit():
            raise ValueError(f"expected ID, ID:STEP or ID:best, got {text!r} ({which!r} is not a step)")
        init["step"] = int(which)
    return init
