"""The engine's evaluation protocol in one process: the figures every world size must reproduce.

Eval batches are the eval set's indices [0, N) in order, cut into `batch_size` (the last may be
shorter), the first `max_batches` of them. Per batch: `loss_fn(model(inputs), targets)` (a mean) is
added as `loss * samples` over `samples`, and each `eval_metrics` (sum, count) is added, all in
float64; the model is in eval mode, under no_grad. eval/loss = loss sum / samples and eval/<name> =
sum / count. The engine splits the batches across ranks and all-reduces the sums and counts, so its
figures must equal these at any world size.
"""

from __future__ import annotations

import math

import torch

from dptrain import Plan


def eval_batches(size: int, batch_size: int, max_batches: int | None = None) -> list[torch.Tensor]:
    """The indices of each eval batch, in order."""
    count = math.ceil(size / batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    return [torch.arange(i * batch_size, min((i + 1) * batch_size, size)) for i in range(count)]


def reference_eval(
    plan: Plan, batch_size: int, max_batches: int | None = None, device: torch.device | None = None
) -> dict[str, float]:
    """{"eval/loss": ..., "eval/<metric>": ...} of a `loss_fn` plan, computed in this process alone."""
    assert plan.loss_fn is not None and plan.eval_dataset is not None, "a loss_fn plan with an eval set"
    device = device or torch.device("cpu")
    model, was_training = plan.model, plan.model.training
    sums: dict[str, float] = {"loss": 0.0}
    counts: dict[str, float] = {"loss": 0.0}
    model.eval()
    try:
        with torch.no_grad():
            for indices in eval_batches(len(plan.eval_dataset), batch_size, max_batches):
                inputs, targets = plan.eval_dataset.batch(indices, device)
                outputs = model(inputs)
                n = int(indices.numel())
                sums["loss"] += float(plan.loss_fn(outputs, targets)) * n  # Python floats are float64
                counts["loss"] += n
                figures = plan.eval_metrics(outputs, (inputs, targets)) if plan.eval_metrics else {}
                for name, (total, count) in figures.items():
                    sums[name] = sums.get(name, 0.0) + float(total)
                    counts[name] = counts.get(name, 0.0) + float(count)
    finally:
        model.train(was_training)
    return {f"eval/{name}": sums[name] / counts[name] for name in sums}
