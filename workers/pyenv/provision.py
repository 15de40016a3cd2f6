"""A node's part of a job's environment: have it built (or reused), say so, and run the ranks in it.

Runs after the reporter exists, so the build's output (the `[setup]` lines of logs/setup.log) is
shipped as it comes, a cancel is heard while it waits or builds, and its failure ends the attempt
at once (EnvironmentBuildFailed, never retried: rank_contract/failures.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.jobs import lifecycle, repository
from service.models.base import utcnow
from workers.attempt.node_run import NodeRun, RunPaths
from workers.attempt.watch import stopping
from workers.pyenv.build import Builder
from workers.pyenv.environments import Environment, environment_key, held, requirement_lines
from workers.reporting.reporter import Reporter
from workers.sandbox.rank_setup import RankSetup

log = logging.getLogger(__name__)


def reporting_poll(reporter: Reporter, *, interval: float) -> Callable[[], bool]:
    """A poll that ships the build's lines every `interval` and says False once the attempt must stop."""
    last = time.monotonic()

    def poll() -> bool:
        nonlocal last
        if time.monotonic() - last >= interval:
            reporter.collect()
            reporter.flush()
            last = time.monotonic()
        state = reporter.state
        return not (state.cancel_requested or state.fenced_out or stopping.is_set())

    return poll


def enter(
    hold: contextlib.ExitStack,
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    run: NodeRun,
    paths: RunPaths,
    setup: RankSetup,
    reporter: Reporter,
) -> RankSetup:
    """`setup` with the job's environment, held by `hold` until it closes; `setup` itself without one.

    Raises environments.EnvironmentFailed (the job's error) or environments.Aborted (the attempt
    is being stopped).
    """
    lines = requirement_lines(run.spec, code_dir=setup.code_dir, settings=settings)
    if lines is None:
        return setup
    _record(sessions, run=run, state={"state": "preparing", "started_at": utcnow().isoformat()})
    builder = Builder(
        lines=lines,
        settings=settings,
        # In the run's logs/ folder and no rank's file: the reporter ships its lines with no rank.
        log=paths.run.setup_log,
        # Where and as whom the ranks run, as rank_setup decided for this attempt.
        sandboxed=setup.box is not None,
        run_as=setup.run_as,
        code_dir=setup.code_dir,
        poll=reporting_poll(reporter, interval=settings.report_interval_seconds),
    )
    env = hold.enter_context(
        held(
            cache=settings.env_cache,
            key=environment_key(lines, settings=settings),
            build=builder,
            poll=builder.poll,
            max_bytes=settings.env_cache_max_bytes,
        )
    )
    _note(sessions, run=run, env=env)
    ready = {"state": "ready", "key": env.key, "cache_hit": env.hit, "build_seconds": round(env.seconds, 3)}
    _record(sessions, run=run, state=ready)
    return with_environment(setup, env)


def with_environment(setup: RankSetup, env: Environment) -> RankSetup:
    """The ranks' setup in `env`: its interpreter first on PATH and starting torchrun, its folder bound."""
    path = setup.env.get("PATH", "")
    ranks_env = {**setup.env, "PATH": f"{env.root / 'bin'}{os.pathsep}{path}", "VIRTUAL_ENV": str(env.root)}
    box = setup.box
    if box is not None:
        box = dataclasses.replace(box, read_only=(*box.read_only, env.root))
    return dataclasses.replace(setup, env=ranks_env, box=box, python=env.python)


def describe(env: Environment) -> str:
    """The timeline's words for how the attempt had its environment."""
    how = "cache hit" if env.hit else "built"
    return f"environment {env.key[:16]}: {how} in {env.seconds:.2f} s"


def _record(sessions: sessionmaker[Session], *, run: NodeRun, state: dict[str, object]) -> None:
    """Node 0 records how the attempt has its environment on the job (fenced by the claim token)."""
    if not run.is_primary:
        return
    try:
        with sessions.begin() as session:
            repository.fenced_update(
                session, job_id=run.att.job_id, claim_token=run.att.token, values={"environment_state": state}
            )
    except Exception:  # noqa: BLE001 - shown to users; the run does not depend on it
        log.warning("job %s: recording its environment's state failed", run.att.job_id, exc_info=True)


def _note(sessions: sessionmaker[Session], *, run: NodeRun, env: Environment) -> None:
    note = describe(env) if run.nnodes == 1 else f"node {run.node_rank}: {describe(env)}"
    log.info("job %s: %s", run.att.job_id, note)
    try:
        with sessions.begin() as session:
            lifecycle.note_running(session, job_id=run.att.job_id, attempt=run.att.number, note=note)
    except Exception:  # noqa: BLE001 - the run does not depend on the note
        log.warning("job %s: noting its environment in the timeline failed", run.att.job_id, exc_info=True)
