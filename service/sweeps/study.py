"""A sweep's Optuna study, rebuilt each round from its trials' rows and jobs through Optuna's public API.

The rows hold what a trial is (number, parameters, objective) and its job holds how it stands, so the
study is derived and never stored: Optuna's RDB storage would keep its own trial states (a second
copy, which is how a trial came to show `pruned` while its job had succeeded) and its own Alembic
`alembic_version` in our database.

A trial enters the study with its state, objective and the metric it reported. One pruner keeps
records of its own: ASHA's prune() writes, for each rung a trial reaches, the trial's value there,
and compares later trials with them. Those records are the pruner's business, so under ASHA a trial
is replayed as a live one would have run (asked, reporting, the pruner asked after each report, told
its end) and the pruner writes them itself. Only the reports that can reach a rung are replayed
(the first at or past each rung's step, and the last): replaying every step would cost Optuna a copy
of the trial per report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState, create_trial

from api_schemas import JobStatus, SweepCreate
from service.sweeps import space

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Trial:
    """What the study needs of one trial."""

    number: int
    params: dict[str, Any]
    status: JobStatus
    objective: float | None
    # The objective metric by step (the newest attempt's value of a repeated step).
    steps: list[tuple[int, float]]

    @property
    def state(self) -> TrialState:
        """Optuna's state of the trial, from its job's: only a success with an objective is complete."""
        if self.status is JobStatus.SUCCEEDED:
            return TrialState.COMPLETE if self.objective is not None else TrialState.FAIL
        if self.status is JobStatus.PRUNED:
            return TrialState.PRUNED
        return TrialState.FAIL if self.status.is_terminal() else TrialState.RUNNING


def sampler(spec: SweepCreate, number: int) -> optuna.samplers.BaseSampler:
    """The sampler that asks trial `number`, seeded by (seed, number) so that a restart asks the same."""
    seed = None if spec.seed is None else (spec.seed * 100_003 + number) % 2**31
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if spec.sampler == "grid":
        return optuna.samplers.GridSampler(space.grid(spec.space), seed=spec.seed)
    return optuna.samplers.RandomSampler(seed=seed)


def pruner(spec: SweepCreate) -> optuna.pruners.BasePruner:
    """Optuna's pruner for the sweep's `pruner` options."""
    options = spec.pruner
    if options.type == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=options.n_startup_trials, n_warmup_steps=options.n_warmup_steps
        )
    if options.type == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=options.min_resource, reduction_factor=options.reduction_factor
        )
    return optuna.pruners.NopPruner()


def _rung_reports(spec: SweepCreate, steps: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The reports of `steps` that reach an ASHA rung (the first at or past each rung's), and the last."""
    kept: list[tuple[int, float]] = []
    rung = spec.pruner.min_resource
    for step, value in steps:
        if step >= rung:
            kept.append((step, value))
            while rung <= step:
                rung *= spec.pruner.reduction_factor
    if steps and (not kept or kept[-1] != steps[-1]):
        kept.append(steps[-1])
    return kept


class Study:
    """One round's study: every trial in it, the pruner's decisions on the running ones, the next ask."""

    def __init__(self, spec: SweepCreate, trials: Sequence[Trial]) -> None:
        self.spec = spec
        self.dists: dict[str, BaseDistribution] = space.distributions(spec.space)
        self._pruner = pruner(spec)
        # The replay's own sampler: every replayed trial's parameters are fixed (enqueued).
        self.study = optuna.create_study(
            direction=spec.objective.direction, pruner=self._pruner, sampler=optuna.samplers.RandomSampler()
        )
        self._votes: dict[int, bool] = {}
        # Each trial's place in the study (Optuna numbers trials in order of entry).
        self._index: dict[int, int] = {}
        numbers = sorted(t.number for t in trials)
        # The next ask is Optuna's trial len(trials), which must be the driver's number for it (the
        # grid sampler goes by it): the driver numbers trials 0, 1, 2... with none missing.
        if numbers != list(range(len(numbers))):
            raise ValueError(f"trial numbers {numbers} are not 0..{len(numbers) - 1}")
        # The finished trials first: a running one is then judged against every finished one's
        # record, as it would have been had it reported after they ended.
        ordered = sorted(trials, key=lambda t: (not t.state.is_finished(), t.number))
        for trial in ordered:
            self._index[trial.number] = len(self._index)
            if spec.pruner.type == "asha":
                self._replay(trial)
            else:
                self._add(trial)

    def _add(self, trial: Trial) -> None:
        # A stateless pruner (median, none) reads only the trials' reported values: enter each whole.
        state = trial.state
        self.study.add_trial(
            create_trial(
                state=state,
                value=trial.objective if state is TrialState.COMPLETE else None,
                params=trial.params,
                distributions=self.dists,
                intermediate_values=dict(trial.steps),
            )
        )

    def _replay(self, trial: Trial) -> None:
        self.study.enqueue_trial(trial.params)
        live = self.study.ask(self.dists)
        vote = False
        for step, value in _rung_reports(self.spec, trial.steps):
            live.report(value, step)
            # Not only the newest report's answer: the driver looks once a round, and a trial may
            # have passed a rung and reported again since; stopped at any rung is stopped.
            vote = live.should_prune() or vote
        state = trial.state
        if state is TrialState.COMPLETE:
            self.study.tell(live, trial.objective)
        elif state.is_finished():
            self.study.tell(live, state=state)
        else:
            self._votes[trial.number] = vote

    def prunes(self, number: int) -> bool:
        """The pruner's decision on running trial `number`, given every report it made."""
        if number in self._votes:
            return self._votes[number]
        frozen = self.study.get_trials(deepcopy=False)[self._index[number]]
        return frozen.state is TrialState.RUNNING and bool(self._pruner.prune(self.study, frozen))

    def ask(self, number: int) -> dict[str, Any]:
        """The parameters of new trial `number` (the next in the study), asked of the sweep's sampler."""
        self.study.sampler = sampler(self.spec, number)
        return dict(self.study.ask(self.dists).params)
