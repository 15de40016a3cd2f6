"""Batches through torch's DataLoader: the engine's indices per ITER, loader processes, pinned memory.

The batch sampler yields exactly the rank's local indices of each ITER (data.GlobalBatchSampler), so
the global batches stay a pure function of (seed, ITER) at any world size and any `num_workers`, and
a resume needs no loader state: the loader starts again at the resumed ITER. A stream
(streams.StreamBatches) carries its position along with each batch instead.

A dataset that gathers its own batches (`batch(indices, device)`: the recipes' in-memory tensors, a
TokenFile) is asked for a whole batch at once through DataLoader's `__getitems__`; anything else is
read item by item and collated (the plan's collate_fn or default_collate). A failed read is sent back
as a `LoadFailure` rather than raised in the loader process, where torch would flatten it into text:
the rank then raises a `DataLoadError` naming itself, the step and the sample.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from api_schemas.data import DataSpec
from rank_contract.failures import Failure, named
from workers.engine.batch_sampler import GlobalBatchSampler
from workers.engine.conventions import to_device
from workers.engine.loader_faults import LoaderWatch, failed_loader
from workers.engine.stream_batches import StreamBatch, StreamBatches

CPU = torch.device("cpu")


@dataclass(frozen=True)
class LoadFailure:
    """What a loader sends instead of a batch when reading failed (plain strings: it crosses processes)."""

    where: str  # "sample 17", "samples 0, 5, 9", "shard 'a.jsonl'"
    error: str  # "ValueError: boom"
    traceback: str
    io: bool  # an OSError: the storage, perhaps for a moment, rather than the data or the code


def load_failure(where: str, exc: BaseException) -> LoadFailure:
    """A LoadFailure for `exc`, raised while reading `where`."""
    tb = "".join(traceback.format_exception(exc)[-8:])
    return LoadFailure(where, f"{type(exc).__name__}: {exc}", tb, isinstance(exc, OSError))


@named(Failure.DATA_LOAD_ERROR)
class DataLoadError(RuntimeError):
    """Reading a sample failed (the dataset's code or the data): names the rank, the step and the sample.

    Not retried: a restart would read the same sample again (workers/attempt/end.py)."""


@named(Failure.DATA_READ_ERROR)
class DataReadError(DataLoadError):
    """Reading a sample failed with an OSError (storage): retried while the job has restarts left."""


class _Fetch:
    """The plan's dataset as DataLoader sees it: a batch per `__getitems__(indices)`, or a LoadFailure."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.gathers = hasattr(dataset, "batch")
        self.collate_fn = collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> Any:
        if self.gathers:
            try:
                return self.dataset.batch(torch.tensor(indices, dtype=torch.long), CPU)
            except Exception as exc:
                # The dataset may name the sample in its message (TokenFile does); else name them all.
                shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
                return load_failure(f"samples {shown}", exc)
        items = []
        for i in indices:
            try:
                items.append(self.dataset[i])
            except Exception as exc:
                return load_failure(f"sample {i}", exc)
        try:
            return self.collate_fn(items)
        except Exception as exc:
            return load_failure(f"the collate_fn over samples {indices[0]}..", exc)


def _as_is(batch: Any) -> Any:
    # The collate step of DataLoader: batches are whole when `_Fetch` or the stream hands them over.
    return batch


# Batch samplers yield plain lists: a tensor would go to a loader process through shared memory (an
# extra round trip per batch), and a slice of the epoch's cached order would take the whole order along.


class _StepIndices(Sampler[list[int]]):
    """The rank's local indices of ITER first..stop-1, one batch per ITER (DataLoader's batch_sampler)."""

    def __init__(
        self, sampler: GlobalBatchSampler, rank: int, local_batch_size: int, first: int, stop: int
    ) -> None:
        self.sampler, self.rank, self.local, self.first, self.stop = (
            sampler,
            rank,
            local_batch_size,
            first,
            stop,
        )

    def __iter__(self) -> Iterator[list[int]]:
        for it in range(self.first, self.stop):
            yield self.sampler.local_indices(it, self.rank, self.local).tolist()

    def __len__(self) -> int:
        return max(0, self.stop - self.first)


class _FixedBatches(Sampler[list[int]]):
    """The same list of index batches on every pass (an evaluation's)."""

    def __init__(self, batches: Sequence[torch.Tensor]) -> None:
        self.batches = [b.tolist() for b in batches]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def loader_options(
    data: DataSpec, device: torch.device, *, seed: int, persistent: bool = False
) -> dict[str, Any]:
    """DataLoader's keyword arguments for the spec's `data` (the spec refused what torch would)."""
    opts: dict[str, Any] = {
        "num_workers": data.num_workers,
        "pin_memory": data.pinned(device.type),
        "collate_fn": _as_is,
        # Each iterator draws its processes' base seed from this generator, else from the global RNG:
        # that draw would shift dropout's masks after a resume and break bitwise-equal resumes.
        "generator": torch.Generator().manual_seed(seed),
    }
    if data.num_workers:
        if data.prefetch_factor is not None:
            opts["prefetch_factor"] = data.prefetch_factor
        opts["persistent_workers"] = persistent and data.persistent_workers
        # A loader process that dies or cannot send its batch fails the rank at once (loader_faults);
        # the timeout bounds the wait for one that lives on but sends nothing.
        opts["worker_init_fn"] = LoaderWatch()
        opts["timeout"] = float(data.loader_timeout_seconds)
    return opts


def map_loader(
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any] | None,
    batches: Sampler[list[int]],
    options: dict[str, Any],
) -> DataLoader[Any]:
    """A DataLoader reading `dataset` (map-style) in the index batches `batches` yields."""
    return DataLoader(_Fetch(dataset, collate_fn), batch_sampler=batches, **options)  # type: ignore[arg-type]


