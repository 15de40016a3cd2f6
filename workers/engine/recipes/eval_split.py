"""What the built-in recipes share for evaluation: the eval split's generator and argmax accuracy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rank_contract.plan import EvalFigures, Plan
from workers.engine.batch_sampler import mix_seed

# Added to a recipe's data stream id to seed its eval split: a generator of its own, so drawing the
# eval samples never moves the training stream (a seed gives the same training data whatever
# `eval_size` is). Far from every other stream id: the recipes' (< 100), the sampler's (2**32 + epoch)
# and partial_fc's negative sampler's (2**40 + loss evaluation).
EVAL_STREAM_OFFSET = 1 << 48


def eval_generator(seed: int, data_stream: int) -> torch.Generator:
    """The generator of a recipe's held-out samples, independent of its training stream."""
    return torch.Generator().manual_seed(mix_seed(seed, EVAL_STREAM_OFFSET + data_stream))


def argmax_accuracy(outputs: torch.Tensor, batch: Any) -> EvalFigures:
    """{"accuracy": (correct, count)}: argmax of the last dim against every target (a sample or a token)."""
    _, targets = batch
    # The sum stays on the device: the engine adds it up without a host sync per batch.
    correct = (outputs.argmax(dim=-1) == targets).sum()
    return {"accuracy": (correct, targets.numel())}


def classifier_plan(model: nn.Module, train: Any, held_out: Any) -> Plan:
    """The Plan of a built-in classifier: mean cross entropy, its eval split and `eval/accuracy`."""
    return Plan(
        model=model,
        dataset=train,
        loss_fn=nn.functional.cross_entropy,
        eval_dataset=held_out,
        eval_metrics=argmax_accuracy,
    )
