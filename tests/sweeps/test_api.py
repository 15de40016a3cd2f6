"""`/v1/sweeps`: every point of the space checked at submit, the owner's only, the driver's rounds."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api_schemas import JobStatus
from service.config import Settings
from service.jobs import lifecycle
from service.models import Job, Metric, SweepTrial, User
from service.sweeps import driver
from tests.api_fixtures import SPEC, add_user, as_user

METRIC = "train/loss"


def sweep_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "lr-sweep",
        "base": SPEC,
        "space": {
            "hyperparameters.lr": {"log_uniform": [1e-4, 1e-1]},
            "hyperparameters.momentum": {"uniform": [0, 0.9]},
        },
        "objective": {"metric": METRIC, "direction": "minimize"},
        "sampler": "random",
        "max_trials": 4,
        "max_concurrent_trials": 2,
        "seed": 7,
    }
    return body | overrides


def create(client: TestClient, **overrides: Any) -> dict[str, Any]:
    r = client.post("/v1/sweeps", json=sweep_body(**overrides))
    assert r.status_code == 201, r.text
    return dict(r.json())


def trials(db: Session, sweep_id: str) -> list[SweepTrial]:
    db.expire_all()
    return list(
        db.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id).order_by(SweepTrial.number))
    )


def finish(sessions: sessionmaker[Session], job_id: str, values: list[float], *, end: bool = True) -> None:
    """Run a trial's job (as a worker would) reporting `values` at steps 1.., and end it succeeded."""
    with sessions.begin() as session:
        job = session.get(Job, job_id)
        assert job is not None
        if job.status == JobStatus.QUEUED.value:
            assert lifecycle.claim(session, job_id=job_id, worker="node-a") is not None
        session.add_all(
            Metric(job_id=job_id, attempt=1, name=METRIC, step=step, value=value)
            for step, value in enumerate(values, start=1)
        )
        if end:
            lifecycle.transition(session, job_id=job_id, src=JobStatus.RUNNING, dst=JobStatus.SUCCEEDED)


