"""Streams: one global order whatever the world size, a position that resumes at the exact sample,
1 vs 2 ranks equal, a kill and resume bitwise equal, and an elastic resume from 2 ranks to 1."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dptrain.data import Stream
from tests.engine_fixtures import EngineRun, Launches, assert_bitwise_equal
from tests.fixtures.data_plans import read_shard, shard_length, to_pair
from workers.engine.batch_loader import LoadFailure, load_failure
from workers.engine.checkpoint import CheckpointManager, checkpoint_name
from workers.engine.stream_batches import StreamBatch, StreamBatches, StreamPosition, samples, shard_order

ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "tests.fixtures"}
SEED = 1234  # the engine tests' seed (tests/conftest.py ENGINE_JOB)
SHARDS = list(range(6))
EPOCH = sum(shard_length(s) for s in SHARDS)  # 35 samples: batches of 12 cross shards and epochs


def _stream(transform: Any = None, shards: list[int] = SHARDS) -> Stream:
    return Stream(shards=shards, read=lambda shard: read_shard(SEED, shard), transform=transform)


def _expected(n: int) -> list[tuple[torch.Tensor, int]]:
    """The first n samples as the definition says: each epoch's shards in shard_order, read in order."""
    out: list[tuple[torch.Tensor, int]] = []
    for epoch in itertools.count():
        for shard in shard_order(len(SHARDS), SEED, epoch, True):
            out += list(read_shard(SEED, shard))
        if len(out) >= n:
            return out[:n]
    raise AssertionError("unreachable")


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b, strict=True)
    )


# ---- in-process: the order, the position, the split -----------------------------------------------------


