"""Activation checkpointing (Caffe2's memonger): recompute activations in backward instead of keeping them.

The chosen parts of the model run their forward under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
(the DDP-compatible implementation: no `static_graph` needed, parameters used inside get their gradient hooks
exactly once). Only what each checkpointed part receives as input stays saved for backward; its inner
activations are recomputed, one part at a time, when backward reaches it.

Why not torch's `checkpoint_wrapper` / `apply_activation_checkpointing`: it inserts a wrapper module, so
`named_parameters()` / `named_buffers()` gain `_checkpoint_wrapped_module.` in their names. The state_dict
hooks hide that from checkpoints, but not from everything else that goes by name (`Plan.non_data_parallel`,
DDP's ignore list, the buffer averaging). Here the module tree is left alone: a selected module only gets an
instance-level `forward` that calls its class's forward under `checkpoint`, so names, state_dict keys and
parameter objects are exactly the bare model's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from workers.engine.batchnorm import CpuSyncBatchNorm

CheckpointPolicy = Callable[[nn.Module], bool]


class _RestoreBuffers:
    """Recompute context: whatever the recomputed forward writes into buffers is undone on exit.

    BatchNorm in training mode updates its running statistics (and `num_batches_tracked`) in place on every
    forward; the recompute in backward would update them a second time. In training mode it normalises with
    the batch's own statistics, never the running ones, so restoring the buffers afterwards makes the
    recompute exact and side-effect free.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        self.buffers: list[torch.Tensor] = []
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        # Looked up now, not at construction: `.to(device)` replaces buffer tensors.
        self.buffers = [b for m in self.modules for b in m.buffers()]
        self.saved = [b.detach().clone() for b in self.buffers]

    def __exit__(self, *exc: object) -> None:
        # In place, so every alias (the trainer's averaged-buffer list, DDP's buffer broadcast) stays valid.
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved, strict=True):
                b.copy_(s)
        self.buffers, self.saved = [], []


def _context_fn(modules: Sequence[nn.Module]) -> Callable[[], tuple[Any, Any]]:
    if not any(True for m in modules for _ in m.buffers()):
        return noop_context_fn  # no buffers: nothing a recompute could change twice
    return lambda: (contextlib.nullcontext(), _RestoreBuffers(modules))


def _has_sync_batchnorm(modules: Sequence[nn.Module]) -> bool:
    # SyncBatchNorm's forward runs collectives: recomputing it would issue them inside backward, interleaved
    # with DDP's bucket allreduces. Not worth the risk for a few small conv activations: leave it stored.
    return any(isinstance(x, (nn.SyncBatchNorm, CpuSyncBatchNorm)) for m in modules for x in m.modules())


