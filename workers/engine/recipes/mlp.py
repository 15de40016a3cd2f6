"""The `mlp` recipe: a small MLP classifier on synthetic data labelled by a fixed random linear teacher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from api_schemas.recipes import MlpParams
from rank_contract.plan import BuildContext, Plan
from workers.engine.batch_sampler import TensorDataset, mix_seed
from workers.engine.recipes.eval_split import classifier_plan, eval_generator

# Stream id for the dataset generator, distinct from the sampler's streams (see batch_sampler.py).
_DATA_STREAM = 7


def build_model(cfg: MlpParams) -> nn.Sequential:
    """`num_layers` hidden Linear+ReLU layers followed by a Linear classifier head."""
    layers: list[nn.Module] = []
    width = cfg.input_size
    for _ in range(cfg.num_layers):
        layers += [nn.Linear(width, cfg.hidden_size), nn.ReLU()]
        width = cfg.hidden_size
    layers.append(nn.Linear(width, cfg.num_classes))
    return nn.Sequential(*layers)


def build_datasets(cfg: MlpParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): Gaussian inputs labelled by argmax of one random linear teacher; a function of the seed.

    The eval inputs come from a generator of their own, so the training data does not depend on `eval_size`.
    """
    # A private generator keeps the data independent of the global RNG (and so of model-init order).
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    inputs = torch.randn(cfg.dataset_size, cfg.input_size, generator=g, dtype=torch.float32)
    teacher = torch.randn(cfg.input_size, cfg.num_classes, generator=g, dtype=torch.float32)
    held_out = torch.randn(
        cfg.eval_size, cfg.input_size, generator=eval_generator(seed, _DATA_STREAM), dtype=torch.float32
    )
    return (
        TensorDataset(inputs=inputs, targets=(inputs @ teacher).argmax(dim=1)),
        TensorDataset(inputs=held_out, targets=(held_out @ teacher).argmax(dim=1)),
    )


def build_dataset(cfg: MlpParams, seed: int) -> TensorDataset:
    """The training split."""
    return build_datasets(cfg, seed)[0]


class ShardPairs:
    """A `Shards` directory as (inputs, targets) samples: tuples, or dicts with those two keys."""

    def __init__(self, shards: Any, cfg: MlpParams, split: str) -> None:
        self.shards = shards
        inputs, targets = self[0]
        if inputs.shape != (cfg.input_size,) or not inputs.is_floating_point():
            raise ValueError(
                f"data.{split}: inputs of sample 0 are {inputs.dtype} {tuple(inputs.shape)}, expected floats "
                f"of shape ({cfg.input_size},) (input_size)"
            )
        if targets.dim() != 0 or targets.is_floating_point() or not 0 <= int(targets) < cfg.num_classes:
            raise ValueError(
                f"data.{split}: the target of sample 0 must be one integer class in [0, {cfg.num_classes})"
            )

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.shards[index]
        if isinstance(item, dict):
            return item["inputs"], item["targets"]
        inputs, targets = item
        return inputs, targets


def build(params: Mapping[str, Any], seed: int, ctx: BuildContext | None = None) -> Plan:
    """Recipe builder; the caller seeds the global RNG (torch.manual_seed) before calling, for model init.

    With `data.train: {kind: shards}` (and `data.eval` to evaluate) it trains from those samples.
    """
    cfg = MlpParams.model_validate(params)
    files = ctx.data if ctx is not None else {}
    if "train" in files:
        pairs = ShardPairs(files["eval"], cfg, "eval") if "eval" in files else None
        return classifier_plan(build_model(cfg), ShardPairs(files["train"], cfg, "train"), pairs)
    train, held_out = build_datasets(cfg, seed)
    return classifier_plan(build_model(cfg), train, held_out)