def test_the_global_order_is_each_epoch_s_shards_in_a_seeded_order() -> None:
    got = [raw for raw, _ in itertools.islice(samples(_stream(), SEED, StreamPosition()), 3 * EPOCH + 5)]
    assert _same(got, _expected(3 * EPOCH + 5))
    orders = [shard_order(6, SEED, e, True) for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3 and all(sorted(o) == SHARDS for o in orders)
    assert shard_order(6, SEED, 0, False) == SHARDS


def test_reading_on_from_any_position_continues_the_same_sequence() -> None:
    stream = _stream()
    first = list(itertools.islice(samples(stream, SEED, StreamPosition()), 2 * EPOCH))
    for k in (0, 4, 5, 16, 34, 35, 36, 60):
        position = first[k][1]  # after sample k
        assert position.sample == k + 1
        rest = [raw for raw, _ in itertools.islice(samples(stream, SEED, position), 2 * EPOCH - k - 1)]
        assert _same(rest, [raw for raw, _ in first[k + 1 :]]), f"resumed after sample {k}"
        again = StreamPosition.from_state(position.state())
        assert again == position


def test_ranks_keep_contiguous_slices_of_the_same_global_batches() -> None:
    def batches(world: int, rank: int, first: int, start: StreamPosition) -> list[StreamBatch]:
        it = StreamBatches(
            _stream(to_pair),
            seed=SEED,
            global_batch_size=12,
            rank=rank,
            local_batch_size=12 // world,
            first=first,
            stop=7,
            start=start,
            collate_fn=torch.utils.data.default_collate,
            failure=load_failure,
        )
        return list(it)

    whole = batches(1, 0, 0, StreamPosition())
    assert [b.position["sample"] for b in whole] == [12 * (i + 1) for i in range(7)]
    for world in (2, 4):
        parts = [batches(world, r, 0, StreamPosition()) for r in range(world)]
        for step, want in enumerate(whole):
            xs = torch.cat([parts[r][step].batch[0] for r in range(world)])
            assert torch.equal(xs, want.batch[0]), f"world {world} step {step}"
            assert all(parts[r][step].position == want.position for r in range(world))
    # From a checkpoint's position at step 3: the same batches 3..6.
    resumed = batches(2, 1, 3, StreamPosition.from_state(whole[2].position))
    assert [b.position for b in resumed] == [b.position for b in whole[3:]]
    with pytest.raises(ValueError, match="step 3 starts at sample 36"):
        batches(1, 0, 3, StreamPosition())


def test_a_failing_transform_or_reader_names_the_sample_or_shard() -> None:
    poisoned = _expected(18)[17][0]

    def bad_transform(raw: Any) -> Any:
        if torch.equal(raw[0], poisoned):
            raise ValueError("cannot decode")
        return to_pair(raw)

    def run(stream: Stream) -> list[Any]:
        return list(
            StreamBatches(
                stream,
                seed=SEED,
                global_batch_size=4,
                rank=0,
                local_batch_size=4,
                first=0,
                stop=10,
                start=StreamPosition(),
                collate_fn=torch.utils.data.default_collate,
                failure=load_failure,
            )
        )

    out = run(_stream(bad_transform))
    assert len(out) == 5 and isinstance(out[-1], LoadFailure)  # batches 0-3, then the failure
    assert out[-1].where == "sample 17" and out[-1].error == "ValueError: cannot decode"

    def bad_reader(shard: int) -> Any:
        if shard == 3:
            raise OSError("shard 3 is gone")
        return read_shard(SEED, shard)

    failure = run(Stream(shards=SHARDS, read=bad_reader))[-1]
    assert isinstance(failure, LoadFailure) and failure.where == "shard 3" and failure.io


def test_streams_without_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        Stream(shards=[], read=lambda s: iter(()))
    with pytest.raises(ValueError, match="hold no samples"):
        next(samples(_stream(shards=[1, 1]), SEED, StreamPosition()))  # shard 1 is empty


# ---- torchrun: 1 vs 2 ranks, kill and resume, 2 ranks to 1 ----------------------------------------------

STEPS = 8


def _spec(make_spec: Any, **data: Any) -> dict[str, Any]:
    spec = make_spec(
        hyperparameters={"global_batch_size": 12, "steps": STEPS},
        checkpoint={"every_steps": 4, "keep_last": 3},
        data=data,
    )
    spec.update(recipe=None, entrypoint="tests.fixtures.data_plans:stream")
    return dict(spec)


def _ok(run: EngineRun) -> EngineRun:
    assert run.returncode == 0, run.describe()
    return run


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.e2e
def test_one_and_two_ranks_train_the_same_on_a_stream(launched: Launches, make_spec: Any) -> None:
    one = _ok(launched.torchrun(_spec(make_spec), 1, extra_env=ALLOWED))
    two = _ok(launched.torchrun(_spec(make_spec, num_workers=2), 2, extra_env=ALLOWED))
    a, b = one.checkpoint(STEPS), two.checkpoint(STEPS)
    assert _max_diff(a["model"], b["model"]) <= 1e-6
    # The checkpoint says where step 8's data starts: sample 96 = 2 epochs of 35 and 26 more.
    assert a["data"]["stream"] == b["data"]["stream"]
    assert a["data"]["stream"]["sample"] == STEPS * 12 and a["data"]["stream"]["epoch"] == 2


@pytest.mark.e2e
def test_a_killed_stream_job_resumes_bitwise_and_elastically(
    launched: Launches, engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    spec = _spec(make_spec, num_workers=2)
    full = _ok(launched.torchrun(spec, 2, extra_env=ALLOWED))
    ckpt = tmp_path / "ckpt"
    killed = engine_runner(
        spec, 2, checkpoint_dir=ckpt, extra_env={**ALLOWED, "DPTRAIN_FAULT_INJECT": "exit:rank=1:step=6"}
    )
    assert killed.returncode != 0 and sorted(p.name for p in ckpt.glob("*.pt")) == [checkpoint_name(4)]
    elastic = tmp_path / "elastic"
    elastic.mkdir()
    for path in (ckpt / checkpoint_name(4), CheckpointManager.sidecar_for(ckpt / checkpoint_name(4))):
        shutil.copy(path, elastic / path.name)

    resumed = _ok(engine_runner(spec, 2, checkpoint_dir=ckpt, extra_env=ALLOWED))
    assert [e["start_iter"] for e in resumed.events(0) if e["type"] == "started"] == [4]
    want, got = full.checkpoint(STEPS), resumed.checkpoint(STEPS)
    for key in ("model", "optimizer", "iter", "data"):
        assert_bitwise_equal(want[key], got[key], key)

    one = _ok(engine_runner(spec, 1, checkpoint_dir=elastic, extra_env=ALLOWED))
    assert one.checkpoint(STEPS)["data"] == want["data"]
    assert _max_diff(one.checkpoint(STEPS)["model"], want["model"]) <= 1e-6
