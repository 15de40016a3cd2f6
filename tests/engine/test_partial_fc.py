"""The `partial_fc` recipe: a classifier sharded across ranks computes what one full classifier does.

Spawned gloo groups of 2 and 4 ranks check one loss + backward against `F.cross_entropy` on the whole
batch with the whole weight; torchrun launches check the recipe end to end at world 1, 2 and 4, the
checkpoint's reassembled weight, elastic resume of a sharded checkpoint, and sharded gradient clipping.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from api_schemas.recipes import PartialFcParams
from tests.engine.spawn import spawn_gloo
from tests.engine_fixtures import Launches
from workers.engine.checkpoint import CheckpointManager, checkpoint_name
from workers.engine.recipes import partial_fc
from workers.engine.sharded_params import shard_range

TOLERANCE = 1e-6
STEPS = 8
# Engine runs: uneven at world 4 (11, 11, 10, 10 rows), so the gather's padding path runs; a global batch of
# 32 holds ~22 distinct classes, so sample_rate 0.5 (21 classes) leaves ~20 classes out of every step.
ENGINE_CLASSES = 42
# Spawned checks: 10 classes, 4 samples: sample_rate 0.5 keeps the <= 4 positives plus random negatives.
NUM_CLASSES, BATCH, DIM = 10, 4, 6


def _spec(make_spec: Callable[..., dict[str, Any]], **hp: Any) -> dict[str, Any]:
    spec = make_spec(
        hyperparameters={"steps": STEPS, "num_classes": ENGINE_CLASSES, "sample_rate": 0.5, **hp},
        checkpoint={"every_steps": 4, "keep_last": 3},
    )
    spec["recipe"] = "partial_fc"
    return spec


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same keys, got {sorted(a)} vs {sorted(b)}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _momentum(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {str(k): v["momentum_buffer"] for k, v in ckpt["optimizer"]["state"].items()}


@pytest.fixture
def launch(launched: Launches) -> Callable[..., Any]:
    """`launch(spec, nproc)` -> the finished run, launched once per session."""
    return launched.torchrun


@pytest.mark.e2e
def test_same_result_at_any_world_size(launch: Callable[..., Any], make_spec: Any) -> None:
    spec = _spec(make_spec)
    finals = {w: launch(spec, w).checkpoint(STEPS) for w in (1, 2, 4)}
    ref = finals[1]
    for w, state in finals.items():
        # Rank 0 reassembles every rank's rows: the download holds the whole C x D weight.
        weight = state["model"][partial_fc.SHARDED_WEIGHT]
        assert weight.shape == (ENGINE_CLASSES, 16), (
            f"world {w}: expected the full weight, got {weight.shape}"
        )
        params, momentum = (
            _max_diff(state["model"], ref["model"]),
            _max_diff(_momentum(state), _momentum(ref)),
        )
        print(f"partial_fc world {w} vs 1: params {params:.3g}, momentum {momentum:.3g}")
        assert params <= TOLERANCE, f"world {w}: expected max |param diff| <= {TOLERANCE}, got {params:.3g}"
        assert momentum <= TOLERANCE, (
            f"world {w}: expected max |momentum diff| <= {TOLERANCE}, got {momentum:.3g}"
        )
    torch.manual_seed(0)
    model = partial_fc.PartialFcModel(PartialFcParams(num_classes=ENGINE_CLASSES), 0, 0, 1)
    model.load_state_dict(finals[4]["model"])  # a world-4 checkpoint is a plain, whole model


@pytest.mark.e2e
def test_elastic_resume_reshards_the_checkpoint(
    launch: Callable[..., Any], engine_runner: Callable[..., Any], make_spec: Any, tmp_path: Path
) -> None:
    spec = _spec(make_spec)
    want = launch(spec, 1).checkpoint(STEPS)
    src = launch(spec, 4).checkpoint_dir
    resumed = {}
    for world in (2, 1):  # 4 -> 2 (3+3+2+2 rows become 5+5) and 4 -> 1
        ckpt_dir = tmp_path / f"4to{world}"
        ckpt_dir.mkdir()
        ckpt = src / checkpoint_name(4)
        for path in (ckpt, CheckpointManager.sidecar_for(ckpt)):
            shutil.copy(path, ckpt_dir / path.name)
        run = engine_runner(spec, world, checkpoint_dir=ckpt_dir)
        assert run.returncode == 0, f"world {world}: expected exit 0\n{run.describe()}"
        assert [e["start_iter"] for e in run.events(0) if e["type"] == "started"] == [4], run.describe()
        resumed[world] = run.checkpoint(STEPS)
    for world, got in resumed.items():
        params, momentum = _max_diff(got["model"], want["model"]), _max_diff(_momentum(got), _momentum(want))
        assert params <= TOLERANCE, f"4 -> {world}: expected params within {TOLERANCE}, got {params:.3g}"
        assert momentum <= TOLERANCE, (
            f"4 -> {world}: expected momentum within {TOLERANCE}, got {momentum:.3g}"
        )


@pytest.mark.e2e
def test_clipping_sums_the_shards_norms_across_ranks(launch: Callable[..., Any], make_spec: Any) -> None:
    spec = _spec(make_spec)
    spec["engine"]["grad_clip_norm"] = 0.05
    one, two = launch(spec, 1), launch(spec, 2)
    norms = {
        w: [e["values"]["grad_norm"] for e in r.events(0) if e["type"] == "metrics"]
        for w, r in ((1, one), (2, two))
    }
    assert norms[1] and max(norms[1]) > 0.05, f"expected every logged step to clip, got norms {norms[1]}"
    for a, b in zip(norms[1], norms[2], strict=True):
        assert abs(a - b) <= 1e-5, f"expected world 2's pre-clip norm to equal world 1's, got {norms}"
    params = _max_diff(two.checkpoint(STEPS)["model"], one.checkpoint(STEPS)["model"])
    unclipped = _max_diff(
        launch(_spec(make_spec), 1).checkpoint(STEPS)["model"], one.checkpoint(STEPS)["model"]
    )
    assert params <= TOLERANCE, f"expected clipped world 2 == world 1 within {TOLERANCE}, got {params:.3g}"
    assert unclipped > 1e-3, f"expected clipping to change the result, got a difference of {unclipped:.3g}"


def test_config_refuses_bad_extras() -> None:
    with pytest.raises(ValidationError, match="hidden_layers\n  Extra inputs are not permitted"):
        partial_fc.build({"hidden_layers": 2}, 0)
    for rate in (0, 1.5, True, "half", float("nan")):
        with pytest.raises(ValidationError, match="sample_rate"):
            PartialFcParams(sample_rate=rate)
    with pytest.raises(ValidationError, match="num_classes\n  Input should be greater than or equal to 2"):
        PartialFcParams(num_classes=1)


@pytest.mark.parametrize(("total", "world"), [(10, 4), (3, 4), (8, 2), (7, 1)])
def test_shards_cover_every_row_once(total: int, world: int) -> None:
    ranges = [shard_range(total, world, r) for r in range(world)]
    rows = [i for a, b in ranges for i in range(a, b)]
    assert rows == list(range(total)), f"expected rows 0..{total - 1} once each, got {ranges}"
    assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1, f"unbalanced: {ranges}"


# ---- one loss + backward on spawned gloo groups, against a single-process full classifier -------------


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
    weight = torch.randn(NUM_CLASSES, DIM, generator=g, dtype=torch.float64)
    targets = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    return feats, weight, targets


def _classifier(rank: int, world: int, sample_rate: float) -> partial_fc.ShardedClassifier:
    cfg = PartialFcParams(num_classes=NUM_CLASSES, embedding_size=DIM, sample_rate=sample_rate)
    clf = partial_fc.ShardedClassifier(cfg, 3, rank, world).double()
    start, stop = shard_range(NUM_CLASSES, world, rank)
    with torch.no_grad():
        clf.weight.copy_(_problem()[1][start:stop])
    return clf


def _loss_and_grads(rank: int, world: int, sample_rate: float) -> dict[str, torch.Tensor]:
    feats, _, targets = _problem()
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    x = feats[local].clone().requires_grad_(True)
    clf = _classifier(rank, world, sample_rate)
    loss = clf.loss(x, targets[local])
    loss.backward()
    assert x.grad is not None and clf.weight.grad is not None
    return {"loss": loss.detach(), "feature_grad": x.grad, "weight_grad": clf.weight.grad}


def _worker(rank: int, world: int, out_dir: str) -> None:
    out = {rate: _loss_and_grads(rank, world, rate) for rate in (1.0, 0.5)}
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loss_and_gradients_equal_one_full_classifier(world: int, tmp_path: Path) -> None:
    spawn_gloo(_worker, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    feats, weight, targets = _problem()
    feats.requires_grad_(True)
    weight.requires_grad_(True)
    expected = nn.functional.cross_entropy(feats @ weight.t(), targets)
    expected.backward()
    assert feats.grad is not None and weight.grad is not None
    sampled_ref = _loss_and_grads(0, 1, 0.5)  # world 1 with the same sampling: the single-process reference

    def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = float((got - want).abs().max())
        assert err <= 1e-12, f"world {world} {what}: expected max abs error <= 1e-12 (float64), got {err:.3g}"

    for rank, res in enumerate(ranks):
        start, stop = shard_range(NUM_CLASSES, world, rank)
        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        close(f"rank {rank} loss", res[1.0]["loss"], expected.detach())
        close(f"rank {rank} weight grad (its rows)", res[1.0]["weight_grad"], weight.grad[start:stop])
        # DDP divides the backbone's gradients by the world size, so the features carry world x the grad.
        close(f"rank {rank} feature grad", res[1.0]["feature_grad"] / world, feats.grad[local])
        close(f"rank {rank} sampled loss", res[0.5]["loss"], sampled_ref["loss"])
        close(
            f"rank {rank} sampled weight grad",
            res[0.5]["weight_grad"],
            sampled_ref["weight_grad"][start:stop],
        )
        close(
            f"rank {rank} sampled feature grad",
            res[0.5]["feature_grad"] / world,
            sampled_ref["feature_grad"][local],
        )
    assert not torch.equal(sampled_ref["loss"], expected.detach()), "expected sampling to change the loss"
    untouched = int((sampled_ref["weight_grad"] == 0).all(dim=1).sum())
    assert untouched == NUM_CLASSES // 2, (
        f"expected half the classes sampled out, {untouched} rows had no grad"
    )
