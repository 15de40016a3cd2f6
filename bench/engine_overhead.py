"""Engine overhead at world size 1: the engine's `Trainer.train()` against a plain PyTorch loop.

    python -m bench.engine_overhead [--smoke] [--json OUT]

Both sides train the same recipe model (same seed, so the same initial weights), on the same
in-memory data, with the same SGD (lr, momentum, weight decay) for the same steps, in this process,
with one intra-op thread (as the worker runs each rank). The engine side is the real job code
path: `Trainer.train()` with the job's default engine options (a metrics event for every step,
written to a real events file per window of steps, the loss checked for finiteness every step);
only checkpoint writing is left out (a checkpoint manager that never saves), since benchmark 6
measures that and a plain loop has none.
Rounds alternate (ABBA) and each ratio is engine seconds / plain seconds of one round.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from api_schemas import JobSpec
from bench.common import RecipeCase, Result, cli, interleaved, ratio_of, result, timed
from workers.engine import distributed
from workers.engine.batch_sampler import mix_seed
from workers.engine.checkpoint import CheckpointManager, LoadedCheckpoint
from workers.engine.events import EventWriter
from workers.engine.recipes import RECIPES, plan_params
from workers.engine.trainer import Trainer

SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4
BAR = 1.02


@dataclass(frozen=True)
class Case(RecipeCase):
    """One recipe at one size, trained this many steps per round."""

    steps: int


FULL = [
    Case("mlp 4x256, batch 128", "mlp", {"input_size": 128, "hidden_size": 256, "num_layers": 4}, 128, 400),
    Case("cnn_bn 16x16, batch 64", "cnn_bn", {"image_size": 16}, 64, 100),
]
SMOKE = [
    Case("mlp 2x32, batch 16", "mlp", {"input_size": 16, "hidden_size": 32, "num_layers": 2}, 16, 5),
    Case("cnn_bn 8x8, batch 8", "cnn_bn", {"image_size": 8, "dataset_size": 64}, 8, 3),
]


class NoCheckpoints(CheckpointManager):
    """The engine's checkpoint manager with saving turned off (benchmark 6 measures checkpoint I/O)."""

    def should_save(self, step: int, last: bool = False) -> bool:
        """Never."""
        return False

    def load(self, latest: bool = True, step: int | None = None) -> LoadedCheckpoint | None:
        """Nothing to resume from."""
        return None


def _spec(case: Case, device: str = "cpu", precision: str = "fp32") -> dict[str, Any]:
    return {
        "name": "overhead-bench",
        "recipe": case.recipe,
        "hyperparameters": {
            "global_batch_size": case.batch,
            "lr": LR,
            "momentum": MOMENTUM,
            "weight_decay": WEIGHT_DECAY,
            "steps": case.steps,
            "seed": SEED,
            **case.extras,
        },
        "resources": {"device": device},
        "engine": {"precision": precision},
    }


def engine_side(
    case: Case,
    run_dir: Path,
    device: torch.device | None = None,
    precision: str = "fp32",
    backend: str | None = None,
) -> tuple[Callable[[], None], Trainer]:
    """A Trainer as `workers.engine.main.run` builds it; the callable trains `case.steps` steps."""
    device = device or torch.device("cpu")
    cfg = JobSpec.model_validate(_spec(case, device.type, precision))
    torch.manual_seed(SEED)
    plan = RECIPES[case.recipe](plan_params(cfg), SEED)
    events = EventWriter(run_dir / "events" / "rank0.jsonl", 0)
    ckpt = NoCheckpoints(run_dir / "checkpoints", cfg.checkpoint.keep_last, True, cfg.checkpoint.every_steps)
    local = cfg.local_batch_size(1)
    trainer = Trainer(
        cfg, plan, distributed.DistEnv(), device, events, ckpt, local_batch_size=local, backend=backend
    )

    def run() -> None:
        trainer.iter = 0  # train() runs from ITER to cfg.hyperparameters.steps: the same steps every round
        trainer.train()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run, trainer


def plain_side(case: Case, device: torch.device | None = None, precision: str = "fp32") -> Callable[[], None]:
    """A hand-written loop: index a shuffled epoch, forward, loss, backward, SGD step."""
    device = device or torch.device("cpu")
    torch.manual_seed(SEED)
    plan = RECIPES[case.recipe](case.extras, SEED)
    model: nn.Module = plan.model.to(device)
    data = plan.dataset
    # The data stays in host memory and each batch is copied over, as from a DataLoader (the engine does
    # the same in `TensorDataset.batch`).
    inputs, targets = data.inputs, data.targets  # type: ignore[attr-defined]
    n = inputs.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    assert plan.loss_fn is not None, "the built-in recipes use loss_fn"
    loss_fn = plan.loss_fn  # the recipe's own: cross entropy over classes, or over every position (gpt)
    b = case.batch
    gen = torch.Generator().manual_seed(mix_seed(SEED, 1))
    bf16 = precision == "bf16"

    def run() -> None:
        perm = torch.randperm(n, generator=gen)
        pos = 0
        for _ in range(case.steps):
            if pos + b > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos : pos + b]
            pos += b
            x, y = inputs[idx].to(device), targets[idx].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def measure(case: Case, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of engine vs plain for one case."""
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-") as tmp:
        engine, trainer = engine_side(case, Path(tmp))
        plain = plain_side(case)

        try:
            out = interleaved(lambda: timed(engine), lambda: timed(plain), rounds)
        finally:
            trainer.events.close()
    out["steps_per_s_engine"] = case.steps / min(out["a_s"])
    out["steps_per_s_plain"] = case.steps / min(out["b_s"])
    return out


def run(smoke: bool = False, rounds: int | None = None) -> dict[str, Result]:
    """Measure every case; the headline figure is the worst case's median ratio."""
    cases = SMOKE if smoke else FULL
    rounds = rounds or (2 if smoke else 15)
    # One intra-op thread on both sides, as the worker runs ranks (OMP_NUM_THREADS=1): what is compared
    # is the loop around the kernels, and two OpenMP threads on two shared cores turn any neighbour's
    # activity into several-x noise.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_case = {c.name: measure(c, rounds) for c in cases}
    finally:
        torch.set_num_threads(threads)
    worst = max(per_case.values(), key=lambda m: m["median"])
    notes = [
        f"{name}: median {m['median']:.3f} (min {m['min']:.3f}, max {m['max']:.3f}) over {rounds} rounds; "
        f"best {m['steps_per_s_engine']:.0f} vs {m['steps_per_s_plain']:.0f} steps/s"
        for name, m in per_case.items()
    ]
    return {
        "engine_world1_vs_plain": result(
            benchmark="1. Engine overhead at world size 1",
            compared="`Trainer.train()` (job defaults, events every step) / plain PyTorch loop, "
            "seconds per round; worst of the cases",
            unit="x (time ratio)",
            **ratio_of(worst),
            bar=BAR,
            higher_is_better=False,
            smoke=smoke,
            threads=1,
            cases={
                name: {k: v for k, v in m.items() if k not in ("a_s", "b_s")} for name, m in per_case.items()
            },
            notes=notes,
        )
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.engine_overhead", __doc__, run, argv)


if __name__ == "__main__":
    main()
