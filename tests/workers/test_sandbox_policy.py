"""DPTRAIN_SANDBOX where bubblewrap is missing: a cluster worker refuses to start, `dptrain up`'s warns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from dptrain_cli.main import app
from service.config import get_settings
from workers.sandbox import bubblewrap
from workers.sandbox.bubblewrap import SandboxUnavailable, check_at_start

MISSING = f"bubblewrap is not installed ({bubblewrap.BWRAP} is missing): {bubblewrap.INSTALL_HINT}"


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host, as one without bubblewrap: the probe says so (no process is started)."""
    monkeypatch.setattr(bubblewrap, "probe", lambda uid=None, gid=None: MISSING)


@pytest.mark.parametrize(("mode", "embedded"), [("required", False), ("required", True), ("auto", False)])
def test_a_worker_that_must_sandbox_refuses_to_start_naming_the_package(
    no_bwrap: None, mode: bubblewrap.Mode, embedded: bool
) -> None:
    with pytest.raises(SandboxUnavailable) as refused:
        check_at_start(mode, embedded=embedded)
    assert "apt install bubblewrap" in str(refused.value) and f"DPTRAIN_SANDBOX={mode}" in str(refused.value)


@pytest.mark.parametrize(("mode", "embedded"), [("auto", True), ("off", False), ("off", True)])
def test_otherwise_it_starts_with_one_warning_of_what_is_not_isolated(
    no_bwrap: None, mode: bubblewrap.Mode, embedded: bool
) -> None:
    warning = check_at_start(mode, embedded=embedded)
    assert warning is not None and "not sandboxed" in warning and "outlive" in warning, warning


def test_with_bubblewrap_there_is_nothing_to_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bubblewrap, "probe", lambda uid=None, gid=None: None)
    assert check_at_start("auto", embedded=False) is None
    assert check_at_start("required", embedded=False) is None


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_dptrain_worker_exits_1_naming_the_package(
    no_bwrap: None, fresh_settings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPTRAIN_SANDBOX", "auto")
    result = CliRunner().invoke(app, ["worker", "--device", "cpu"])
    assert result.exit_code == 1, f"expected exit 1, got {result.exit_code}: {result.output}"
    assert "apt install bubblewrap" in result.output, result.output
