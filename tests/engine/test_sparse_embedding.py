"""Sparse gradients and non-data-parallel parameters.

The engine runs (torchrun) train the sparse_embedding recipe at world 1, 2 and 4 and in both
`engine.sparse` modes; the spawned 2-rank gloo group checks the sync functions on hand-made gradients
(rows only one rank touched, a rank without a gradient), one real Trainer step per mode against the
full-batch gradient, and a Plan whose `non_data_parallel` parameter stays each rank's own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from api_schemas import JobSpec
from api_schemas.recipes import SparseEmbeddingParams
from tests.conftest import ENGINE_JOB, job_spec
from tests.engine_fixtures import Launches
from workers.engine import distributed
from workers.engine.batch_sampler import GlobalBatchSampler, TensorDataset
from workers.engine.clipping import clip_grad_norm_
from workers.engine.recipes import Plan, sparse_embedding
from workers.engine.sparse import allgather_average, dense_average
from workers.engine.trainer import Trainer

# The ranks' sparse rows are summed in another order than world 1's backward sums them (per rank, then
# across ranks), so parameters agree to float rounding, not bit for bit: the bound the other
# equivalence tests use. Measured values are printed (-s) and recorded in docs/engine.md.
TOLERANCE = 1e-6
STEPS = 8
SEED = 2024
WORLD = 2
BATCH = 16  # global batch of the spawned checks; 8 per rank
TABLE = "embedding.weight"


def _spec(**engine: Any) -> dict[str, Any]:
    return job_spec(
        ENGINE_JOB,
        name="sparse-test",
        recipe="sparse_embedding",
        hyperparameters={"steps": STEPS, "seed": SEED, "dataset_size": 256},
        # Clipping on, below the gradient norm (~0.25), so the sparse-aware clip really scales.
        engine={"log_every_steps": 1, "grad_clip_norm": 0.2, **engine},
        checkpoint={"keep_last": 1},
    )


@pytest.fixture
def launch(launched: Launches) -> Callable[..., Any]:
    """`launch(nproc, **engine)` -> the finished run, launched once per session."""
    return lambda nproc, **engine: launched.torchrun(_spec(**engine), nproc)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same state_dict keys, got {sorted(a)} vs {sorted(b)}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("world", "engine"), [(2, {}), (4, {}), (2, {"grad_accumulation_steps": 2})], ids=["2", "4", "2-accum2"]
)
def test_world_sizes_end_at_the_same_parameters(
    launch: Callable[..., Any], world: int, engine: dict[str, Any]
) -> None:
    one, other = launch(1).checkpoint(STEPS)["model"], launch(world, **engine).checkpoint(STEPS)["model"]
    diff = _max_diff(other, one)
    table = (other[TABLE] - one[TABLE]).abs().max().item()
    print(f"sparse_embedding world {world} {engine} vs 1: max |param diff| {diff:.3g}, table {table:.3g}")
    assert diff <= TOLERANCE, f"expected max |param diff| <= {TOLERANCE} vs world 1, got {diff:.3g}"


@pytest.mark.e2e
def test_loss_falls_and_only_touched_rows_move(launch: Callable[..., Any]) -> None:
    run = launch(1)
    losses = [e["values"]["loss"] for e in run.events(0) if e["type"] == "metrics"]
    assert len(losses) == STEPS, f"expected {STEPS} loss values, got {losses}"
    assert losses[-1] < losses[0], f"expected the loss to fall, got {losses}"
    norms = [e["values"]["grad_norm"] for e in run.events(0) if e["type"] == "metrics"]
    assert all(n > 0.2 for n in norms), f"expected clipping to be active (norm > 0.2), got {norms}"
    torch.manual_seed(SEED)  # the engine seeds the model init with the job seed
    init = sparse_embedding.build({"dataset_size": 256}, SEED).model.state_dict()[TABLE]
    moved = (run.checkpoint(STEPS)["model"][TABLE] != init).any(dim=1).sum().item()
    rows = init.shape[0]
    assert 0 < moved < rows, f"expected sparse updates to move some but not all {rows} rows, got {moved}"


@pytest.mark.e2e
def test_allgather_equals_dense_sync(launch: Callable[..., Any]) -> None:
    gathered = launch(WORLD).checkpoint(STEPS)["model"]
    dense = launch(WORLD, sparse="dense").checkpoint(STEPS)["model"]
    diff = _max_diff(gathered, dense)
    print(f"sparse_embedding world 2 allgather vs dense: max |param diff| {diff:.3g}")
    assert diff <= TOLERANCE, f"expected allgather and dense within {TOLERANCE}, got {diff:.3g}"


# ---- recipe extras ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extras", "field", "reason"),
    [
        ({"vocab_size": 10}, "vocab_size", "not a hyperparameter of recipe 'sparse_embedding'"),
        ({"num_embeddings": 1}, "num_embeddings", "greater than or equal to 2"),
        ({"bag_size": 0}, "bag_size", "greater than or equal to 1"),
        ({"embed_size": "big"}, "embed_size", "valid integer"),
    ],
)
def test_bad_extras_are_refused_by_api_and_engine(extras: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(
            {"name": "x", "recipe": "sparse_embedding", "hyperparameters": {"global_batch_size": 8, **extras}}
        )
    errors = [(e["loc"], e["msg"]) for e in refused.value.errors()]
    assert any(loc == ("hyperparameters", field) and reason in msg for loc, msg in errors), (
        f"expected an error at hyperparameters.{field} mentioning {reason!r}, got {errors}"
    )
    with pytest.raises(ValidationError, match=field):
        sparse_embedding.build(extras, 0)


def test_dataset_is_a_function_of_the_seed_and_skewed() -> None:
    cfg = SparseEmbeddingParams(dataset_size=512)
    a, b, c = (sparse_embedding.build_dataset(cfg, s) for s in (1, 1, 2))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets), "expected same data, seed 1"
    assert not torch.equal(a.inputs, c.inputs), "expected different data for a different seed"
    counts = torch.bincount(a.inputs.reshape(-1), minlength=cfg.num_embeddings).sort(descending=True).values
    top = counts[:10].sum().item() / counts.sum().item()
    assert top > 0.2, f"expected a skewed id distribution (top 10 of 1000 rows > 20% of ids), got {top:.2f}"
    assert len(set(a.targets.tolist())) > 1, "expected more than one class"


# ---- in-process checks on a spawned gloo group ------------------------------------------------------------


def _rows(ids: list[int], value: float) -> torch.Tensor:
    """An uncoalesced [10, 3] row-sparse gradient with `value` in each listed row (repeats add up)."""
    idx = torch.tensor([ids])
    return torch.sparse_coo_tensor(idx, torch.full((len(ids), 3), value), (10, 3))


def _hand_made_grads(rank: int) -> dict[str, Any]:
    like = torch.zeros(10, 3)
    # Rank 0 touches rows 1 (twice) and 2, rank 1 rows 2 and 5: rows 1 and 5 only one rank touched.
    grad = _rows([1, 1, 2], 1.0) if rank == 0 else _rows([2, 5], 3.0)
    out: dict[str, Any] = {}
    for name, fn in (("allgather", allgather_average), ("dense", dense_average)):
        out[name] = fn(grad, like, WORLD)
        out[f"{name}_one_none"] = fn(grad if rank == 0 else None, like, WORLD)
        out[f"{name}_all_none"] = fn(None, like, WORLD)
    return out


def _non_dp_plan() -> Plan:
    """A small entrypoint-style Plan whose `scale` each rank keeps to itself."""
    torch.manual_seed(SEED)
    model = _ScaledMlp()
    g = torch.Generator().manual_seed(SEED)
    data = TensorDataset(
        inputs=torch.randn(64, 4, generator=g), targets=torch.randint(0, 2, (64,), generator=g)
    )
    return Plan(model=model, dataset=data, loss_fn=nn.functional.cross_entropy, non_data_parallel=("scale",))


class _ScaledMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale  # type: ignore[no-any-return]


def _cfg(recipe: bool, **engine: Any) -> JobSpec:
    spec = _spec(**engine)
    spec["hyperparameters"].update(global_batch_size=BATCH, dataset_size=64)
    if not recipe:
        spec.update(recipe=None, entrypoint="tests.engine.test_sparse_embedding:non_dp")
    return JobSpec.model_validate(spec)


def _trainer(cfg: JobSpec, plan: Plan, env: distributed.DistEnv) -> Trainer:
    """A trainer without events or checkpoints: only wrap() and the training step run."""
    local = cfg.local_batch_size(env.world_size)
    return Trainer(
        cfg, plan, env, torch.device("cpu"), cast(Any, None), cast(Any, None), local_batch_size=local
    )


def _recipe_trainer(env: distributed.DistEnv, **engine: Any) -> Trainer:
    torch.manual_seed(SEED)
    plan = sparse_embedding.build({"dataset_size": 64}, SEED)
    return _trainer(_cfg(True, **engine), plan, env)


def _step_capturing_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """One training step; returns the gradients the optimizer was given (after sync and clipping)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args: Any, **kwargs: Any) -> Any:
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture  # type: ignore[method-assign]
    trainer._step(0)
    return grads


