"""The environment cache: one build per key, hits, LRU eviction that spares environments in use."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from service.config import Settings
from workers.pyenv import environments
from workers.pyenv.build import shadowing
from workers.pyenv.environments import Aborted, EnvironmentFailed, held


def _builder(calls: list[str], size: int = 1000, seconds: float = 0.0):
    def build(root: Path) -> None:
        calls.append(root.name)
        time.sleep(seconds)
        (root / "blob").write_bytes(b"x" * size)

    return build


def test_concurrent_attempts_build_once_and_the_rest_hit(tmp_path: Path) -> None:
    calls: list[str] = []
    hits: list[bool] = []

    def use() -> None:
        with held(
            cache=tmp_path, key="k1", build=_builder(calls, seconds=0.3), poll=lambda: True, max_bytes=10**9
        ) as env:
            hits.append(env.hit)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert calls == ["k1"], "one build"
    assert sorted(hits) == [False, True, True, True]


def test_a_failed_build_leaves_nothing_and_the_next_builds_again(tmp_path: Path) -> None:
    def fail(root: Path) -> None:
        (root / "half").write_text("x")
        raise EnvironmentFailed(environments.JobError(type="EnvironmentBuildFailed", message="no"))

    with (
        pytest.raises(EnvironmentFailed),
        held(cache=tmp_path, key="k", build=fail, poll=lambda: True, max_bytes=1),
    ):
        pass
    assert not (tmp_path / "k").exists()
    calls: list[str] = []
    with held(cache=tmp_path, key="k", build=_builder(calls), poll=lambda: True, max_bytes=10**9) as env:
        assert not env.hit and calls == ["k"]


def test_eviction_removes_the_least_recently_used_never_one_in_use(tmp_path: Path) -> None:
    calls: list[str] = []
    with held(cache=tmp_path, key="a", build=_builder(calls), poll=lambda: True, max_bytes=10**9):
        pass
    with contextlib.ExitStack() as in_use:
        in_use.enter_context(
            held(cache=tmp_path, key="b", build=_builder(calls), poll=lambda: True, max_bytes=10**9)
        )
        time.sleep(0.01)
        # Room for about one: c's build evicts a (least recently used), not b (in use), nor c.
        with held(cache=tmp_path, key="c", build=_builder(calls), poll=lambda: True, max_bytes=2500):
            kept = {e["key"] for e in environments.cached(tmp_path)}
        assert kept == {"b", "c"}, kept


def test_a_waiter_gives_up_when_the_attempt_stops(tmp_path: Path) -> None:
    started = threading.Event()

    def slow(root: Path) -> None:
        started.set()
        time.sleep(1.0)

    t = threading.Thread(
        target=lambda: held(
            cache=tmp_path, key="k", build=slow, poll=lambda: True, max_bytes=10**9
        ).__enter__()
    )
    t.start()
    started.wait(10)
    with (
        pytest.raises(Aborted),
        held(cache=tmp_path, key="k", build=slow, poll=lambda: False, max_bytes=10**9),
    ):
        pass
    t.join(10)


def test_the_key_follows_the_requirements_not_their_spelling(tmp_path: Path) -> None:
    s = Settings(home=tmp_path)
    assert environments.environment_key(["A_b>=1", "c"], settings=s) == environments.environment_key(
        ["c", "a-b>=1"], settings=s
    )
    other = s.model_copy(update={"pip_index_url": "http://elsewhere/simple"})
    assert environments.environment_key(["c"], settings=s) != environments.environment_key(
        ["c"], settings=other
    )


def test_an_environment_providing_the_workers_packages_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "einops").mkdir(parents=True)
    assert shadowing(tmp_path) is None
    (site / "numpy-9.0.dist-info").mkdir()
    assert shadowing(tmp_path) == "'numpy'"


def test_a_requirements_file_is_read_from_the_code_and_a_missing_one_fails_at_once(tmp_path: Path) -> None:
    from api_schemas import JobSpec
    from workers.attempt.end import NOT_RETRIED

    code = tmp_path / "code"
    code.mkdir()
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "command": ["python", "-c", "pass"],
            "code": {"sha256": "0" * 64},
            "environment": {"requirements_file": "requirements.txt"},
        }
    )
    settings = Settings(home=tmp_path)
    with pytest.raises(EnvironmentFailed) as missing:
        environments.requirement_lines(spec, code_dir=code, settings=settings)
    assert (
        missing.value.error.type == "RequirementsFileMissing"
        and "requirements.txt" in missing.value.error.message
    )
    assert {"RequirementsFileMissing", "EnvironmentBuildFailed"} <= NOT_RETRIED
    (code / "requirements.txt").write_text("# pinned\ndpt-alpha==1.0  # why\n")
    assert environments.requirement_lines(spec, code_dir=code, settings=settings) == ["dpt-alpha==1.0"]
    (code / "requirements.txt").write_text("torch==2.0\n")
    with pytest.raises(EnvironmentFailed) as refused:
        environments.requirement_lines(spec, code_dir=code, settings=settings)
    assert refused.value.error.type == "EnvironmentBuildFailed" and "torch" in refused.value.error.message