def test_a_sweep_starts_its_trials_as_labelled_jobs_and_names_the_best(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    sweep = create(client)
    assert sweep["state"] == "running" and sweep["trials"] == [] and sweep["best"] is None
    driver.run_once(sessions=sessions, settings=settings)
    first = trials(db, sweep["id"])
    assert [t.number for t in first] == [0, 1]  # max_concurrent_trials
    jobs = {j.id: j for j in db.scalars(select(Job).where(Job.id.in_([t.job_id for t in first])))}
    for t in first:
        job = jobs[t.job_id]
        assert job.name == f"lr-sweep-{t.number}" and job.labels["sweep"] == sweep["id"]
        # Every rank reads the same spec: the trial's parameters are in it.
        assert job.spec["hyperparameters"]["lr"] == t.params["hyperparameters.lr"]
        assert 1e-4 <= t.params["hyperparameters.lr"] <= 1e-1
    # Nothing ended: another round starts nothing more (and a restarted driver repeats nothing).
    driver.run_once(sessions=sessions, settings=settings)
    assert len(trials(db, sweep["id"])) == 2
    objectives = [0.9, 0.3, 0.5, 0.7]
    for number in range(4):
        trial = trials(db, sweep["id"])[number]
        finish(sessions, trial.job_id or "", [2.0, objectives[number]])
        driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{sweep['id']}").json()
    assert shown["state"] == "succeeded" and shown["finished_at"] is not None
    assert [t["objective"] for t in shown["trials"]] == objectives
    assert [t["status"] for t in shown["trials"]] == ["succeeded"] * 4
    assert shown["trials"][1]["steps"] == [[1, 2.0], [2, 0.3]]
    assert shown["best"]["number"] == 1 and shown["best"]["objective"] == min(objectives)
    # A decided sweep starts nothing more.
    driver.run_once(sessions=sessions, settings=settings)
    labelled = select(func.count()).select_from(Job).where(Job.labels["sweep"].as_string() == sweep["id"])
    assert db.scalar(labelled) == 4


def test_the_median_pruner_stops_a_trial_worse_than_the_finished_ones(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    sweep = create(client, pruner={"type": "median", "n_startup_trials": 2}, max_trials=3)
    driver.run_once(sessions=sessions, settings=settings)
    a, b = trials(db, sweep["id"])
    finish(sessions, a.job_id or "", [1.0, 0.5])
    finish(sessions, b.job_id or "", [1.0, 0.4])
    driver.run_once(sessions=sessions, settings=settings)
    c = trials(db, sweep["id"])[2]
    finish(sessions, c.job_id or "", [5.0, 4.0], end=False)
    driver.run_once(sessions=sessions, settings=settings)
    job = db.get(Job, c.job_id, populate_existing=True)
    # Stopped through the job's cancel path, flagged as the pruner's.
    assert job is not None and job.cancel_requested and job.prune_requested
    shown = client.get(f"/v1/sweeps/{sweep['id']}").json()
    # The trial is its job: running until its ranks are gone, and the sweep with it.
    assert shown["trials"][2]["status"] == "running" and shown["state"] == "running"
    with sessions.begin() as session:
        # How its worker ends the stopped run (workers/attempt/end.py): pruned, not cancelled.
        dst, reason = lifecycle.end_of_cancelled_run(
            finished=False, pruned=lifecycle.prune_requested(session, job_id=job.id)
        )
        assert dst is JobStatus.PRUNED and dst.is_terminal()
        lifecycle.transition(session, job_id=job.id, src=JobStatus.RUNNING, dst=dst, reason=reason)
    driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{sweep['id']}").json()
    assert shown["state"] == "succeeded" and shown["best"]["number"] == 1
    assert client.get(f"/v1/jobs/{job.id}").json()["status"] == "pruned"


def test_a_space_point_that_makes_an_invalid_spec_is_422_naming_its_path(client: TestClient) -> None:
    # SPEC runs 2 ranks: a global batch of 7 does not divide.
    space = {"hyperparameters.global_batch_size": {"choice": [8, 7]}}
    r = client.post("/v1/sweeps", json=sweep_body(space=space))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "space", "hyperparameters.global_batch_size"] and detail["input"] == 7
    # An int range is checked at each of its values, however wide: gpt's d_model 4290 divides by
    # 1, 2, 33, 65 and 66 (the range's ends, their neighbours and middle) but not by 4.
    space = {"hyperparameters.global_batch_size": {"int": [8, 11]}}
    r = client.post("/v1/sweeps", json=sweep_body(space=space))
    assert r.json()["detail"][0]["loc"] == ["body", "space", "hyperparameters.global_batch_size"]
    gpt = {
        **SPEC,
        "recipe": "gpt",
        "hyperparameters": {"global_batch_size": 8, "steps": 4, "d_model": 4290, "n_heads": 1},
    }
    r = client.post(
        "/v1/sweeps", json=sweep_body(base=gpt, space={"hyperparameters.n_heads": {"int": [1, 66]}})
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "space", "hyperparameters.n_heads"]
    assert r.json()["detail"][0]["input"] == 4, r.text
    # A space too large to check every point is refused, saying so, before any point is listed.
    huge = {"hyperparameters.global_batch_size": {"int": [1, 10**18]}}
    r = client.post("/v1/sweeps", json=sweep_body(space=huge))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "space"], r.text
    assert "narrow an int range" in r.json()["detail"][0]["msg"]
    r = client.post(
        "/v1/sweeps", json=sweep_body(space={"hyperparameters.momentum": {"uniform": [0.5, 1.5]}})
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == [
        "body",
        "space",
        "hyperparameters.momentum",
    ]
    r = client.post("/v1/sweeps", json=sweep_body(space={"hyperparameters.lr": {"log_uniform": [0, 1]}}))
    assert r.status_code == 422
    r = client.post("/v1/sweeps", json=sweep_body(base={**SPEC, "resources": {"processes_per_node": 0}}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "base"]
    assert client.get("/v1/sweeps").json() == {"items": [], "next_cursor": None}


def test_a_space_cannot_give_trials_what_the_owner_may_not_submit(client: TestClient, db: Session) -> None:
    """An `env` reached through the space needs the code grant, as on POST /v1/jobs."""
    plain = as_user(add_user(db, "plain"))
    r = client.post(
        "/v1/sweeps", json=sweep_body(space={"env.WANDB_MODE": {"choice": ["offline"]}}), headers=plain
    )
    assert r.status_code == 403, r.text
    assert client.get("/v1/sweeps", headers=plain).json()["items"] == []


def test_another_users_sweep_is_404_and_cancel_stops_its_trials(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    sweep = create(client)
    driver.run_once(sessions=sessions, settings=settings)
    other = as_user(add_user(db, "mallory"))
    assert client.get(f"/v1/sweeps/{sweep['id']}", headers=other).status_code == 404
    assert client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=other).status_code == 404
    assert client.get("/v1/sweeps", headers=other).json()["items"] == []
    first, second = trials(db, sweep["id"])
    finish(sessions, first.job_id or "", [1.0], end=False)  # one running, one queued
    r = client.post(f"/v1/sweeps/{sweep['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    db.expire_all()
    running, queued = db.get(Job, first.job_id), db.get(Job, second.job_id)
    assert running is not None and running.cancel_requested
    assert queued is not None and queued.status == JobStatus.CANCELLED.value
    driver.run_once(sessions=sessions, settings=settings)
    assert len(trials(db, sweep["id"])) == 2


def test_sweeps_are_listed_in_cursor_pages(client: TestClient) -> None:
    ids = [create(client, name=f"s{i}")["id"] for i in range(3)]
    page = client.get("/v1/sweeps", params={"limit": 2}).json()
    assert [s["id"] for s in page["items"]] == ids[::-1][:2]
    rest = client.get("/v1/sweeps", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert [s["id"] for s in rest["items"]] == ids[:1] and rest["next_cursor"] is None
    assert client.get("/v1/sweeps", params={"cursor": "nope"}).status_code == 422


def test_a_round_that_dies_mid_trial_leaves_nothing_and_the_next_asks_the_same(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session, monkeypatch: Any
) -> None:
    """A restart loses no trial and repeats none: row and job commit together, the sample is seeded."""
    sweep = create(client, max_concurrent_trials=1)
    twin = create(client, name="twin", max_concurrent_trials=1)
    real = driver.repository.add_trial

    def crash(session: Session, *, trial: SweepTrial) -> None:
        raise RuntimeError("the API process died here")

    monkeypatch.setattr(driver.repository, "add_trial", crash)
    driver.run_once(sessions=sessions, settings=settings)  # logged, rolled back, sweeps still running
    assert trials(db, sweep["id"]) == [] and db.scalar(select(func.count()).select_from(Job)) == 0
    monkeypatch.setattr(driver.repository, "add_trial", real)
    for _ in range(3):  # a round per restart: still one trial each, one job each
        driver.run_once(sessions=sessions, settings=settings)
    (mine,), (theirs,) = trials(db, sweep["id"]), trials(db, twin["id"])
    assert mine.params == theirs.params  # the same seed and number ask for the same point
    assert db.scalar(select(func.count()).select_from(Job)) == 2


def test_the_embedded_services_sqlite_takes_a_sweep(sqlite_client: TestClient) -> None:
    sweep = create(sqlite_client, sampler="tpe", pruner={"type": "asha"})
    assert sqlite_client.get(f"/v1/sweeps/{sweep['id']}").json()["spec"]["sampler"] == "tpe"
    r = sqlite_client.post(
        "/v1/sweeps", json=sweep_body(space={"hyperparameters.global_batch_size": {"choice": [3]}})
    )
    assert r.status_code == 422


def test_asha_prunes_a_trial_behind_at_its_rung_and_promotes_one_ahead(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    asha = {"type": "asha", "min_resource": 1, "reduction_factor": 2}
    sweep = create(client, pruner=asha, max_trials=4, max_concurrent_trials=2)
    driver.run_once(sessions=sessions, settings=settings)
    a, b = trials(db, sweep["id"])
    finish(sessions, a.job_id or "", [1.0, 0.5])
    finish(sessions, b.job_id or "", [1.2, 0.6])
    driver.run_once(sessions=sessions, settings=settings)
    c, d = trials(db, sweep["id"])[2:]
    # At rung 0 (step 1) the top 1 of 3 go on: 5.0 is behind 1.0, 0.1 ahead (and short of rung 1).
    finish(sessions, c.job_id or "", [5.0], end=False)
    finish(sessions, d.job_id or "", [0.1], end=False)
    driver.run_once(sessions=sessions, settings=settings)
    stopped = {t.number: db.get(Job, t.job_id, populate_existing=True) for t in trials(db, sweep["id"])[2:]}
    assert {n: j is not None and j.prune_requested for n, j in stopped.items()} == {2: True, 3: False}


def test_a_later_trial_is_checked_as_its_own_submit_and_a_refusal_fails_the_sweep_saying_why(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    from service.users import repository as users_repository
    from service.users import service as users

    token = users.create(db, name="coder", admin=False, can_run_code=True).token
    db.commit()
    r = client.post(
        "/v1/sweeps",
        json=sweep_body(space={"env.WANDB_MODE": {"choice": ["offline", "disabled"]}}),
        headers=as_user(token),
    )
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert driver.run_once(sessions=sessions, settings=settings)  # trials 0 and 1 submitted
    assert not driver.run_once(sessions=sessions, settings=settings)  # a round that starts nothing
    first, second = trials(db, sweep["id"])
    # The admin takes the code grant back: trial 2 would be a submit the owner may no longer make.
    coder = db.scalar(select(User).where(User.name == "coder"))
    assert coder is not None
    users_repository.set_can_run_code(db, user_id=coder.id, allowed=False)
    db.commit()
    finish(sessions, first.job_id or "", [1.0, 0.5])
    driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{sweep['id']}", headers=as_user(token)).json()
    assert shown["state"] == "failed" and len(shown["trials"]) == 2, shown
    assert "trial 2's submit was refused (403)" in shown["error"], shown["error"]
    db.expire_all()
    queued = db.get(Job, second.job_id)
    assert queued is not None and queued.status == JobStatus.CANCELLED.value  # nothing left running


def test_a_full_queue_holds_the_next_trial_back_until_one_starts(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    sweep = create(client, max_trials=3, max_concurrent_trials=3)
    capped = settings.model_copy(update={"max_queued_per_user": 2})
    assert driver.run_once(sessions=sessions, settings=capped)
    assert [t.number for t in trials(db, sweep["id"])] == [0, 1]  # the third waits, the sweep runs on
    finish(sessions, trials(db, sweep["id"])[0].job_id or "", [1.0], end=False)  # one starts
    driver.run_once(sessions=sessions, settings=capped)
    assert [t.number for t in trials(db, sweep["id"])] == [0, 1, 2]
    assert client.get(f"/v1/sweeps/{sweep['id']}").json()["state"] == "running"


def test_a_refusal_mid_round_also_cancels_the_trials_that_round_started(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    from service.users import repository as users_repository
    from service.users import service as users

    token = users.create(db, name="eager", admin=False).token
    eager = db.scalar(select(User).where(User.name == "eager"))
    assert eager is not None
    users_repository.set_max_priority(db, user_id=eager.id, ceiling=5)
    db.commit()
    # The grid sampler with seed 1 asks priority 0 first, then 5.
    body = sweep_body(space={"priority": {"choice": [0, 5]}}, sampler="grid", max_trials=2, seed=1)
    r = client.post("/v1/sweeps", json=body, headers=as_user(token))
    assert r.status_code == 201, r.text
    users_repository.set_max_priority(db, user_id=eager.id, ceiling=0)  # an admin lowers the ceiling
    db.commit()
    driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{r.json()['id']}", headers=as_user(token)).json()
    assert shown["state"] == "failed" and "trial 1's submit was refused (403)" in shown["error"], shown
    (first,) = trials(db, shown["id"])
    job = db.get(Job, first.job_id, populate_existing=True)
    assert job is not None and job.status == JobStatus.CANCELLED.value  # started this round, stopped too


def test_a_trial_that_finishes_while_the_pruner_decides_keeps_its_objective(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    """Pruned-though-succeeded: the pruner stops a trial whose ranks are already past their last step."""
    sweep = create(client, pruner={"type": "median", "n_startup_trials": 2}, max_trials=3)
    driver.run_once(sessions=sessions, settings=settings)
    a, b = trials(db, sweep["id"])
    finish(sessions, a.job_id or "", [1.0, 0.5])
    finish(sessions, b.job_id or "", [1.0, 0.4])
    driver.run_once(sessions=sessions, settings=settings)
    c = trials(db, sweep["id"])[2]
    finish(sessions, c.job_id or "", [5.0, 4.0], end=False)
    driver.run_once(sessions=sessions, settings=settings)  # the pruner asks c's job to stop
    job = db.get(Job, c.job_id, populate_existing=True)
    assert job is not None and job.cancel_requested and job.prune_requested
    with sessions.begin() as session:
        # Meanwhile c's ranks ran their last step, a good one, and the final checkpoint: its worker
        # ends the run as every cancelled run that finished first ends (workers/attempt/end.py).
        session.add(Metric(job_id=job.id, attempt=1, name=METRIC, step=3, value=0.1))
        dst, reason = lifecycle.end_of_cancelled_run(
            finished=True, pruned=lifecycle.prune_requested(session, job_id=job.id)
        )
        assert lifecycle.transition(session, job_id=job.id, src=JobStatus.RUNNING, dst=dst, reason=reason)
    driver.run_once(sessions=sessions, settings=settings)
    shown = client.get(f"/v1/sweeps/{sweep['id']}").json()
    trial = shown["trials"][2]
    assert (trial["status"], trial["objective"]) == ("succeeded", 0.1), trial
    assert client.get(f"/v1/jobs/{job.id}").json()["status"] == "succeeded"
    assert shown["state"] == "succeeded" and shown["best"]["number"] == 2, shown["best"]


def test_a_trial_past_its_last_step_is_not_pruned(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings, db: Session
) -> None:
    """Stopping it would save nothing and could only race its final checkpoint (`pruned` at 4/4)."""
    sweep = create(client, pruner={"type": "median", "n_startup_trials": 2}, max_trials=3)
    driver.run_once(sessions=sessions, settings=settings)
    a, b = trials(db, sweep["id"])
    finish(sessions, a.job_id or "", [1.0, 0.5])
    finish(sessions, b.job_id or "", [1.0, 0.4])
    driver.run_once(sessions=sessions, settings=settings)
    c = trials(db, sweep["id"])[2]
    finish(sessions, c.job_id or "", [5.0, 4.0], end=False)
    with sessions.begin() as session:
        job = session.get(Job, c.job_id)
        assert job is not None and job.total_steps is not None
        job.step = job.total_steps  # its ranks ran every step; the final checkpoint is being written
    driver.run_once(sessions=sessions, settings=settings)
    job = db.get(Job, c.job_id, populate_existing=True)
    assert job is not None and not job.cancel_requested, "a trial at its last step was asked to stop"
