"""Differentiable collectives vs a single-process reference: forward values and input gradients.

One spawn per world size runs every op check; each rank saves its outputs and grads with torch.save
and the main process compares them against plain torch ops on the stacked per-rank inputs, where the
total loss is sum over ranks r of (w_r * f(x_0..x_{W-1})).sum().
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.engine_fixtures import Launches
from workers.engine import collectives

TOL = 1e-6
SHAPE = (3, 4)
BROADCAST_SRCS = (0, 1)


def _inputs(world_size: int) -> torch.Tensor:
    """Per-rank inputs stacked on dim 0, with a max tie, a min tie, a single zero and a double zero."""
    g = torch.Generator().manual_seed(1000 + world_size)
    x = torch.rand((world_size, *SHAPE), generator=g, dtype=torch.float64) + 0.5
    x[0, 0, 0] = x[1, 0, 0] = 9.0  # max tie between ranks 0 and 1 (the others are < 1.5)
    x[0, 0, 1] = x[-1, 0, 1] = 0.1  # min tie between rank 0 and the last rank
    x[0, 1, 1] = 0.0  # prod: one zero, so rank 0 gets a non-zero gradient there
    x[0, 2, 2] = x[1, 2, 2] = 0.0  # prod: two zeros, every rank's gradient is zero there
    return x


def _weights(world_size: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Rank-specific loss weights w_r (stacked on dim 0) so the backward is non-trivial."""
    g = torch.Generator().manual_seed(2000 + 10 * world_size + salt)
    return torch.randn((world_size, *shape), generator=g, dtype=torch.float64)


def _cases(world_size: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., Any]]]:
    """name -> (reference f on the stacked inputs, collective applied to one rank's input)."""
    cases: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., Any]]] = {
        "all_reduce_sum": (lambda xs: xs.sum(0), lambda x: collectives.all_reduce(x, "sum")),
        "all_reduce_max": (lambda xs: xs.amax(0), lambda x: collectives.all_reduce(x, "max")),
        "all_reduce_min": (lambda xs: xs.amin(0), lambda x: collectives.all_reduce(x, "min")),
        "all_reduce_prod": (lambda xs: xs.prod(0), lambda x: collectives.all_reduce(x, "prod")),
        "all_gather": (lambda xs: xs.reshape(-1, SHAPE[1]), collectives.all_gather),
    }
    for src in (s for s in BROADCAST_SRCS if s < world_size):
        cases[f"broadcast_src{src}"] = (
            operator.itemgetter(src),
            functools.partial(collectives.broadcast, src=src),
        )
    return cases


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    xs = _inputs(world_size)
    results: dict[str, Any] = {}
    for salt, (name, (ref_f, op)) in enumerate(sorted(_cases(world_size).items())):
        x = xs[rank].clone().requires_grad_(True)
        y = op(x)
        w = _weights(world_size, tuple(ref_f(xs).shape), salt)[rank]
        (w * y).sum().backward()
        results[name] = {"out": y.detach(), "grad": x.grad, "input_untouched": torch.equal(x, xs[rank])}
    try:  # unequal shapes must raise ValueError on every rank (and not hang any)
        collectives.all_gather(torch.zeros(rank + 1, 2, dtype=torch.float64))
        results["unequal_shapes_raised"] = False
    except ValueError:
        results["unequal_shapes_raised"] = True
    after = collectives.all_reduce(torch.ones(2), "sum")  # the group still works afterwards
    results["after_error_ok"] = bool(torch.equal(after, torch.full((2,), float(world_size))))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    # Nobody tears the group down while a peer may still be finishing the last ring exchange.


@pytest.fixture
def spawned(launched: Launches) -> Callable[[int], list[dict[str, Any]]]:
    """`spawned(world_size)`: each rank's saved results, every op run once per world size and session."""
    return lambda world_size: launched.gloo(_worker, world_size)


def _reference(world_size: int, name: str, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward value and d(total)/d(stacked inputs) computed in one process with plain torch ops."""
    ref_f = _cases(world_size)[name][0]
    xs = _inputs(world_size).requires_grad_(True)
    y = ref_f(xs)
    w = _weights(world_size, tuple(y.shape), salt)
    total = sum((w[r] * y).sum() for r in range(world_size))
    assert isinstance(total, torch.Tensor)
    (grad,) = torch.autograd.grad(total, xs)
    return y.detach(), grad


def _assert_close(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape, (
        f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    )
    err = (got - expected).abs().max().item() if got.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}\nexpected:\n{expected}\ngot:\n{got}"


@pytest.mark.e2e
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(_cases(2)))
def test_matches_single_process_reference(
    spawned: Callable[[int], list[dict[str, Any]]], world_size: int, name: str
) -> None:
    ranks = spawned(world_size)
    salt = sorted(_cases(world_size)).index(name)
    ref_out, ref_grad = _reference(world_size, name, salt)
    for rank, res in enumerate(ranks):
        _assert_close(f"{name} W={world_size} rank {rank} forward", res[name]["out"], ref_out)
        _assert_close(f"{name} W={world_size} rank {rank} grad", res[name]["grad"], ref_grad[rank])
        assert res[name]["input_untouched"], f"{name} W={world_size} rank {rank}: the input was mutated"


@pytest.mark.e2e
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_unequal_shapes_raise_everywhere(
    spawned: Callable[[int], list[dict[str, Any]]], world_size: int
) -> None:
    for rank, res in enumerate(spawned(world_size)):
        assert res["unequal_shapes_raised"], f"rank {rank}: expected ValueError for unequal shapes, got none"
        assert res["after_error_ok"], f"rank {rank}: the group was unusable after the ValueError"


@pytest.mark.parametrize("name", sorted(_cases(1)))
def test_world_size_one_without_process_group_is_identity(name: str) -> None:
    assert not dist.is_initialized()
    x = _inputs(2)[0].clone().requires_grad_(True)
    y = _cases(1)[name][1](x)
    w = torch.randn(SHAPE, dtype=torch.float64)
    (w * y).sum().backward()
    assert x.grad is not None
    _assert_close(f"{name} W=1 forward", y.detach(), x.detach())
    _assert_close(f"{name} W=1 grad", x.grad, w)
    assert y.data_ptr() != x.data_ptr(), f"{name} W=1: expected a new tensor, got the input itself"


def test_world_size_one_rejects_bad_arguments() -> None:
    x = torch.ones(2)
    with pytest.raises(ValueError, match="src=1"):
        collectives.broadcast(x, src=1)
    with pytest.raises(ValueError, match="unknown reduce op"):
        collectives.all_reduce(x, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-d"):
        collectives.all_gather(torch.tensor(1.0))