def step_batch_sampler(
    sampler: GlobalBatchSampler, *, rank: int, local_batch_size: int, first: int, stop: int
) -> Sampler[list[int]]:
    """The batch sampler for training steps first..stop-1 on `rank`."""
    return _StepIndices(sampler, rank, local_batch_size, first, stop)


def fixed_batch_sampler(batches: Sequence[torch.Tensor]) -> Sampler[list[int]]:
    """A batch sampler that yields `batches` on every pass."""
    return _FixedBatches(batches)


def stream_loader(batches: StreamBatches, options: dict[str, Any]) -> DataLoader[Any]:
    """A DataLoader over a stream's batches (each already collated, with its position)."""
    return DataLoader(batches, batch_size=None, **options)


class Batches:
    """The rank's batches on the device, in order, one fetched ahead; counts the time spent waiting.

    `take()` hands out the next batch; `prefetch()`, called once a step's work is queued, fetches the
    one after it and queues its copy to the device (non-blocking from pinned memory), so on a GPU the
    host's wait for data and the copy overlap the step still running there. With loader processes
    the batches are prepared ahead in those processes anyway (prefetch_factor per process).
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        device: torch.device,
        rank: int,
        first: int,
        every: int = 1,
        label: str = "step",
        position: dict[str, int] | None = None,
    ) -> None:
        self.loader, self.device, self.rank, self.label = loader, device, rank, label
        # The ITER (an evaluation: the eval batch) of the next batch the loader gives, and the stride.
        self.step, self.every = first, every
        self.waited = 0.0  # seconds spent waiting for the loader, since the last `take_waited()`
        # A stream's position after the last batch taken (before any: where it starts); None otherwise.
        self.position = position
        self._it: Iterator[Any] | None = iter(loader)
        self._ahead: tuple[Any, dict[str, int] | None] | None = None

    def _fetch(self) -> tuple[Any, dict[str, int] | None]:
        assert self._it is not None, "the loader is closed"
        start = time.perf_counter()
        try:
            item = next(self._it)
        except StopIteration:
            raise
        except Exception as exc:
            during = f"waiting for the batch of {self.label} {self.step}"
            failure = failed_loader(exc, self.loader, self._it, rank=self.rank, during=during)
            if failure is None:
                raise
            raise failure from exc
        self.waited += time.perf_counter() - start
        if isinstance(item, LoadFailure):
            what = f"{item.where} for {self.label} {self.step}"
            print(f"loading {what} failed on rank {self.rank}:\n{item.traceback}")
            kind = DataReadError if item.io else DataLoadError
            raise kind(f"rank {self.rank}: reading {what} failed: {item.error}")
        position = None
        if isinstance(item, StreamBatch):
            item, position = item.batch, item.position
        self.step += self.every
        return to_device(item, self.device), position

    def take(self) -> Any:
        """The next batch, on the device."""
        ahead, self._ahead = self._ahead, None
        batch, position = ahead if ahead is not None else self._fetch()
        if position is not None:
            self.position = position
        return batch

    def prefetch(self) -> None:
        """Fetch the next batch now, if there is one left."""
        if self._ahead is None and self._it is not None:
            try:
                self._ahead = self._fetch()
            except StopIteration:
                self._ahead = None

    def take_waited(self) -> float:
        """Seconds waited for data since the last call."""
        waited, self.waited = self.waited, 0.0
        return waited

    def close(self) -> None:
        """Stop the loader's processes now (not when garbage collection gets to the iterator).

        Persistent ones stay: their DataLoader reuses them for its next pass (the evaluator ends them).
        """
        it, self._it, self._ahead = self._it, None, None
        if not getattr(self.loader, "persistent_workers", False):
            shutdown_workers(it)


def shutdown_workers(iterator: Any) -> None:
    """End a DataLoader iterator's processes now (a no-op for an iterator without any)."""
    # torch's own shutdown (what the iterator's __del__ calls): joins or terminates the workers.
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
