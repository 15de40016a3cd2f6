"""A rank's input pipeline: which batches it reads per ITER, through which loader, and what resumes them."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from api_schemas import JobSpec
from rank_contract.data import Stream
from rank_contract.plan import Plan
from workers.engine import distributed
from workers.engine.batch_loader import (
    Batches,
    load_failure,
    loader_options,
    map_loader,
    step_batch_sampler,
    stream_loader,
)
from workers.engine.batch_sampler import GlobalBatchSampler, batch_source, mix_seed
from workers.engine.stream_batches import StreamBatches, StreamPosition

# Seeds the loaders' own generators (their processes' base seed), apart from every other stream id.
_LOADER_STREAM = 1 << 37


class InputPipeline:
    """A plan's training data for one rank: a sampler over a map-style dataset, or a stream."""

    def __init__(
        self,
        *,
        spec: JobSpec,
        plan: Plan,
        env: distributed.DistEnv,
        device: torch.device,
        local_batch_size: int,
    ) -> None:
        self.spec, self.plan, self.env, self.device = spec, plan, env, device
        self.local_batch_size = local_batch_size
        t = spec.hyperparameters
        self.stream: Stream | None = plan.dataset if isinstance(plan.dataset, Stream) else None
        # A stream's position where training (re)starts; the running one is the current loader's.
        self.position = StreamPosition()
        self._batches: Batches | None = None
        self.dataset: Any = None
        self.sampler: GlobalBatchSampler | None = None
        if self.stream is None:
            self.dataset = batch_source(plan.dataset, plan.collate_fn)
            self.sampler = GlobalBatchSampler(len(self.dataset), t.global_batch_size, t.seed)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume the data: a stream's position; nothing for map-style data."""
        if self.stream is None:
            return {}
        running = self._batches.position if self._batches is not None else None
        return {"data": {"stream": running if running is not None else self.position.state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a stream's position from a checkpoint's state."""
        if self.stream is None:
            return
        saved = state.get("data", {}).get("stream")
        if saved is None:
            raise ValueError("the checkpoint holds no stream position: it was not written by a stream plan")
        self.position = StreamPosition.from_state(saved)

    def batches(self, *, first: int, stop: int) -> Batches:
        """This rank's batches for ITER first..stop-1, through a DataLoader set up as the spec says."""
        t = self.spec.hyperparameters
        options = loader_options(self.spec.data, self.device, seed=mix_seed(t.seed, _LOADER_STREAM + first))
        rank, local = self.env.rank, self.local_batch_size
        if self.stream is not None:
            stream = StreamBatches(
                self.stream,
                seed=t.seed,
                global_batch_size=t.global_batch_size,
                rank=rank,
                local_batch_size=local,
                first=first,
                stop=stop,
                start=self.position,
                collate_fn=self.plan.collate_fn or default_collate,
                failure=load_failure,
            )
            loader = stream_loader(stream, options)
        else:
            assert self.sampler is not None
            indices = step_batch_sampler(
                self.sampler, rank=rank, local_batch_size=local, first=first, stop=stop
            )
            loader = map_loader(self.plan.dataset, self.plan.collate_fn, indices, options)
        start = self.position.state() if self.stream is not None else None
        self._batches = Batches(loader, device=self.device, rank=rank, first=first, position=start)
        return self._batches
