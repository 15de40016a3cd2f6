"""The `cnn_bn` recipe: a small conv net with BatchNorm on synthetic images labelled by a random teacher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from api_schemas.recipes import CnnBnParams
from rank_contract.plan import Plan
from workers.engine.batch_sampler import TensorDataset, mix_seed
from workers.engine.recipes.eval_split import classifier_plan, eval_generator

# Stream id for the dataset generator, distinct from mlp's and the sampler's streams (see batch_sampler.py).
_DATA_STREAM = 11


def build_model(cfg: CnnBnParams) -> nn.Sequential:
    """Conv-BN-ReLU twice, global average pool, Linear head; the BatchNorms are what this recipe exercises."""
    return nn.Sequential(
        # No conv bias: the following BatchNorm subtracts the mean and would cancel it.
        nn.Conv2d(cfg.channels, 8, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, cfg.num_classes),
    )


def build_datasets(cfg: CnnBnParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): Gaussian images labelled by argmax of one random linear teacher; a function of the seed.

    The eval images come from a generator of their own, so the training data does not depend on `eval_size`.
    """
    # A private generator keeps the data independent of the global RNG (and so of model-init order).
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    # A non-zero mean and scale per channel give the BatchNorm running stats something to track.
    offset = torch.randn(1, cfg.channels, 1, 1, generator=g) * 2
    scale = torch.rand(1, cfg.channels, 1, 1, generator=g) + 0.5
    images = torch.randn((cfg.dataset_size, *shape), generator=g, dtype=torch.float32)
    teacher = torch.randn(cfg.channels * cfg.image_size**2, cfg.num_classes, generator=g, dtype=torch.float32)
    held_out = torch.randn(
        (cfg.eval_size, *shape), generator=eval_generator(seed, _DATA_STREAM), dtype=torch.float32
    )

    def labelled(raw: torch.Tensor) -> TensorDataset:
        # The teacher labels the images before the channel offset and scale.
        return TensorDataset(inputs=raw * scale + offset, targets=(raw.flatten(1) @ teacher).argmax(dim=1))

    return labelled(images), labelled(held_out)


def build_dataset(cfg: CnnBnParams, seed: int) -> TensorDataset:
    """The training split."""
    return build_datasets(cfg, seed)[0]


def build(params: Mapping[str, Any], seed: int) -> Plan:
    """Recipe builder; the caller seeds the global RNG (torch.manual_seed) before calling, for model init."""
    cfg = CnnBnParams.model_validate(params)
    train, held_out = build_datasets(cfg, seed)
    # Eval runs the model in eval mode: the BatchNorms use their running statistics.
    return classifier_plan(build_model(cfg), train, held_out)
