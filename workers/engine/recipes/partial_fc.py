"""The `partial_fc` recipe: a data-parallel backbone with a classifier sharded across ranks.

Paddle's distributed FC for 10-million-class face recognition, and Partial FC (insightface): the
classifier weight (C x D) is too big for one device, so rank r holds rows `shard_range(C, W, r)`.
Each step every rank all-gathers the features of the whole global batch, computes the logits of its
own classes, and the softmax cross-entropy is assembled from three all-reduces: the max logit
(stability), the exp-sum (the partition function) and the target logit. With `sample_rate` < 1 only
the positive classes of the batch plus random negatives, `sample_rate * C` in all, get logits.

Evaluation (model in eval mode) scores every class and lets the ranks' batches differ in size, down to
none at all: the engine's last eval round gives some ranks a shorter batch or an empty one, and every
rank must still join the collectives.
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
from rank_contract.plan import EvalFigures, Plan
from workers.engine import collectives
from workers.engine.batch_sampler import TensorDataset, mix_seed
from workers.engine.recipes.eval_split import eval_generator
from workers.engine.sharded_params import rank_and_world, shard_range

# Generator streams, distinct from the other recipes' and the sampler's (see batch_sampler.py).
_DATA_STREAM = 15
_WEIGHT_STREAM = 16
_SAMPLE_STREAM = 1 << 40

SHARDED_WEIGHT = "classifier.weight"


def _softmax_terms(
    logits: torch.Tensor, target: torch.Tensor, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row over every rank's classes: exp(logit - max) of ours, the exp-sum, and the target's logit - max.

    logits: (B, n) for this rank's n (sampled) classes; target: (B,) column in this rank's logits or -1.
    """
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
    return exp, both[0], both[1]


class _DistSoftmaxCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over class-sharded logits; backward is local (softmax minus one-hot).

    A custom backward rather than autograd through differentiable all-reduces: the gradient of a
    rank's logits needs only its own probabilities, so backward costs no collective at all.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor, world: int) -> torch.Tensor:
        exp, exp_sum, target_logit = _softmax_terms(logits, target, world)
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
        if self.sample_rate >= 1.0:
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
        """Training: mean cross-entropy over the whole global batch (the same value on every rank).

        In eval mode: the mean over this rank's own samples (see `_eval_loss`).
        """
        if not self.training:
            return self._eval_loss(features, targets)
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

    # ---- evaluation: every class, batches of any size per rank, no backward ---------------------------

    def _gather_round(
        self, features: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """Every rank's eval features and targets, in rank order, and where this rank's lie among them.

        Not `collectives.all_gather`, which needs one shape on every rank: here the sizes are exchanged
        first and each rank's part padded to the largest. One host sync per eval batch is fine for eval.
        """
        n = targets.shape[0]
        if self.world_size == 1:
            return features, targets, slice(0, n)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=targets.device)
        sizes[self.rank] = n
        dist.all_reduce(sizes)
        counts = [int(c) for c in sizes.tolist()]
        start = sum(counts[: self.rank])

        def gather(x: torch.Tensor) -> torch.Tensor:
            padded = x.new_zeros((max(counts), *x.shape[1:]))
            padded[:n] = x
            parts = [torch.empty_like(padded) for _ in counts]
            dist.all_gather(parts, padded)
            return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

        return gather(features.contiguous()), gather(targets.contiguous()), slice(start, start + n)

    def _eval_logits(
        self, features: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """This rank's classes' logits for every rank's eval samples, their targets, and our samples' rows."""
        features, targets, mine = self._gather_round(features, targets)
        logits = features @ self.weight.t()
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), targets, mine

    def _eval_loss(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all classes of this rank's own eval samples; 0 for an empty batch.

        Unlike training's global-batch mean, the mean over the batch this rank was given: the engine
        adds `loss * samples` per rank, and in eval the ranks' batch sizes differ.
        """
        logits, all_targets, mine = self._eval_logits(features, targets)
        ours = (all_targets >= self.start) & (all_targets < self.stop)
        column = torch.where(ours, all_targets - self.start, torch.full_like(all_targets, -1))
        _, exp_sum, target_logit = _softmax_terms(logits, column, self.world_size)
        nll = (torch.log(exp_sum) - target_logit)[mine]
        return nll.sum() / max(nll.numel(), 1)

    def accuracy(self, features: torch.Tensor, batch: Any) -> EvalFigures:
        """{"accuracy": (correct, samples)} of this rank's eval samples; argmax over all ranks' classes."""
        _, targets = batch
        logits, _, mine = self._eval_logits(features, targets)
        if logits.shape[1]:
            best, column = logits.max(dim=1)
        else:  # a rank with no classes (more ranks than classes) never holds the max
            best = torch.full((logits.shape[0],), -math.inf, dtype=logits.dtype, device=logits.device)
            column = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        predicted = column + self.start
        if self.world_size > 1:
            # As torch.argmax over the whole row, the first of equal maxima wins: each rank offers its
            # first max (max(dim) picks the first too), and the lowest class id among the ranks that
            # hold the global max is the answer (shards are in class order).
            top = best.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            predicted = torch.where(best == top, predicted, torch.full_like(predicted, self.num_classes))
            dist.all_reduce(predicted, op=dist.ReduceOp.MIN)
        return {"accuracy": ((predicted[mine] == targets).sum(), targets.numel())}


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


def build_datasets(cfg: PartialFcParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): Gaussian inputs labelled by argmax of one random teacher over all classes.

    The eval inputs come from a generator of their own, so the training data does not depend on `eval_size`.
    """
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    inputs = torch.randn(cfg.dataset_size, cfg.input_size, generator=g)
    teacher = torch.randn(cfg.input_size, cfg.num_classes, generator=g)
    held_out = torch.randn(cfg.eval_size, cfg.input_size, generator=eval_generator(seed, _DATA_STREAM))
    return (
        TensorDataset(inputs=inputs, targets=(inputs @ teacher).argmax(dim=1)),
        TensorDataset(inputs=held_out, targets=(held_out @ teacher).argmax(dim=1)),
    )


def build_dataset(cfg: PartialFcParams, seed: int) -> TensorDataset:
    """The training split."""
    return build_datasets(cfg, seed)[0]


def build(params: Mapping[str, Any], seed: int) -> Plan:
    """Recipe builder; called on every rank after the process group exists (the shard depends on the rank)."""
    cfg = PartialFcParams.model_validate(params)
    rank, world = rank_and_world()
    model = PartialFcModel(cfg, seed, rank, world)
    train, held_out = build_datasets(cfg, seed)
    return Plan(
        model=model,
        dataset=train,
        loss_fn=model.classifier.loss,
        eval_dataset=held_out,
        eval_metrics=model.classifier.accuracy,
        sharded=(SHARDED_WEIGHT,),
    )
