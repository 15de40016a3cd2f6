"""The study a round rebuilds from a sweep's rows: Optuna's own pruners, fed through its public API."""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from api_schemas import JobStatus, SweepCreate
from service.sweeps.study import Study, Trial

LR = "hyperparameters.lr"


def spec(**overrides: Any) -> SweepCreate:
    body: dict[str, Any] = {
        "name": "s",
        "base": {},
        "space": {LR: {"log_uniform": [1e-4, 1e-1]}},
        "objective": {"metric": "eval/loss"},
        "max_trials": 10,
        "seed": 3,
    }
    return SweepCreate.model_validate(body | overrides)


def trial(number: int, status: JobStatus, steps: list[float], objective: float | None = None) -> Trial:
    return Trial(
        number=number,
        params={LR: 0.001 * (number + 1)},
        status=status,
        objective=objective,
        steps=list(enumerate(steps, start=1)),
    )


def test_a_trial_is_complete_only_when_its_job_succeeded_with_an_objective() -> None:
    states = {
        (JobStatus.SUCCEEDED, 0.5): TrialState.COMPLETE,
        (JobStatus.SUCCEEDED, None): TrialState.FAIL,
        (JobStatus.PRUNED, None): TrialState.PRUNED,
        (JobStatus.CANCELLED, None): TrialState.FAIL,
        (JobStatus.QUEUED, None): TrialState.RUNNING,
    }
    got = {key: trial(0, key[0], [1.0], key[1]).state for key in states}
    assert got == states


def test_asha_judges_a_rung_passed_between_two_rounds() -> None:
    """The driver looks once a round: a trial may have passed a rung and reported again since."""
    asha = spec(pruner={"type": "asha", "min_resource": 1, "reduction_factor": 2})
    done = [
        trial(0, JobStatus.SUCCEEDED, [1.0, 0.5, 0.4], 0.4),
        trial(1, JobStatus.SUCCEEDED, [1.2, 0.6, 0.5], 0.5),
    ]
    # Behind at rungs 0 and 1 (steps 1 and 2); step 3 reaches no rung.
    behind = trial(2, JobStatus.RUNNING, [5.0, 4.9, 4.8])
    ahead = trial(3, JobStatus.RUNNING, [0.9, 0.45, 0.3])
    study = Study(asha, [*done, behind, ahead])
    assert (study.prunes(2), study.prunes(3)) == (True, False)
    # The next ask is trial 4, a new point of the space.
    assert set(study.ask(4)) == {LR}


def test_a_trial_numbered_after_a_finished_one_is_judged_against_it() -> None:
    median = spec(pruner={"type": "median", "n_startup_trials": 1})
    study = Study(
        median,
        [trial(0, JobStatus.RUNNING, [5.0, 4.0]), trial(1, JobStatus.SUCCEEDED, [1.0, 0.5], 0.5)],
    )
    assert study.prunes(0)
    asha = spec(pruner={"type": "asha", "min_resource": 1, "reduction_factor": 2})
    study = Study(
        asha,
        [
            trial(0, JobStatus.RUNNING, [5.0]),
            trial(1, JobStatus.SUCCEEDED, [1.0, 0.5], 0.5),
            trial(2, JobStatus.SUCCEEDED, [1.1, 0.6], 0.6),
        ],
    )
    assert study.prunes(0)