def _worker(rank: int, world: int, out_dir: str) -> None:
    results: dict[str, Any] = {"hand_made": _hand_made_grads(rank)}
    env = distributed.DistEnv(rank=rank, world_size=WORLD, launched=True)
    for mode in ("allgather", "dense"):
        trainer = _recipe_trainer(env, sparse=mode, grad_clip_norm=None)
        if rank == 1:
            # DDP ignores the table, so only the engine's own broadcast can undo this.
            trainer.model.state_dict()[TABLE].add_(1.0)
        trainer.wrap()
        results[mode] = _step_capturing_grads(trainer)
    plan = _non_dp_plan()
    with torch.no_grad():
        plan.model.get_parameter("scale").fill_(1.0 + rank)  # ranks start apart; no broadcast may undo it
    trainer = _trainer(_cfg(False, grad_clip_norm=None), plan, env)
    trainer.wrap()
    trainer._step(0)
    results["non_dp"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture
def spawned(launched: Launches) -> list[dict[str, Any]]:
    """Each rank's saved results (spawned once per session)."""
    return launched.gloo(_worker, WORLD)


def _close(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    err = (got.double() - expected.double()).abs().max().item()
    print(f"{what}: max abs error {err:.3g}")
    assert err <= TOLERANCE, f"{what}: expected max abs error <= {TOLERANCE}, got {err:.3g}"


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["allgather", "dense"])
def test_sync_averages_rows_only_some_ranks_touched(spawned: list[dict[str, Any]], mode: str) -> None:
    expected = torch.zeros(10, 3)
    expected[1], expected[2], expected[5] = 2.0 / 2, (1.0 + 3.0) / 2, 3.0 / 2
    for rank, res in enumerate(r["hand_made"] for r in spawned):
        got = res[mode]
        assert got is not None and got.is_sparse, f"rank {rank}: expected a sparse gradient, got {got!r}"
        _close(f"{mode} rank {rank} average", got.to_dense(), expected)
        # A rank without a gradient contributes zeros; the others' rows are still averaged over 2 ranks.
        one_none = res[f"{mode}_one_none"]
        assert one_none is not None, f"{mode} rank {rank}: expected a gradient when rank 0 has one, got None"
        _close(
            f"{mode} rank {rank} with rank 1 gradless", one_none.to_dense(), _rows([1, 1, 2], 0.5).to_dense()
        )
        assert res[f"{mode}_all_none"] is None, f"{mode}: expected None when no rank has a gradient"


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["allgather", "dense"])
def test_a_trainer_step_gives_every_rank_the_full_batch_gradient(
    spawned: list[dict[str, Any]], mode: str
) -> None:
    trainer = _recipe_trainer(distributed.DistEnv())
    idx = GlobalBatchSampler(len(trainer.data.dataset), BATCH, SEED).global_indices(0)
    x, y = trainer.data.dataset.batch(idx, torch.device("cpu"))
    nn.functional.cross_entropy(trainer.model(x), y).backward()
    halves = [
        set(x[r * BATCH // WORLD : (r + 1) * BATCH // WORLD].reshape(-1).tolist()) for r in range(WORLD)
    ]
    assert halves[0] ^ halves[1], "expected rows that only one rank's half batch touched"
    for name, p in trainer.model.named_parameters():
        assert p.grad is not None
        full = p.grad.to_dense() if p.grad.is_sparse else p.grad
        for rank, res in enumerate(r[mode] for r in spawned):
            got = res[name]
            if name == TABLE:
                assert got.is_sparse, (
                    f"{mode} rank {rank}: expected a sparse table gradient, got {got.layout}"
                )
                nnz = got.coalesce().indices().shape[1]
                rows = len(halves[0] | halves[1])
                assert nnz == rows, f"{mode} rank {rank}: expected {rows} rows (those touched), got {nnz}"
                got = got.to_dense()
            _close(f"{mode} rank {rank} grad {name}", got, full)


@pytest.mark.e2e
def test_non_data_parallel_parameter_keeps_each_rank_own_gradient(spawned: list[dict[str, Any]]) -> None:
    cfg = _cfg(False, grad_clip_norm=None)
    t = cfg.hyperparameters
    local_grads = []
    for rank in range(WORLD):
        model = _non_dp_plan().model
        with torch.no_grad():
            model.get_parameter("scale").fill_(1.0 + rank)
        data = _non_dp_plan().dataset
        idx = GlobalBatchSampler(len(data), BATCH, SEED).local_indices(0, rank, BATCH // WORLD)
        x, y = data.batch(idx, torch.device("cpu"))
        nn.functional.cross_entropy(model(x), y).backward()
        local_grads.append((model, {n: p.grad for n, p in model.named_parameters()}))
    for rank, (model, _) in enumerate(local_grads):
        # Expected: one SGD step on the mean of the ranks' gradients, except `scale`: the rank's own.
        for n, p in model.named_parameters():
            if n != "scale":
                p.grad = sum(g[n] for _, g in local_grads) / WORLD
        torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay).step()
        for n, p in model.named_parameters():
            _close(f"rank {rank} {n} after one step", spawned[rank]["non_dp"][n], p.detach())
    a, b = (spawned[r]["non_dp"] for r in range(WORLD))
    assert not torch.allclose(a["scale"], b["scale"]), f"expected per-rank scales, got {a['scale']} on both"
    for n in a:
        if n != "scale":
            assert torch.equal(a[n], b[n]), (
                f"expected {n} equal on both ranks, got max diff {(a[n] - b[n]).abs().max()}"
            )


def test_clipping_is_refused_with_non_data_parallel_parameters() -> None:
    # Checked in wrap() before DDP or any collective, so no process group is needed.
    env = distributed.DistEnv(rank=0, world_size=WORLD)
    trainer = _trainer(_cfg(False), _non_dp_plan(), env)
    with pytest.raises(ValueError, match=r"grad_clip_norm cannot be combined .*\(scale\)"):
        trainer.wrap()


def test_clipping_handles_sparse_gradients_like_dense_ones() -> None:
    sparse, dense = nn.EmbeddingBag(10, 3, sparse=True), nn.EmbeddingBag(10, 3)
    dense.load_state_dict(copy.deepcopy(sparse.state_dict()))
    ids = torch.tensor([[1, 1, 2], [2, 5, 7]])
    for m in (sparse, dense):
        m(ids).pow(2).sum().backward()
    got, expected = (
        clip_grad_norm_(sparse.parameters(), 0.1),
        torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1),
    )
    _close("total norm", got, expected)
    assert sparse.weight.grad is not None and dense.weight.grad is not None
    assert sparse.weight.grad.is_sparse, "expected the clipped gradient to stay sparse"
    _close("clipped gradient", sparse.weight.grad.to_dense(), dense.weight.grad)
