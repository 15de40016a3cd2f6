"""The server's commands in `dptrain`: found by entry point, listed with the client's, loaded when asked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dptrain_cli.lazy import SERVER_EXTRA, server_commands
from tests.cli.conftest import dptrain, flat


def test_help_lists_the_client_and_the_server_commands() -> None:
    r = dptrain("--help")
    assert r.exit_code == 0, r.output
    listed = {
        line.split()[1] for line in r.output.splitlines() if line.startswith("│ ") and len(line.split()) > 2
    }
    assert {"submit", "status", "api", "worker", "migrate", "up", "users"} <= listed, r.output


@pytest.mark.parametrize(
    ("args", "shown"),
    [(["up", "--help"], "--slots"), (["worker", "--help"], "--device"), (["users", "--help"], "create")],
    ids=["up", "worker", "users"],
)
def test_a_server_command_answers_help(args: list[str], shown: str) -> None:
    r = dptrain(*args)
    assert r.exit_code == 0 and shown in r.output, r.output


@pytest.mark.parametrize("name", sorted(server_commands()))
def test_without_the_server_package_a_server_command_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # An import of a module set to None in sys.modules fails as one not installed; its modules
    # loaded already go as well, or importing them would answer them from sys.modules.
    for module in [m for m in sys.modules if m.split(".")[0] == "dptrain_server"] + ["dptrain_server"]:
        monkeypatch.setitem(sys.modules, module, None)
    r = dptrain(name, "--port", "9000")
    said = flat(r.stderr)
    assert r.exit_code == 1, f"expected exit 1, got {r.exit_code}: {r.output}"
    assert f"needs dptrain[{SERVER_EXTRA}]" in said and f"pip install 'dptrain[{SERVER_EXTRA}]'" in said, said
    listed = dptrain("--help")
    assert listed.exit_code == 0 and f"needs the '{SERVER_EXTRA}' extra" in flat(listed.output), listed.output


def test_the_server_commands_found_are_the_server_packages() -> None:
    found = {name: ep.value for name, ep in server_commands().items()}
    assert {"api", "worker", "webhook-worker", "migrate", "up", "users"} <= set(found), found
    assert all(value.startswith("dptrain_server.") for value in found.values()), found


@pytest.mark.e2e  # a fresh interpreter: this one has dptrain_server loaded already
def test_only_a_server_command_loads_the_server_package() -> None:
    probe = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from dptrain_cli.main import app\n"
        "seen = {}\n"
        "for args in (['status', '--help'], ['submit', '--help'], ['up', '--help']):\n"
        "    r = CliRunner().invoke(app, args)\n"
        "    assert r.exit_code == 0, r.output\n"
        "    seen[args[0]] = 'dptrain_server' in sys.modules\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": False, "submit": False, "up": True}, out.stdout
