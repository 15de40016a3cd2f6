"""The input pipeline: the engine's DataLoader path against a plain DataLoader loop and against in-step reads.

    python -m bench.data_pipeline [--smoke] [--json OUT]

The data is a map-style dataset whose every sample costs about 2 ms of CPU (a pure-Python hash
chain, calibrated on this machine when the benchmark starts; the measured cost is in the notes),
each sample a pure function of its index: the case `data.num_workers` exists for (decoding,
augmentation). The model is a small MLP, so the step is data-bound and what is compared is how
the batches get there.

- `data_pipeline_vs_dataloader`: `Trainer.train()` at world size 1 in this process (the job code
  path, as bench.engine_overhead builds it, checkpoint writing left out) with `data: {num_workers:
  2}`, against a hand-written loop over torch's `DataLoader` (same dataset, 2 workers, batch size,
  model, SGD and steps; forward, loss, backward, step). Each round builds a new DataLoader on both
  sides (train() makes one per call), so both pay worker start-up and shutdown the same way.
- `data_pipeline_speedup_vs_in_step`: the same engine run with `num_workers: 0` (every sample read
  in the rank itself, inside the step: what gathering in the training step costs) over the engine
  with 2 workers.

One intra-op thread in this process, as the worker runs ranks; DataLoader's workers use one each.
Rounds alternate (ABBA); each ratio is one round's seconds of A over B.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from api_schemas import JobSpec
from bench.common import Result, cli, interleaved, ratio_of, result, timed
from bench.engine_overhead import NoCheckpoints
from dptrain import Plan
from workers.engine import distributed
from workers.engine.batch_sampler import mix_seed
from workers.engine.events import EventWriter
from workers.engine.recipes import plan_params
from workers.engine.trainer import Trainer

SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4
WORKERS = 2
BAR = 1.02
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Case:
    """The sizes of one run: per-sample CPU work, model, batch, steps per round and rounds."""

    work_ms: float  # the CPU time each sample should cost (calibrated to this)
    features: int
    hidden: int
    classes: int
    batch: int
    steps: int
    rounds: int
    warmup: int


FULL = Case(work_ms=2.0, features=64, hidden=128, classes=10, batch=16, steps=40, rounds=15, warmup=1)
# A tenth of the work and a few steps: the code paths (worker start, both loaders, both engines) run.
SMOKE = Case(work_ms=0.2, features=8, hidden=16, classes=4, batch=4, steps=3, rounds=1, warmup=0)


def _chain(start: int, rounds: int) -> int:
    """`rounds` steps of a 64-bit LCG from `start`: deterministic CPU work (holds the GIL, like decoding)."""
    h = start
    for _ in range(rounds):
        h = (h * 6364136223846793005 + 1442695040888963407) & _MASK64
    return h


class SlowSamples(Dataset[tuple[torch.Tensor, int]]):
    """`size` samples, each `(features, label)` computed from its index with `work` hash rounds.

    A module-level class: DataLoader's workers get it by pickling (fork copies it, spawn pickles it).
    """

    def __init__(self, size: int, work: int, features: int, classes: int) -> None:
        self.size, self.work, self.features, self.classes = size, work, features, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        h = _chain(index + 1, self.work)
        # The features depend on the chain's end, so the work cannot be skipped; 63 bits for the seed.
        g = torch.Generator().manual_seed(h >> 1)
        x = torch.randn(self.features, generator=g)
        return x, h % self.classes


def _per_sample_s(data: SlowSamples, samples: int) -> float:
    """Median seconds of one sample of `data`, read in this process."""
    times = []
    for i in range(samples):
        start = time.perf_counter()
        data[i]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(case: Case) -> tuple[int, float]:
    """Hash rounds for about `case.work_ms` of CPU per sample, and the seconds per sample then measured."""
    probe = 20_000
    _per_sample_s(SlowSamples(4, probe, case.features, case.classes), 4)  # warm the interpreter up first
    per_round = _per_sample_s(SlowSamples(16, probe, case.features, case.classes), 16) / probe
    work = max(1, round(case.work_ms / 1e3 / per_round))
    return work, _per_sample_s(SlowSamples(32, work, case.features, case.classes), 32)


def build(hp: Mapping[str, Any], seed: int) -> Plan:
    """The plan (an entrypoint's form): a small MLP over SlowSamples, cross entropy."""
    torch.manual_seed(seed)
    features, classes = int(hp["features"]), int(hp["classes"])
    model = nn.Sequential(
        nn.Linear(features, int(hp["hidden"])), nn.ReLU(), nn.Linear(int(hp["hidden"]), classes)
    )
    data = SlowSamples(int(hp["samples"]), int(hp["work"]), features, classes)
    return Plan(model=model, dataset=data, loss_fn=nn.functional.cross_entropy)


def _hyperparameters(case: Case, work: int) -> dict[str, Any]:
    return {
        "global_batch_size": case.batch,
        "lr": LR,
        "momentum": MOMENTUM,
        "weight_decay": WEIGHT_DECAY,
        "steps": case.steps,
        "seed": SEED,
        # One epoch per round: the plain loop's DataLoader then yields exactly `steps` batches.
        "samples": case.batch * case.steps,
        "work": work,
        "features": case.features,
        "hidden": case.hidden,
        "classes": case.classes,
    }


def engine_side(case: Case, work: int, num_workers: int, run_dir: Path) -> tuple[Callable[[], None], Trainer]:
    """A Trainer over `build`'s plan with `data.num_workers`; the callable trains `case.steps` steps."""
    cfg = JobSpec.model_validate(
        {
            "name": "data-pipeline-bench",
            "entrypoint": "bench.data_pipeline:build",
            "hyperparameters": _hyperparameters(case, work),
            "resources": {"device": "cpu"},
            "data": {"num_workers": num_workers},
        }
    )
    plan = build(plan_params(cfg), SEED)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventWriter(run_dir / "events" / "rank0.jsonl", 0)
    ckpt = NoCheckpoints(run_dir / "checkpoints", cfg.checkpoint.keep_last, True, cfg.checkpoint.every_steps)
    local = cfg.local_batch_size(1)
    trainer = Trainer(
        cfg, plan, distributed.DistEnv(), torch.device("cpu"), events, ckpt, local_batch_size=local
    )

    def run() -> None:
        trainer.iter = 0  # train() runs from ITER to steps: the same steps (and a new loader) every round
        trainer.train()

    return run, trainer


def plain_side(case: Case, work: int) -> Callable[[], None]:
    """A hand-written loop over a new `DataLoader(..., num_workers=2, shuffle=True)` per round."""
    plan = build(_hyperparameters(case, work), SEED)
    model, data = plan.model, plan.dataset
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(mix_seed(SEED, 1))

    def run() -> None:
        loader = DataLoader(data, batch_size=case.batch, shuffle=True, num_workers=WORKERS, generator=gen)
        # Read to the end (one epoch = `steps` batches): the iterator then stops its workers itself.
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def measure(case: Case, work: int) -> dict[str, dict[str, Any]]:
    """Both interleaved comparisons: engine (2 workers) vs plain, and engine (0 workers) vs engine (2)."""
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-data-") as tmp:
        workers, t_workers = engine_side(case, work, WORKERS, Path(tmp) / "workers")
        in_step, t_in_step = engine_side(case, work, 0, Path(tmp) / "in-step")
        plain = plain_side(case, work)
        try:
            vs_plain = interleaved(
                lambda: timed(workers), lambda: timed(plain), case.rounds, warmup=case.warmup
            )
            vs_in_step = interleaved(
                lambda: timed(in_step), lambda: timed(workers), case.rounds, warmup=case.warmup
            )
        finally:
            t_workers.events.close()
            t_in_step.events.close()
    return {"vs_plain": vs_plain, "vs_in_step": vs_in_step}


def _steps_per_s(case: Case, seconds: Sequence[float]) -> float:
    return case.steps / statistics.median(seconds)


def run(smoke: bool = False) -> dict[str, Result]:
    """Calibrate the per-sample work, then measure both comparisons."""
    case = SMOKE if smoke else FULL
    # One intra-op thread, as the worker runs ranks (see bench.engine_overhead); the loader workers
    # set one each themselves.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work, sample_s = calibrate(case)
        start = time.perf_counter()
        m = measure(case, work)
        took = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    vs_plain, vs_in_step = m["vs_plain"], m["vs_in_step"]
    # vs_in_step's ratios are in-step seconds / workers seconds: the speed-up itself.
    sizes = (
        f"MLP {case.features}-{case.hidden}-{case.classes}, batch {case.batch}, {case.steps} steps a round, "
        f"{case.rounds} rounds"
    )
    work_note = (
        f"per-sample work: {sample_s * 1e3:.2f} ms measured in the main process ({work} hash rounds, "
        f"calibrated to {case.work_ms} ms); {case.batch * sample_s * 1e3:.0f} ms of samples per batch"
    )
    common: dict[str, Any] = {"threads": 1, "sample_ms": sample_s * 1e3, "work_rounds": work}
    return {
        "data_pipeline_vs_dataloader": result(
            benchmark="Input pipeline (bench.data_pipeline)",
            compared=f"`Trainer.train()` with `data.num_workers: {WORKERS}` / plain loop over torch's "
            f"`DataLoader` ({WORKERS} workers), seconds per round, ~{case.work_ms:g} ms of CPU per sample",
            unit="x (time ratio)",
            **ratio_of(vs_plain),
            bar=BAR,
            higher_is_better=False,
            smoke=smoke,
            ratios=vs_plain["ratios"],
            engine_s=vs_plain["a_s"],
            plain_s=vs_plain["b_s"],
            notes=[
                f"{sizes}: engine {_steps_per_s(case, vs_plain['a_s']):.1f} vs plain DataLoader loop "
                f"{_steps_per_s(case, vs_plain['b_s']):.1f} steps/s (median rounds, worker start-up "
                f"included); {work_note}",
            ],
            **common,
        ),
        "data_pipeline_speedup_vs_in_step": result(
            benchmark="Input pipeline (bench.data_pipeline)",
            compared=f"engine with `data.num_workers: 0` (samples read in the step) / with {WORKERS}, "
            "seconds per round: the speed-up of loader workers",
            unit="x (speed-up)",
            **ratio_of(vs_in_step),
            bar=None,
            higher_is_better=True,
            smoke=smoke,
            ratios=vs_in_step["ratios"],
            in_step_s=vs_in_step["a_s"],
            workers_s=vs_in_step["b_s"],
            notes=[
                f"engine {_steps_per_s(case, vs_in_step['b_s']):.1f} steps/s with {WORKERS} workers vs "
                f"{_steps_per_s(case, vs_in_step['a_s']):.1f} with 0 (median rounds, on "
                f"{os.cpu_count()} cores); both comparisons took {took:.0f} s",
            ],
            **common,
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.data_pipeline", __doc__, run, argv)


if __name__ == "__main__":
    main()