class CheckpointedForward:
    """Instance-level `forward` of a selected module: its class's forward under non-reentrant checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        # The module itself (not a bound method or closure), so copy.deepcopy rebinds it to the copy; for the
        # same reason the recompute context is built per call from self.module, never stored.
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        return checkpoint(
            forward, self.module, *args, use_reentrant=False, context_fn=_context_fn([self.module]), **kwargs
        )


class RecurrentSegments:
    """Instance-level `forward` of an nn.LSTM/GRU/RNN: the sequence in round(sqrt(T)) time chunks.

    Checkpointing a recurrent module whole would free its activations after the forward only to recompute
    all of them at once in backward: the peak would not move. A recurrence can instead run chunk by chunk,
    carrying its state: each chunk but the last is checkpointed, so backward recomputes one chunk at a time.
    The forward is bitwise the same; weight gradients are summed per chunk first, so they agree with the
    unchunked ones to float rounding (~1e-7 relative), not bitwise. Used only where chunking is exact:
    unidirectional, no inter-layer dropout, a plain tensor input (not a PackedSequence).
    """

    def __init__(self, module: nn.RNNBase) -> None:
        self.module = module

    @staticmethod
    def applies(module: nn.Module) -> bool:
        """Whether `module` is a recurrence this class can split in time exactly."""
        # Inter-layer dropout would draw its masks in a different order chunk by chunk.
        if not isinstance(module, nn.RNNBase) or module.bidirectional:
            return False
        return module.dropout == 0 or module.num_layers == 1

    def _chunk(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hx = None if not state else (state[0] if len(state) == 1 else (state[0], state[1]))
        out, h = type(self.module).forward(self.module, x, hx)
        return (out, *(h if isinstance(h, tuple) else (h,)))

    def __call__(self, x: Any, hx: Any = None) -> Any:
        ctx = _context_fn([self.module])
        if not isinstance(x, torch.Tensor):  # PackedSequence: time steps are interleaved, run it whole
            forward = type(self.module).forward
            return checkpoint(forward, self.module, x, hx, use_reentrant=False, context_fn=ctx)
        time_dim = 1 if self.module.batch_first and x.dim() == 3 else 0
        chunks = x.split(segment_size(x.shape[time_dim]), dim=time_dim)
        state: tuple[torch.Tensor, ...] = () if hx is None else (hx if isinstance(hx, tuple) else (hx,))
        outs = []
        for i, chunk in enumerate(chunks):
            if i < len(chunks) - 1:
                out, *rest = checkpoint(self._chunk, chunk, *state, use_reentrant=False, context_fn=ctx)
            else:
                out, *rest = self._chunk(chunk, *state)
            outs.append(out)
            state = tuple(rest)
        h = state[0] if len(state) == 1 else (state[0], state[1])
        return torch.cat(outs, dim=time_dim), h


class SequentialSegments:
    """Instance-level `forward` of an nn.Sequential: contiguous segments, each but the last checkpointed.

    The last segment is left alone: backward needs its activations first, so recomputing it would free
    nothing (torch's `checkpoint_sequential` does the same).
    """

    def __init__(self, model: nn.Sequential, bounds: Sequence[tuple[int, int]]) -> None:
        self.model = model
        self.bounds = list(bounds)

    def segments(self) -> list[tuple[int, int, bool]]:
        """(start, end, checkpointed) per segment; children are read now, so the list follows the model."""
        children = list(self.model)
        last = len(self.bounds) - 1
        bounds = enumerate(self.bounds)
        return [(s, e, i < last and not _has_sync_batchnorm(children[s:e])) for i, (s, e) in bounds]

    def __call__(self, x: Any) -> Any:
        children = list(self.model)
        for start, end, ckpt in self.segments():
            part = children[start:end]
            if ckpt:
                x = checkpoint(_run, part, x, use_reentrant=False, context_fn=_context_fn(part))
            else:
                x = _run(part, x)
        return x


def _run(modules: Sequence[nn.Module], x: Any) -> Any:
    for m in modules:
        x = m(x)
    return x


def segment_size(n: int) -> int:
    """Chunk length that cuts a sequence of `n` steps into about sqrt(n) chunks (the last may be shorter)."""
    return max(1, n // max(1, round(math.sqrt(n))))


def segment_bounds(n: int, segments: int | None = None) -> list[tuple[int, int]]:
    """Split `n` layers into `segments` (default round(sqrt(n))) contiguous runs; the last takes the rest.

    sqrt(n) segments of sqrt(n) layers is the classic optimum (Chen et al. 2016): the forward keeps one input
    per segment plus the last segment's activations, and backward recomputes one segment at a time.
    """
    k = segments if segments is not None else max(1, round(math.sqrt(n)))
    k = max(1, min(k, n))
    size = n // k
    starts = [i * size for i in range(k)]
    return [(s, starts[i + 1] if i + 1 < k else n) for i, s in enumerate(starts)]


def _is_applied(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, (CheckpointedForward, RecurrentSegments, SequentialSegments))


def checkpoint_activations(model: nn.Module, check_fn: CheckpointPolicy | None = None) -> list[str]:
    """Make parts of `model` recompute their activations in backward; returns what was checkpointed.

    With `check_fn` (a recipe's `Plan.checkpoint_modules`): every submodule it accepts, outermost first
    (nothing inside an accepted module is considered again), like torch's `apply_activation_checkpointing`.
    Without: an nn.Sequential is cut into round(sqrt(n)) segments (see `segment_bounds`); any other model
    has each direct child that holds parameters checkpointed. Modules containing a SyncBatchNorm are never
    checkpointed. Idempotent: a second call changes nothing and returns the same list.
    """
    if _is_applied(model):
        return checkpointed_parts(model)
    if check_fn is None and isinstance(model, nn.Sequential):
        if len(model) < 2:
            return []
        model.forward = SequentialSegments(model, segment_bounds(len(model)))  # type: ignore[method-assign]
        return checkpointed_parts(model)
    if check_fn is None:
        holders = {id(c) for c in model.children() if any(True for _ in c.parameters())}
        check_fn = lambda m: id(m) in holders  # noqa: E731
    done: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(d + ".") for d in done):
            continue
        if not _is_applied(module):
            if not check_fn(module) or _has_sync_batchnorm([module]):
                continue
            if RecurrentSegments.applies(module):
                module.forward = RecurrentSegments(cast(nn.RNNBase, module))  # type: ignore[method-assign]
            else:
                module.forward = CheckpointedForward(module)  # type: ignore[method-assign]
        done.append(name)
    return checkpointed_parts(model)


def checkpointed_parts(model: nn.Module) -> list[str]:
    """What of `model` recomputes its activations: module names, or `segment start:end` of a Sequential."""
    parts = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, SequentialSegments):
            prefix = f"{name}." if name else ""
            parts += [f"{prefix}segment {s}:{e}" for s, e, ckpt in forward.segments() if ckpt]
        elif isinstance(forward, RecurrentSegments):
            parts.append(f"{name} (in time chunks)")
        elif isinstance(forward, CheckpointedForward):
            parts.append(name)
    return parts
