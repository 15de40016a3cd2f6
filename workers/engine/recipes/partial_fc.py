"""The `partial_fc` recipe: a data-parallel backbone with a classifier sharded across ranks.

Paddle's distributed FC for 10-million-class face recognition, and Partial FC (insightface): the
classifier weight (C x D) is too big for one device, so rank r holds rows `shard_range(C, W, r)`.
Each step every rank all-gathers the features of the whole global batch, computes the logits of its
own classes, and the softmax cross-entropy is assembled from three all-reduces: the max logit
(stability), the exp-sum (the partition function) and the target logit. With `sample_rate` < 1 only
the positive classes of the batch plus random negatives, `sample_rate * C` in all, get logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from api_schemas.recipes import PartialFcParams
from workers.engine import collectives
from workers.engine.data import TensorDataset, mix_seed
from workers.engine.recipes.plan import Plan
from workers.engine.sharding import rank_and_world, shard_range

# Generator streams, distinct from the other recipes' and the sampler's (see data.py).
_DATA_STREAM = 15
_WEIGHT_STREAM = 16
_SAMPLE_STREAM = 1 << 40

SHARDED_WEIGHT = "classifier.weight"


class _DistSoftmaxCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over class-sharded logits; backward is local (softmax minus one-hot).

    A custom backward rather than autograd through differentiable all-reduces: the gradient of a
    rank's logits needs only its own probabilities, so backward costs no collective at all.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor, world: int) -> torch.Tensor:
        # logits: (B, n) for this rank's n (sampled) classes; target: (B,) column in this rank's logits or -1.
        batch = logits.shape[0]
        neg_inf = torch.full((batch,), -math.inf, dtype=logits.dtype, device=logits.device)
        row_max = logits.max(dim=1).values if logits.shape[1] else neg_inf
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX)
        exp = torch.exp(logits - row_max[:, None])
        # [exp-sum, target logit] in one all-reduce; the target lives on exactly one rank.
        hit = target >= 0
        both = torch.zeros((2, batch), dtype=logits.dtype, device=logits.device)
        both[0] = exp.sum(dim=1)
        both[1, hit] = logits[hit, target[hit]] - row_max[hit]
        if world > 1:
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
        exp_sum, target_logit = both[0], both[1]
        ctx.save_for_backward(exp / exp_sum[:, None], target)
        return (torch.log(exp_sum) - target_logit).mean()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, target = ctx.saved_tensors
        grad = probs.clone()
        hit = target >= 0
        grad[hit, target[hit]] -= 1
        return grad * (grad_out / probs.shape[0]), None, None


class ShardedClassifier(nn.Module):
    """This rank's rows of a C x D linear classifier (no bias), with the distributed softmax loss."""

    def __init__(self, cfg: PartialFcParams, seed: int, rank: int, world_size: int) -> None:
        super().__init__()
        self.num_classes, self.sample_rate, self.seed = cfg.num_classes, cfg.sample_rate, seed
        self.rank, self.world_size = rank, world_size
        self.start, self.stop = shard_range(cfg.num_classes, world_size, rank)
        # The full weight from a private generator, then this rank's rows: the same classifier at any
        # world size, independent of the global RNG. (A 10M-class job would generate rows in chunks.)
        g = torch.Generator().manual_seed(mix_seed(seed, _WEIGHT_STREAM))
        full = torch.randn(cfg.num_classes, cfg.embedding_size, generator=g) * cfg.embedding_size**-0.5
        self.weight = nn.Parameter(full[self.start : self.stop].clone())
        # Loss evaluations so far: the negative sampler's stream, saved in checkpoints so resume continues it.
        self.sample_step: torch.Tensor
        self.register_buffer("sample_step", torch.zeros((), dtype=torch.int64))

    def _sampled_classes(self, labels: torch.Tensor) -> torch.Tensor:
        """Global class ids whose logits are computed: all of them, or the positives plus random negatives."""
        if self.sample_rate >= 1.0 or not self.training:
            return torch.arange(self.num_classes, device=labels.device)
        # One mask over all C classes from (seed, loss evaluation): every rank, at any world size, samples
        # the same classes, so sampling does not change the math between world sizes.
        g = torch.Generator().manual_seed(mix_seed(self.seed, _SAMPLE_STREAM + int(self.sample_step)))
        self.sample_step.add_(1)
        mask = torch.zeros(self.num_classes, dtype=torch.bool)
        mask[labels.cpu()] = True  # positives are always kept
        wanted = max(1, round(self.sample_rate * self.num_classes))
        need = wanted - int(mask.sum())
        if need > 0:
            perm = torch.randperm(self.num_classes, generator=g)
            mask[perm[~mask[perm]][:need]] = True
        return mask.nonzero().squeeze(1).to(labels.device)

    def loss(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the whole global batch (the same value on every rank)."""
        world = self.world_size
        if world > 1:
            # The all-gather's backward sums every rank's contribution to our features' gradient, which is
            # then d(global mean loss)/d(our features); DDP divides the backbone's gradients by the world
            # size, so scale by it here (insightface does the same) to keep the global-mean-loss gradient.
            features.register_hook(lambda g: g * world)
            features = collectives.all_gather(features)
            parts = [torch.empty_like(targets) for _ in range(world)]
            dist.all_gather(parts, targets.contiguous())
            targets = torch.cat(parts)
        sampled = self._sampled_classes(targets)
        local = sampled[(sampled >= self.start) & (sampled < self.stop)] - self.start
        weight = self.weight if local.numel() == self.weight.shape[0] else self.weight[local]
        # Column of each sample's class in this rank's logits, or -1 where the class lives elsewhere.
        column = torch.full((self.stop - self.start,), -1, dtype=torch.int64, device=targets.device)
        column[local] = torch.arange(local.numel(), device=targets.device)
        mine = (targets >= self.start) & (targets < self.stop)
        target = torch.full_like(targets, -1)
        target[mine] = column[targets[mine] - self.start]
        # At least fp32 softmax (under bf16 autocast too, as F.cross_entropy does); fp64 stays fp64.
        logits = features @ weight.t()
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        out: torch.Tensor = _DistSoftmaxCrossEntropy.apply(logits, target, world)
        return out


class PartialFcModel(nn.Module):
    """A data-parallel MLP backbone producing embeddings, plus the sharded classifier its loss uses."""

    def __init__(self, cfg: PartialFcParams, seed: int, rank: int, world_size: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(cfg.input_size, cfg.hidden_size),
            nn.ReLU(),
            nn.Linear(cfg.hidden_size, cfg.embedding_size),
        )
        self.classifier = ShardedClassifier(cfg, seed, rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings; the classifier is applied by the loss, which needs the targets."""
        out: torch.Tensor = self.backbone(x)
        return out


def build_dataset(cfg: PartialFcParams, seed: int) -> TensorDataset:
    """Gaussian inputs labelled by argmax of a random linear teacher over all classes; seed alone decides."""
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    inputs = torch.randn(cfg.dataset_size, cfg.input_size, generator=g)
    teacher = torch.randn(cfg.input_size, cfg.num_classes, generator=g)
    return TensorDataset(inputs=inputs, targets=(inputs @ teacher).argmax(dim=1))


def build(params: Mapping[str, Any], seed: int) -> Plan:
    """Recipe builder; called on every rank after the process group exists (the shard depends on the rank)."""
    cfg = PartialFcParams.model_validate(params)
    rank, world = rank_and_world()
    model = PartialFcModel(cfg, seed, rank, world)
    return Plan(
        model=model,
        dataset=build_dataset(cfg, seed),
        loss_fn=model.classifier.loss,
        sharded=(SHARDED_WEIGHT,),
    )
