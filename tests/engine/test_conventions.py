"""The calling conventions, read once (workers/engine/conventions.py), and the non-finite guard."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from dptrain import BuildContext, Plan
from workers.engine.conventions import (
    batch_size,
    build_plan,
    loss_and_outputs,
    make_optimizer,
    split_batch,
    takes_context,
    to_device,
    wants_model,
)
from workers.engine.distributed import DistEnv
from workers.engine.nonfinite import NonFiniteGuard

CTX = BuildContext(device=torch.device("cpu"), world_size=2, rank=1, local_batch_size=4)


def _plan() -> Plan:
    return Plan(model=nn.Linear(2, 1), dataset=[], loss_fn=nn.functional.mse_loss)


def test_a_builder_gets_the_context_when_it_takes_a_third_argument() -> None:
    seen: list[Any] = []

    def two(hp: Mapping[str, Any], seed: int) -> Plan:
        seen.append(None)
        return _plan()

    def three(hp: Mapping[str, Any], seed: int, ctx: BuildContext) -> Plan:
        seen.append(ctx)
        return _plan()

    def optional(hp: Mapping[str, Any], seed: int, ctx: BuildContext | None = None) -> Plan:
        seen.append(ctx)
        return _plan()

    assert [takes_context(f) for f in (two, three, optional)] == [False, True, True]
    for f in (two, three, optional):
        build_plan(f, {}, 0, CTX)
    assert seen == [None, CTX, CTX]
    with pytest.raises(TypeError, match="not a dptrain.Plan"):
        build_plan(lambda hp, seed: nn.Linear(1, 1), {}, 0, CTX)


def test_the_optimizer_factory_gets_the_model_by_name_or_annotation() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))

    def by_name(model):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def by_annotation(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1)

    def params(p: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1)

    assert wants_model(by_name) and wants_model(by_annotation)
    assert not wants_model(params) and not wants_model(lambda p: torch.optim.SGD(p, lr=0.1))
    for factory in (by_name, by_annotation, params):
        opt = make_optimizer(factory, model)
        assert len(opt.param_groups[0]["params"]) == 4
    with pytest.raises(TypeError, match="not an Optimizer"):
        make_optimizer(lambda model: None, model)  # type: ignore[arg-type,return-value]


def test_batches_of_any_shape_move_whole_and_split_into_equal_micro_batches() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {
        "ids": torch.arange(8).view(4, 2),
        "pair": Pair(torch.ones(4), torch.zeros(4, 3)),
        "name": "keep",
    }
    moved = to_device(batch, torch.device("cpu"))
    assert moved["name"] == "keep" and isinstance(moved["pair"], Pair)
    assert batch_size(batch) == 4
    halves = split_batch(batch, 2)
    assert [h["ids"].tolist() for h in halves] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(isinstance(h["pair"], Pair) and h["pair"].y.shape == (2, 3) for h in halves)
    with pytest.raises(ValueError, match="first \\(sample\\) dimension"):
        batch_size((torch.zeros(3), torch.zeros(4)))


def test_each_plan_takes_exactly_one_loss_convention() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Plan(model=nn.Linear(1, 1), dataset=[])
    with pytest.raises(ValueError, match="exactly one"):
        Plan(
            model=nn.Linear(1, 1), dataset=[], loss_fn=nn.functional.mse_loss, compute_loss=lambda m, b: m(b)
        )
    with pytest.raises(TypeError, match="\\(inputs, targets\\) batches"):
        loss_and_outputs(_plan(), nn.Linear(2, 1), {"x": torch.zeros(1, 2)})


def test_a_fused_optimizer_skips_a_non_finite_step_on_the_device() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    guard = NonFiniteGuard(optimizer=opt, env=DistEnv(), device=torch.device("cpu"))
    guard.on_device = True  # CUDA's path, exercised on CPU (fused SGD reads found_inf there too)

    def step(it: int, poison: bool) -> torch.Tensor:
        loss = model(torch.ones(2, 3)).pow(2).mean() * (float("nan") if poison else 1.0)
        loss.backward()
        guard.step(it, loss.detach())
        opt.zero_grad()
        return loss

    step(0, poison=False)  # the first step goes through the host: fused SGD has no momentum yet
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    step(1, poison=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(
        torch.equal(m, opt.state[p]["momentum_buffer"])
        for m, p in zip(momentum, model.parameters(), strict=True)
    )
    step(2, poison=False)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2 on rank 0:"):
        guard.check()


def test_the_host_path_skips_too_and_names_the_first_bad_step() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(optimizer=opt, env=DistEnv(), device=torch.device("cpu"))
    assert not guard.on_device
    guard.check()  # nothing bad yet
    before = [p.detach().clone() for p in model.parameters()]
    for it in (4, 5):
        loss = model(torch.ones(2, 3)).sum() * float("inf")
        loss.backward()
        guard.step(it, loss.detach())
        opt.zero_grad()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with pytest.raises(FloatingPointError, match="at step 5 on rank 0"):
        guard.check()
