"""What a recipe hands the trainer: a model, a dataset and a loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.engine.data import TensorDataset


@dataclass
class Plan:
    """A built recipe. `loss_fn(outputs, targets)` must return the MEAN loss over the local batch."""

    model: nn.Module
    dataset: TensorDataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
