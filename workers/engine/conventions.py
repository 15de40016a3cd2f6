"""How the engine calls user code: builders, optimizer factories, batches and the two loss conventions.

Every form a Plan may take is decided here, once, so the trainer and the evaluation share one reading
of it (docs/engine.md, "Calling conventions").
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rank_contract.plan import BuildContext, OptimizerFactory, Plan


def _positional(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume the classic form
        return [], False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, any(p.kind is p.VAR_POSITIONAL for p in params)


def takes_context(builder: Callable[..., Any]) -> bool:
    """Whether `builder(hyperparameters, seed, ctx)`: it has a third positional parameter (or *args)."""
    positional, varargs = _positional(builder)
    return varargs or len(positional) >= 3


def build_plan(builder: Callable[..., Any], params: Mapping[str, Any], seed: int, ctx: BuildContext) -> Plan:
    """Call a recipe's or entrypoint's builder in the form it takes; check that it returned a Plan."""
    plan = builder(params, seed, ctx) if takes_context(builder) else builder(params, seed)
    if not isinstance(plan, Plan):
        raise TypeError(f"the builder returned {type(plan).__name__}, not a dptrain.Plan")
    return plan


def wants_model(factory: Callable[..., Any]) -> bool:
    """Whether an optimizer factory takes the model: its first parameter is named `model` or is
    annotated as an nn.Module (a name, not a type check, because the factory is only called once)."""
    positional, _ = _positional(factory)
    if not positional:
        return False
    first = positional[0]
    if first.name == "model":
        return True
    annotation = first.annotation
    if isinstance(annotation, str):  # `from __future__ import annotations`: resolve if we can
        try:
            annotation = typing.get_type_hints(factory).get(first.name, annotation)
        except Exception:  # an unresolvable forward reference: fall back to the name
            return annotation.rsplit(".", 1)[-1] == "Module"
    return inspect.isclass(annotation) and issubclass(annotation, nn.Module)


def make_optimizer(factory: OptimizerFactory, model: nn.Module) -> torch.optim.Optimizer:
    """`factory(model)` or `factory(model.parameters())`, as `wants_model` reads the factory."""
    optimizer = factory(model) if wants_model(factory) else factory(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the plan's optimizer factory returned {type(optimizer).__name__}, not an Optimizer")
    return optimizer


# ---- batches: a tensor, or tuples, lists and dicts of them ----------------------------------------------


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor in it on `device` (non-tensor leaves are left as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def batch_size(batch: Any) -> int:
    """Samples in a batch: the common first dimension of its tensors (ValueError if they disagree)."""
    sizes = {int(t.shape[0]) for t in _tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"a batch's tensors must share their first (sample) dimension; found {sorted(sizes) or 'none'}"
        )
    return sizes.pop()


def split_batch(batch: Any, n: int) -> list[Any]:
    """`n` equal micro-batches along the sample dimension (gradient accumulation)."""
    if n == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(n)) if batch.dim() > 0 else [batch] * n
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, n) for k, v in batch.items()}
        return [type(batch)({k: p[i] for k, p in parts.items()}) for i in range(n)]  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        columns = [split_batch(v, n) for v in batch]
        rows = [[c[i] for c in columns] for i in range(n)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return [type(batch)(*r) for r in rows]
        return [type(batch)(r) for r in rows]
    return [batch] * n


# ---- the loss ---------------------------------------------------------------------------------------------


def pair(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a `loss_fn` plan's batch, or a clear error."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        "a plan with loss_fn(outputs, targets) needs (inputs, targets) batches; got "
        f"{type(batch).__name__}: use compute_loss(model, batch) for other batch shapes"
    )


def loss_and_outputs(plan: Plan, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
    """The batch's mean loss, and what `eval_metrics` gets: the outputs (loss_fn) or the model."""
    if plan.compute_loss is not None:
        return plan.compute_loss(model, batch), model
    assert plan.loss_fn is not None  # a Plan has exactly one of the two
    inputs, targets = pair(batch)
    outputs = model(inputs)
    return plan.loss_fn(outputs, targets), outputs


def check_loss(loss: Any) -> torch.Tensor:
    """The loss a step returned, if it is a scalar tensor that backward can start from."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"the loss must be a scalar tensor (the batch's mean loss), got {shape}")
    return loss if loss.dim() == 0 else loss.reshape(())
