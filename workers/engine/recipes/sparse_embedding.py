"""The `sparse_embedding` recipe: an EmbeddingBag with sparse gradients over Zipf-distributed ids.

Each sample is a bag of `bag_size` ids drawn from a skewed (Zipf-like) distribution over
`num_embeddings` rows, so every batch touches a subset of the table: a few popular rows often, most
rarely. The bag's mean embedding feeds a small dense MLP head; labels come from a fixed random
teacher. The table's gradient is sparse (only touched rows), synchronised by the engine's sparse sync
(`engine.sparse`), not by DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from api_schemas.recipes import SparseEmbeddingParams
from rank_contract.plan import Plan
from workers.engine.batch_sampler import TensorDataset, mix_seed
from workers.engine.recipes.eval_split import classifier_plan, eval_generator

# Stream id for the dataset generator, distinct from the other recipes' and the sampler's (batch_sampler.py).
_DATA_STREAM = 13

# Zipf exponent of the id distribution: P(rank k) ~ 1 / k**s. Fixed, so the extras stay integers.
_ZIPF_EXPONENT = 1.1


class SparseEmbeddingModel(nn.Module):
    """EmbeddingBag(mean, sparse=True) -> Linear -> ReLU -> Linear; maps ids [B, bag] to logits [B, C]."""

    def __init__(self, cfg: SparseEmbeddingParams) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(cfg.num_embeddings, cfg.embed_size, mode="mean", sparse=True)
        # Small rows (std 0.1, not torch's N(0, 1)) as embedding tables usually start: with |w| up to ~4
        # one float32 ulp is 4.8e-7, so two summation orders could already differ by the 1e-6 bound.
        nn.init.normal_(self.embedding.weight, std=0.1)
        self.head = nn.Sequential(
            nn.Linear(cfg.embed_size, cfg.hidden_size), nn.ReLU(), nn.Linear(cfg.hidden_size, cfg.num_classes)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))  # type: ignore[no-any-return]


def build_model(cfg: SparseEmbeddingParams) -> SparseEmbeddingModel:
    """The model; its table's gradient is sparse."""
    return SparseEmbeddingModel(cfg)


def build_datasets(cfg: SparseEmbeddingParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): bags of Zipf-distributed ids labelled by one random teacher; a function of the seed.

    The eval bags come from a generator of their own, so the training data does not depend on `eval_size`.
    """
    # A private generator keeps the data independent of the global RNG (and so of model-init order).
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    v = cfg.num_embeddings
    popularity = 1.0 / torch.arange(1, v + 1, dtype=torch.float64) ** _ZIPF_EXPONENT
    # Popular ids are scattered over the table, not the first rows, so rows touched are not a prefix.
    row_of_rank = torch.randperm(v, generator=g)

    def bags(n: int, generator: torch.Generator) -> torch.Tensor:
        ranks = torch.multinomial(popularity, n * cfg.bag_size, replacement=True, generator=generator)
        return row_of_rank[ranks].view(n, cfg.bag_size)

    ids = bags(cfg.dataset_size, g)
    teacher_table = torch.randn(v, cfg.embed_size, generator=g, dtype=torch.float64)
    teacher_head = torch.randn(cfg.embed_size, cfg.num_classes, generator=g, dtype=torch.float64)
    held_out = bags(cfg.eval_size, eval_generator(seed, _DATA_STREAM))

    def labelled(bag_ids: torch.Tensor) -> TensorDataset:
        targets = (teacher_table[bag_ids].mean(dim=1) @ teacher_head).argmax(dim=1)
        return TensorDataset(inputs=bag_ids, targets=targets)

    return labelled(ids), labelled(held_out)


def build_dataset(cfg: SparseEmbeddingParams, seed: int) -> TensorDataset:
    """The training split."""
    return build_datasets(cfg, seed)[0]


def build(params: Mapping[str, Any], seed: int) -> Plan:
    """Recipe builder; the caller seeds the global RNG (torch.manual_seed) before calling, for model init."""
    cfg = SparseEmbeddingParams.model_validate(params)
    train, held_out = build_datasets(cfg, seed)
    # No optimizer factory: the engine's default SGD already gives the sparse table plain SGD (sparse.py).
    return classifier_plan(build_model(cfg), train, held_out)
