"""A Stream's batches (`dptrain.data.Stream`): read in one global order, cut into the engine's global batches.

The order is a function of the seed alone: epoch e reads the shards in a permutation drawn from
(seed, e) (or as given, without `shuffle`), each shard's samples in the reader's order. Global batch
`it` is samples [it*B, (it+1)*B) of that sequence and rank r keeps the contiguous slice
[r*B/W, (r+1)*B/W) of it, exactly as the map-style sampler splits a batch, so 1, 2 or 4 ranks see the
same global batches. A stream has no index to jump to, so every rank (and every loader process) reads
the whole sequence and transforms only what it keeps; the position after each batch (epoch, shard,
samples of it read) rides along with the batch, so a checkpoint records where the next step's data
starts, and a resume opens that shard and skips only within it.

Hand-written because torch's IterableDataset leaves ordering, splitting across ranks and workers,
and resuming entirely to the dataset; torchdata's stateful loaders split by worker and rank, which
makes the global order depend on the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from rank_contract.data import Stream
from workers.engine.batch_sampler import mix_seed

# Stream id of the shard-order generators: apart from the sampler's (1<<32 + epoch) and the recipes'.
_SHARD_ORDER_STREAM = 1 << 36


@dataclass(frozen=True)
class StreamPosition:
    """Where the next global sample of a stream comes from: its index and (epoch, shard, offset)."""

    sample: int = 0  # global index of the next sample: ITER * global batch size at a step boundary
    epoch: int = 0
    shard: int = 0  # index into the epoch's shard order
    offset: int = 0  # samples of that shard already read

    def state(self) -> dict[str, int]:
        """As stored in a checkpoint (plain ints: weights_only-safe)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamPosition:
        """The inverse of `state()`."""
        return cls(**{k: int(state[k]) for k in ("sample", "epoch", "shard", "offset")})


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order epoch `epoch` reads the `n` shards in."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(mix_seed(seed, _SHARD_ORDER_STREAM + epoch))
    return torch.randperm(n, generator=g).tolist()


class StreamFailure(Exception):
    """Reading or transforming a stream sample failed: `where` names it, `cause` is the original."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.where, self.cause = where, cause


def samples(stream: Stream, seed: int, start: StreamPosition) -> Iterator[tuple[Any, StreamPosition]]:
    """Every sample from `start` on, each with the position after it (endless: epoch after epoch)."""
    n = len(stream.shards)
    g, epoch, k, skip = start.sample, start.epoch, start.shard, start.offset
    read_in_epoch = skip > 0 or k > 0  # an epoch entered midway proves nothing about emptiness
    while True:
        order = shard_order(n, seed, epoch, stream.shuffle)
        while k < n:
            shard = stream.shards[order[k]]
            try:
                it = iter(stream.read(shard))
            except Exception as exc:
                raise StreamFailure(f"shard {shard!r}", exc) from exc
            offset = 0
            while True:
                try:
                    raw = next(it)
                except StopIteration:
                    break
                except Exception as exc:
                    raise StreamFailure(f"shard {shard!r} after {offset} samples (sample {g})", exc) from exc
                offset += 1
                if offset <= skip:
                    continue  # read before the position we resumed at
                g += 1
                read_in_epoch = True
                yield raw, StreamPosition(g, epoch, k, offset)
            if offset < skip:
                raise ValueError(
                    f"shard {shard!r} now has {offset} samples, but the checkpoint's position is past {skip} "
                    "of them: the stream must read the same samples every time"
                )
            k, skip = k + 1, 0
        if not read_in_epoch:
            raise ValueError(f"the stream's {n} shards hold no samples")
        epoch, k, read_in_epoch = epoch + 1, 0, False


@dataclass(frozen=True)
class StreamBatch:
    """A rank's batch of a stream and the stream's position after that global batch."""

    batch: Any
    position: dict[str, int]


class StreamBatches(IterableDataset):  # type: ignore[type-arg]
    """This rank's batches of global batches `first`..`stop - 1`, for a DataLoader (batch_size=None).

    Loader process k of n produces the batches it with (it - first) % n == k; torch's DataLoader
    returns its processes' outputs round robin, so they arrive in ITER order. A failure is yielded,
    not raised (see batch_loader.LoadFailure), so the rank can name the sample.
    """

    def __init__(
        self,
        stream: Stream,
        *,
        seed: int,
        global_batch_size: int,
        rank: int,
        local_batch_size: int,
        first: int,
        stop: int,
        start: StreamPosition,
        collate_fn: Callable[[list[Any]], Any],
        failure: Callable[[str, BaseException], Any],
    ) -> None:
        if start.sample != first * global_batch_size:
            raise ValueError(
                f"stream position at sample {start.sample}, but step {first} starts at sample "
                f"{first * global_batch_size}"
            )
        self.stream, self.seed, self.global_batch_size = stream, seed, global_batch_size
        self.rank, self.local, self.first, self.stop, self.start = rank, local_batch_size, first, stop, start
        self.collate_fn, self.failure = collate_fn, failure

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        lo, hi = self.rank * self.local, (self.rank + 1) * self.local
        transform = self.stream.transform
        source = samples(self.stream, self.seed, self.start)
        for it in range(self.first, self.stop):
            mine = (it - self.first) % workers == worker
            kept: list[Any] = []
            try:
                for j in range(self.global_batch_size):
                    raw, position = next(source)
                    if mine and lo <= j < hi:
                        kept.append(_transformed(transform, raw, position.sample - 1))
                if mine:
                    yield StreamBatch(self.collate_fn(kept), position.state())
            except StreamFailure as exc:
                yield self.failure(exc.where, exc.cause)
                return
            except Exception as exc:  # the collate
                yield self.failure(f"the batch of step {it}", exc)
                return


def _transformed(transform: Callable[[Any], Any] | None, raw: Any, index: int) -> Any:
    if transform is None:
        return raw
    try:
        return transform(raw)
    except Exception as exc:
        raise StreamFailure(f"sample {index}", exc) from exc
