"""Shared fixtures: PostgreSQL (one migrated database rolled back per test, or one of a module's own),
the job spec every test builds on, free ports, and the guard that keeps the `e2e` marker honest.
The plugins below add the API's, the engine's and the package index's (tests/env_index.py) fixtures.

Test functions take these as fixtures; code that runs where no fixture reaches (module-level
constants, parametrize lists, helper modules such as tests/e2e/stack.py, spawned ranks) imports the
plain functions from here.
"""

from __future__ import annotations

import copy
import multiprocessing.process
import os
import socket
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from service.db import make_engine
from tests.databases import clone_pg_template

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.api_fixtures", "tests.engine_fixtures", "tests.env_index"]
PG_ADMIN_URL = os.environ.get("DPTRAIN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("DPTRAIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# ---- PostgreSQL ---------------------------------------------------------------------------------------


def create_database(prefix: str = "dptrain_test") -> str:
    """A fresh, migrated PostgreSQL database; fails the test (never skips) if PostgreSQL is down.

    A copy of the template the migrations built once (tests/databases.py), not a replay of them.
    """
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        return clone_pg_template(PG_ADMIN_URL, name)
    except OperationalError as exc:
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN_URL} and could not be reached: {exc}")


def drop_database(url: str) -> None:
    """Drop a database made by create_database, disconnecting whoever is left."""
    name = make_url(url).database
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """One migrated database for the whole run (tests roll back their own changes)."""
    url = create_database()
    yield url
    drop_database(url)


@pytest.fixture(scope="module")
def own_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a fresh migrated database for this module, dropped after it.

    For tests whose commits must be real, which the rolled-back `connection` cannot give: several
    connections or threads that must see each other's writes, LISTEN/NOTIFY (PostgreSQL notifies
    only on commit), or an app, runner or server that opens its own sessions.
    """
    url = create_database(f"dptrain_{request.module.__name__.rpartition('.')[2]}"[:40])
    yield url
    drop_database(url)


@pytest.fixture
def connection(pg_url: str) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back after the test (polar's pattern)."""
    # The service's own engine: JSON written without NaN, read back as the API reads it.
    engine = make_engine(pg_url, pool_size=1)
    conn = engine.connect()
    trans = conn.begin()
    yield conn
    trans.rollback()
    conn.close()
    engine.dispose()


@pytest.fixture
def sessions(connection: Connection) -> sessionmaker[Session]:
    """Sessions whose commits only release a savepoint of the test's transaction."""
    return sessionmaker(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)


@pytest.fixture
def db(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session for arranging and checking rows."""
    with sessions() as session:
        yield session


# ---- ports --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """`free_port()`: a TCP port nobody listens on right now."""
    return free_port


# ---- job specs ----------------------------------------------------------------------------------------

# What every spec starts from: the smallest job a user could send. Whatever it leaves out is the
# API's default, so tests that check the defaults are filled in see them filled in.
BASE_SPEC: dict[str, Any] = {
    "name": "test-job",
    "recipe": "mlp",
    "hyperparameters": {"global_batch_size": 8, "steps": 4},
}

# The job the engine tests train (`make_spec`): momentum and weight decay on, so the optimizer's
# state matters to resume and equivalence; metrics every 5 steps; a collective timeout short enough
# that a hung rank fails the test within its time limit.
ENGINE_JOB: dict[str, Any] = {
    "name": "engine-test",
    "hyperparameters": {
        "global_batch_size": 32,
        "lr": 0.05,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "steps": 10,
        "seed": 1234,
    },
    "resources": {"nodes": 1, "processes_per_node": 1, "device": "cpu"},
    "engine": {"bucket_cap_mb": 25.0, "log_every_steps": 5, "collective_timeout_seconds": 60},
    "checkpoint": {"every_steps": 100, "keep_last": 3},
    "labels": {"suite": "engine"},
    "priority": 0,
}


def _merge(into: dict[str, Any], over: Mapping[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def job_spec(*layers: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """A JobSpec-shaped dict: BASE_SPEC, then each layer, then `overrides`, merged in that order.

    A mapping merges into the section of that name (key by key, at any depth); any other value
    replaces. `job_spec(hyperparameters={"steps": 8})` keeps the base's global batch.
    """
    spec = copy.deepcopy(BASE_SPEC)
    for layer in (*layers, overrides):
        _merge(spec, layer)
    return spec


@pytest.fixture(name="job_spec")
def job_spec_fixture() -> Callable[..., dict[str, Any]]:
    """`job_spec(*layers, **overrides)`: a fresh spec built on the base job."""
    return job_spec


@pytest.fixture
def make_spec() -> Callable[..., dict[str, Any]]:
    """`make_spec(**overrides)`: the engine tests' job (ENGINE_JOB), overrides merged as job_spec does."""
    return lambda *layers, **overrides: job_spec(ENGINE_JOB, *layers, **overrides)


# ---- the e2e marker -----------------------------------------------------------------------------------

# Every way a test could start a process: subprocess (and asyncio's subprocesses, built on it),
# multiprocessing and torch.multiprocessing (their Process.start), and the os calls beneath.
# Threads are not processes: an in-process uvicorn or a scheduler thread is fine anywhere.
_PROCESS_STARTS: list[tuple[Any, str]] = [
    (subprocess.Popen, "_execute_child"),
    (multiprocessing.process.BaseProcess, "start"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "system"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
]


@contextmanager
def _refusing_process_starts(nodeid: str) -> Iterator[list[str]]:
    """While inside, a process start fails the test; yields the starts refused (a thread's too)."""
    refused: list[str] = []

    def refusal(where: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            what = f"{where} {args[1]!r}" if where.endswith("_execute_child") else where
            refused.append(what)
            pytest.fail(f"{nodeid} starts a process ({what}): mark it e2e (pytest.mark.e2e)", pytrace=False)

        return refuse

    with pytest.MonkeyPatch.context() as mp:
        for owner, name in _PROCESS_STARTS:
            if hasattr(owner, name):
                mp.setattr(owner, name, refusal(f"{getattr(owner, '__name__', owner)}.{name}"))
        yield refused


def _guarded(item: pytest.Item) -> Generator[None, Any, Any]:
    """Run a test phase; unless the test is marked e2e, starting a process in it fails the test."""
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    with _refusing_process_starts(item.nodeid) as refused:
        result = yield
    if refused:  # refused where the failure did not reach the test: in a thread, or swallowed
        pytest.fail(f"{item.nodeid} starts processes ({'; '.join(refused)}): mark it e2e", pytrace=False)
    return result


# Setup is guarded as well as the call: a module- or session-scoped fixture runs in the setup of the
# first test that asks for it, and whatever it starts, that test starts. Teardown is not: a shared
# fixture may end (stop servers, drop a database) after a test that never used it.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))
