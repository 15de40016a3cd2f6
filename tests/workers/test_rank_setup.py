"""What a node prepares before its ranks start (workers.sandbox.rank_setup.prepare), without starting
them: the ranks' environment carries the worker's data root as the worker's settings have it, and nothing else
of the worker's DPTRAIN_* settings."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from api_schemas import JobSpec
from rank_contract.env import DATA_ROOT_ENV
from rank_contract.layout import JobFiles
from service.config import Settings
from workers.attempt.node_run import RunPaths
from workers.sandbox.rank_setup import RankSetup, prepare

JOB = "d" * 32  # the shape of a job id (uuid4().hex)
SPEC = {"name": "ranks", "recipe": "mlp", "checkpoint": {"keep_last": 2}}


@pytest.fixture
def hold() -> Iterator[contextlib.ExitStack]:
    """What `prepare` holds for the attempt (a root worker's lease of the ranks' uid), ended after it."""
    with contextlib.ExitStack() as stack:
        yield stack


def prepared(settings: Settings, tmp_path: Path) -> RankSetup:
    """The ranks' setup for attempt 1 of a recipe job on this worker."""
    with contextlib.ExitStack() as hold:
        return prepare(
            settings=settings,
            spec=JobSpec.model_validate(SPEC),
            paths=RunPaths(JobFiles(tmp_path, JOB), attempt=1),
            unsandboxed=None,
            hold=hold,
        )


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    return root


def test_the_ranks_get_the_jobs_output_dir(tmp_path: Path) -> None:
    setup = prepared(Settings(home=tmp_path), tmp_path)
    outputs = tmp_path / "jobs" / JOB / "outputs"
    assert setup.env["DPTRAIN_OUTPUT_DIR"] == str(outputs)
    assert setup.box is None or outputs in setup.box.writable, "writable in the sandbox"


def test_the_ranks_get_the_workers_data_root(tmp_path: Path, data_root: Path) -> None:
    setup = prepared(Settings(home=tmp_path, data_root=data_root), tmp_path)
    assert setup.env[DATA_ROOT_ENV] == os.fspath(data_root.resolve()), setup.env


def test_the_ranks_get_the_data_root_resolved(tmp_path: Path, data_root: Path) -> None:
    # dptrain.data.data_path compares resolved paths against it: a root reached through a link works.
    link = tmp_path / "data-link"
    link.symlink_to(data_root, target_is_directory=True)
    setup = prepared(Settings(home=tmp_path, data_root=link), tmp_path)
    assert setup.env[DATA_ROOT_ENV] == os.fspath(data_root.resolve()), setup.env


def test_without_a_data_root_the_ranks_get_none(tmp_path: Path) -> None:
    setup = prepared(Settings(home=tmp_path, data_root=None), tmp_path)
    assert DATA_ROOT_ENV not in setup.env, setup.env


def test_an_empty_data_root_setting_gives_the_ranks_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ROOT_ENV, "")
    setup = prepared(Settings(home=tmp_path), tmp_path)
    assert DATA_ROOT_ENV not in setup.env, setup.env


def test_the_data_root_comes_from_the_settings_not_the_workers_environment(
    tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ranks' environment is an allow-list: the worker's own DPTRAIN_* variables are not passed
    # through, only what its settings say.
    monkeypatch.setenv(DATA_ROOT_ENV, os.fspath(data_root))
    monkeypatch.setenv("DPTRAIN_DATABASE_URL", "postgresql://secret@db/dptrain")
    setup = prepared(Settings(home=tmp_path, data_root=None), tmp_path)
    assert DATA_ROOT_ENV not in setup.env and "DPTRAIN_DATABASE_URL" not in setup.env, setup.env


def test_a_job_env_cannot_name_the_data_root() -> None:
    # The spec keeps user variables out of DPTRAIN_*, so the ranks' data root is always the worker's.
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate({**SPEC, "env": {DATA_ROOT_ENV: "/"}})
    assert refused.value.errors()[0]["loc"][:2] == ("env", DATA_ROOT_ENV), refused.value


@pytest.mark.parametrize(
    ("slots", "env", "threads"),
    [
        (0, {}, None),  # one slot per core: torchrun's own choice stands
        (4096, {}, "1"),  # more slots than cores: one thread a rank
        (4096, {"OMP_NUM_THREADS": "3"}, "3"),  # the job's own setting wins
    ],
)
def test_oversubscribed_ranks_get_one_thread_each(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hold: contextlib.ExitStack,
    slots: int,
    env: dict[str, str],
    threads: str | None,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    setup = prepare(
        settings=Settings(home=tmp_path, node_slots=slots),
        spec=JobSpec.model_validate({**SPEC, "env": env}),
        paths=RunPaths(JobFiles(tmp_path, JOB), attempt=1),
        unsandboxed=None,
        hold=hold,
    )
    assert setup.env.get("OMP_NUM_THREADS") == threads, setup.env
