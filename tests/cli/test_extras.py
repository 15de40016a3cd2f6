"""The `dptrain` program without the server's packages: server commands name the extra they need."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from typing import Any

import pytest

from dptrain_cli.extras import require
from tests.cli.conftest import dptrain, flat

# What `pip install dptrain` without extras does not bring (pyproject.toml's server and worker extras).
SERVER_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "celery", "torch", "pydantic_settings")


@pytest.mark.e2e  # a fresh interpreter: this one has every module loaded already
def test_importing_the_server_and_users_commands_loads_no_server_package() -> None:
    probe = (
        "import json, sys\n"
        "import dptrain_server.commands, dptrain_server.users, dptrain_server.supervise\n"
        f"print(json.dumps(sorted(m for m in {SERVER_MODULES!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == [], f"imported with the CLI's modules: {out.stdout}"


def _without(monkeypatch: pytest.MonkeyPatch, importing: str, missing: str) -> None:
    """Make `import importing` fail as it would if the third-party module `missing` were not installed."""
    real = builtins.__import__

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == importing:
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


@pytest.mark.parametrize(
    ("args", "importing", "missing", "extra"),
    [
        (["api"], "uvicorn", "uvicorn", "server"),
        (["migrate"], "migrations", "alembic", "server"),
        (["users", "create", "alice"], "service.errors", "sqlalchemy", "server"),
        (["worker", "--device", "cpu"], "workers.node.celery_app", "celery", "worker"),
        (["up"], "service.config", "pydantic_settings", "all"),
    ],
    ids=["api", "migrate", "users", "worker", "up"],
)
def test_a_missing_package_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, args: list[str], importing: str, missing: str, extra: str
) -> None:
    _without(monkeypatch, importing, missing)
    r = dptrain(*args)
    assert r.exit_code == 1, f"expected exit 1, got {r.exit_code}: {r.output}"
    said = flat(r.stderr)
    assert f"needs dptrain[{extra}]" in said and f"pip install 'dptrain[{extra}]'" in said, said
    assert missing in said, f"the missing module is named: {said}"


def test_up_checks_what_its_children_import_before_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    # find_spec answers None for a module set to None in sys.modules, as for one not installed.
    monkeypatch.setitem(sys.modules, "torch", None)
    r = dptrain("up")
    assert r.exit_code == 1 and "pip install 'dptrain[all]'" in flat(r.stderr), r.output
    assert "torch" in r.stderr, r.stderr


def test_an_import_error_of_dptrain_itself_is_a_bug_and_not_disguised() -> None:
    with pytest.raises(ModuleNotFoundError), require("server"):
        raise ModuleNotFoundError("No module named 'service.nope'", name="service.nope")
