"""The global-batch sampler (a pure function of seed and ITER) and the batch sources it indexes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from workers.engine.conventions import to_device

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, stream: int) -> int:
    """Derive an independent 63-bit generator seed from (seed, stream) with a splitmix64 finaliser."""
    # A plain `seed + stream` would make (seed=1, epoch=0) and (seed=0, epoch=1) share a permutation.
    z = (seed * 0x9E3779B97F4A7C15 + stream + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class TensorDataset:
    """Inputs and targets held in memory, indexed by sample number."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise ValueError(f"inputs ({self.inputs.shape[0]}) and targets ({self.targets.shape[0]}) differ")
        if self.inputs.shape[0] == 0:
            raise ValueError("dataset is empty")

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def batch(self, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the samples at `indices` onto `device`."""
        return self.inputs[indices].to(device), self.targets[indices].to(device)


class GlobalBatchSampler:
    """Global batch `it` = samples [it*B, (it+1)*B) of an endless stream of per-epoch permutations.

    The order depends only on (seed, epoch), so a batch is a pure function of ITER: resume needs no
    sampler state, and 1, 2 or 4 ranks see exactly the same global batches. Batches wrap across epoch
    boundaries (nothing is dropped), which also keeps a batch larger than the dataset well defined.
    """

    # Stream id offset so the sampler's generators never coincide with the dataset's.
    _STREAM = 1 << 32

    def __init__(self, dataset_size: int, global_batch_size: int, seed: int) -> None:
        if dataset_size < 1 or global_batch_size < 1:
            raise ValueError(f"bad sampler sizes: dataset {dataset_size}, batch {global_batch_size}")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of one epoch."""
        perm = self._cache.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(mix_seed(self.seed, self._STREAM + epoch))
            perm = torch.randperm(self.dataset_size, generator=g)
            # Batches only move forward, so two cached epochs (current + the one a batch spills into) suffice.
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm

    def global_indices(self, it: int) -> torch.Tensor:
        """Sample indices of global batch `it` (0-based ITER)."""
        if it < 0:
            raise ValueError(f"iteration must be >= 0, got {it}")
        pos, remaining = it * self.global_batch_size, self.global_batch_size
        parts = []
        while remaining:
            epoch, offset = divmod(pos, self.dataset_size)
            take = min(remaining, self.dataset_size - offset)
            parts.append(self.permutation(epoch)[offset : offset + take])
            pos, remaining = pos + take, remaining - take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def local_indices(self, it: int, rank: int, local: int) -> torch.Tensor:
        """Rank `rank`'s contiguous slice [r*local, (r+1)*local) of global batch `it` (local = B/W)."""
        return self.global_indices(it)[rank * local : (rank + 1) * local]


class MapDataset:
    """Adapts a map-style dataset (items: tensors, tuples or dicts of them) to `batch(indices, device)`."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices: torch.Tensor, device: torch.device) -> Any:
        """The items at `indices`, collated (the plan's collate_fn or default_collate), moved to `device`."""
        return to_device(self.collate_fn([self.dataset[int(i)] for i in indices]), device)


def batch_source(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> Any:
    """The dataset itself if it gathers its own batches (`batch(indices, device)`), else a MapDataset."""
    return dataset if hasattr(dataset, "batch") else MapDataset(dataset, collate_fn)
