"""engine.activation_checkpointing: same parameters, plain checkpoints, less memory; grads are bucket views.

Recomputing a forward in backward runs the same kernels on the same inputs (and, for dropout, the same
RNG state), so the result is expected bitwise, not just close: measured max |param diff| 0.0 for mlp at
world 1 and at world 2 (bf16, accumulation 2) and for cnn_bn (running stats included). lstm_lm's LSTM runs
in time chunks, so its weight gradients are summed chunk by chunk: measured 7.5e-9 after 6 steps.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from api_schemas import JobSpec
from api_schemas.recipes import CnnBnParams, LstmLmParams, MlpParams
from tests.conftest import job_spec
from tests.engine.spawn import spawn_gloo
from tests.engine_fixtures import Launches
from workers.engine import distributed
from workers.engine.batchnorm import convert_sync_batchnorm
from workers.engine.checkpoint import CheckpointManager, checkpoint_name
from workers.engine.main import main
from workers.engine.memory import checkpoint_activations, segment_bounds
from workers.engine.recipes import cnn_bn, lstm_lm, mlp
from workers.engine.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
NUM_LAYERS = 4  # 9 children: segments 0:3 and 3:6 recompute, 6:9 (the last) is kept
MLP_PARTS = "activation checkpointing: segment 0:3, segment 3:6"
LSTM_TOLERANCE = 1e-6  # the other equivalence tests' bound; measured 7.5e-9 (6e-8 at other sizes)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"expected the same state_dict keys, got {sorted(a)} vs {sorted(b)}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _assert_same(off: dict[str, torch.Tensor], on: dict[str, torch.Tensor], what: str) -> None:
    diff = _max_diff(off, on)
    print(f"{what}: max |state diff| = {diff:.3g}")
    unequal = [k for k in off if not torch.equal(off[k], on[k])]
    assert not unequal, f"{what}: expected bitwise-equal states, {unequal} differ by up to {diff:.3g}"


# ---- mlp under torchrun: world 1 (fp32) and world 2 (bf16, accumulation 2) ---------------------------------


@pytest.fixture
def launch(launched: Launches, make_spec: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    """`launch(nproc, checkpointing, **engine)` -> the finished run, launched once per session."""

    def run(nproc: int, checkpointing: bool, **engine: Any) -> Any:
        spec = make_spec(
            hyperparameters={"steps": STEPS, "num_layers": NUM_LAYERS},
            engine={"activation_checkpointing": checkpointing, **engine},
        )
        return launched.torchrun(spec, nproc)

    return run


WORLD_2 = {"precision": "bf16", "grad_accumulation_steps": 2}


@pytest.mark.e2e
class TestMlpUnderTorchrun:
    @pytest.mark.parametrize(
        ("nproc", "engine"), [(1, {}), (2, WORLD_2)], ids=["world1", "world2-bf16-accum2"]
    )
    def test_same_parameters_with_and_without(
        self, launch: Callable[..., Any], nproc: int, engine: dict[str, Any]
    ) -> None:
        off, on = launch(nproc, False, **engine), launch(nproc, True, **engine)
        for r in range(nproc):
            assert MLP_PARTS in on.log(r), f"rank {r}: expected {MLP_PARTS!r} in its log, got:\n{on.log(r)}"
            assert "activation checkpointing" not in off.log(r), (
                f"rank {r}: expected no checkpointing when off"
            )
        _assert_same(
            off.checkpoint(STEPS)["model"],
            on.checkpoint(STEPS)["model"],
            f"mlp world {nproc}, checkpointing on vs off",
        )

    def test_checkpoint_keys_are_plain_and_load_into_the_bare_model(self, launch: Callable[..., Any]) -> None:
        state = launch(2, True, **WORLD_2).checkpoint(STEPS)["model"]
        bare = mlp.build_model(MlpParams(num_layers=NUM_LAYERS))
        expected = set(bare.state_dict())
        assert set(state) == expected, (
            f"expected the bare model's keys {sorted(expected)}, got {sorted(state)}"
        )
        bare.load_state_dict(state)  # strict


# ---- cnn_bn and lstm_lm at world 1, in-process -------------------------------------------------------------


def _spec(recipe: str, checkpointing: bool, **checkpoint: Any) -> dict[str, Any]:
    return job_spec(
        recipe=recipe,
        hyperparameters={
            "global_batch_size": 16,
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 1e-4,
            "steps": STEPS,
            "seed": 99,
            "dataset_size": 64,
        },
        engine={"log_every_steps": STEPS, "activation_checkpointing": checkpointing},
        checkpoint={"every_steps": 100, "keep_last": 5, **checkpoint},
    )


def _main(base: Path, name: str, spec: dict[str, Any], checkpoint_dir: Path | None = None) -> Path:
    """Run the engine in this process (world 1, no torchrun); returns its checkpoint directory."""
    run_dir, ckpt = base / name, checkpoint_dir or base / name / "checkpoints"
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as mp_:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp_.delenv(var, raising=False)
        main(
            [
                "--job-id",
                name,
                "--spec",
                str(run_dir / "spec.json"),
                "--run-dir",
                str(run_dir),
                "--checkpoint-dir",
                str(ckpt),
            ]
        )
    return ckpt


def _initial(recipe: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(99)
    builder = {"cnn_bn": cnn_bn.build, "lstm_lm": lstm_lm.build}[recipe]
    return builder({"dataset_size": 64}, 99).model.state_dict()


def _load(ckpt: Path, step: int) -> dict[str, Any]:
    return cast(
        dict[str, Any], torch.load(ckpt / checkpoint_name(step), weights_only=True, map_location="cpu")
    )


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoint dirs of cnn_bn and lstm_lm, off and on, plus a cnn_bn run resumed from step 3 (on)."""
    base = tmp_path_factory.mktemp("ckpt-in-process")
    dirs = {
        f"{recipe}-{'on' if on else 'off'}": _main(
            base, f"{recipe}-{on}", _spec(recipe, on, every_steps=STEPS // 2)
        )
        for recipe in ("cnn_bn", "lstm_lm")
        for on in (False, True)
    }
    resumed = base / "resumed-checkpoints"
    resumed.mkdir()
    src = dirs["cnn_bn-on"] / checkpoint_name(STEPS // 2)
    for path in (src, CheckpointManager.sidecar_for(src)):
        shutil.copy(path, resumed / path.name)
    dirs["cnn_bn-resumed"] = _main(base, "resumed", _spec("cnn_bn", True), checkpoint_dir=resumed)
    return dirs


class TestWorld1InProcess:
    def test_cnn_bn_parameters_and_running_stats_are_unchanged(self, in_process: dict[str, Path]) -> None:
        off, on = (
            _load(in_process["cnn_bn-off"], STEPS)["model"],
            _load(in_process["cnn_bn-on"], STEPS)["model"],
        )
        _assert_same(off, on, "cnn_bn world 1, checkpointing on vs off (params and running stats)")
        # One running-stat update per forward, not two: the recompute in backward is side-effect free.
        for key in ("1.num_batches_tracked", "4.num_batches_tracked"):
            assert int(on[key]) == STEPS, f"expected {key} == {STEPS}, got {int(on[key])}"

    def test_lstm_lm_parameters_are_unchanged(self, in_process: dict[str, Path]) -> None:
        off, on = (
            _load(in_process["lstm_lm-off"], STEPS)["model"],
            _load(in_process["lstm_lm-on"], STEPS)["model"],
        )
        diff = _max_diff(off, on)
        print(f"lstm_lm world 1: checkpointing on vs off, max |param diff| = {diff:.3g}")
        moved = _max_diff(off, _initial("lstm_lm"))
        assert moved > 1e-4, f"expected training to move the parameters by > 1e-4, got {moved:.3g}"
        assert diff <= LSTM_TOLERANCE, f"expected max |param diff| <= {LSTM_TOLERANCE}, got {diff:.3g}"

    def test_resume_with_checkpointing_is_bitwise_exact(self, in_process: dict[str, Path]) -> None:
        full, resumed = _load(in_process["cnn_bn-on"], STEPS), _load(in_process["cnn_bn-resumed"], STEPS)
        assert resumed["iter"] == STEPS, f"expected iter {STEPS}, got {resumed['iter']}"
        _assert_same(full["model"], resumed["model"], "cnn_bn resumed from step 3 vs uninterrupted")
        bare = cnn_bn.build_model(CnnBnParams())
        assert set(full["model"]) == set(bare.state_dict()), (
            f"expected plain keys, got {sorted(full['model'])}"
        )


# ---- the policy, on bare modules ---------------------------------------------------------------------------


class TestPolicy:
    def test_segments(self) -> None:
        for n, expected in [(1, [(0, 1)]), (5, [(0, 2), (2, 5)]), (9, [(0, 3), (3, 6), (6, 9)])]:
            got = segment_bounds(n)
            assert got == expected, f"segment_bounds({n}): expected {expected}, got {got}"

    def test_default_and_recipe_policies(self) -> None:
        model = lstm_lm.build_model(LstmLmParams())
        names = dict(model.named_parameters())
        got = checkpoint_activations(model)
        expected = ["embedding", "lstm (in time chunks)", "head"]
        assert got == expected, f"expected every child with parameters, {expected}, got {got}"
        assert dict(model.named_parameters()) == names, "expected parameter names and objects unchanged"
        plan = lstm_lm.build({}, 0)
        got = checkpoint_activations(plan.model, plan.checkpoint_modules)
        assert got == ["lstm (in time chunks)"], (
            f"expected the recipe's policy to pick only the LSTM, got {got}"
        )
        again = checkpoint_activations(plan.model, plan.checkpoint_modules)
        assert again == got, f"expected a second call to change nothing, got {again}"

    def test_sync_batchnorm_is_never_recomputed(self) -> None:
        model = convert_sync_batchnorm(cnn_bn.build_model(CnnBnParams()), torch.device("cpu"))
        got = checkpoint_activations(model)
        assert got == [], f"expected no segment holding a SyncBatchNorm to be checkpointed, got {got}"

    def test_dropout_rng_is_replayed(self) -> None:
        def grads(ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
            torch.manual_seed(5)
            layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.Dropout(0.5) for i in range(9)]
            model = nn.Sequential(*layers)
            if ckpt:
                checkpoint_activations(model)
            out = model(torch.randn(4, 8))
            out.square().sum().backward()
            return out.detach(), [p.grad for p in model.parameters() if p.grad is not None]

        (out0, g0), (out1, g1) = grads(False), grads(True)
        assert torch.equal(out0, out1), "expected the same dropout masks in the checkpointed forward"
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True)), "expected bitwise-equal grads"

    @pytest.mark.parametrize("per_module", [False, True], ids=["segments", "per-module"])
    def test_copies_recompute_their_own_modules(self, per_module: bool) -> None:
        # A deep copy's (re)compute must use the copy's weights and buffers, never the original's.
        model = cnn_bn.build_model(CnnBnParams())
        checkpoint_activations(model, (lambda m: isinstance(m, nn.BatchNorm2d)) if per_module else None)
        twin = copy.deepcopy(model)
        twin(torch.randn(4, 3, 8, 8)).sum().backward()
        counts = [int(b) for n, b in twin.named_buffers() if n.endswith("num_batches_tracked")]
        assert counts == [1, 1], f"expected each copy BatchNorm updated once, got {counts}"
        original = [int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
        assert original == [0, 0], f"expected the original untouched, got {original}"
        with torch.no_grad():
            for p in twin.parameters():
                p.zero_()
        out = twin(torch.randn(2, 3, 8, 8))
        assert torch.equal(out, torch.zeros(2, 10)), (
            f"expected the copy's zeroed weights to give 0, got {out}"
        )


# ---- gradients as bucket views (world 2, spawned gloo group) -----------------------------------------------


def _bucket_worker(rank: int, world: int, out_dir: str) -> None:
    results: dict[bool, list[tuple[dict[str, bool], int]]] = {}
    for ckpt in (False, True):
        spec = _spec("mlp", ckpt)
        spec["hyperparameters"]["num_layers"] = NUM_LAYERS
        spec["engine"]["bucket_cap_mb"] = 0.01  # several buckets, so a grad is checked against its own
        torch.manual_seed(0)
        plan = mlp.build({"dataset_size": 64, "num_layers": NUM_LAYERS}, 0)
        env = distributed.DistEnv(rank=rank, world_size=2, launched=True)
        cfg = JobSpec.model_validate(spec)
        # No events or checkpoints: only wrap() and forward/backward run here.
        local = cfg.local_batch_size(env.world_size)
        trainer = Trainer(
            cfg, plan, env, torch.device("cpu"), cast(Any, None), cast(Any, None), local_batch_size=local
        )
        trainer.wrap()
        buckets: dict[int, int] = {}  # id(param) -> data_ptr of the storage of its bucket's flat buffer

        # Unannotated on purpose: DDP refuses a hook whose bucket annotation is not dist.GradBucket, and
        # under `from __future__ import annotations` every annotation is a string.
        def hook(state, bucket, buckets=buckets):  # type: ignore[no-untyped-def]
            for p in bucket.parameters():
                buckets[id(p)] = bucket.buffer().untyped_storage().data_ptr()
            return allreduce_hook(state, bucket)  # DDP's own allreduce-and-average

        cast(DistributedDataParallel, trainer.train_model).register_comm_hook(None, hook)
        checks = []
        for it in range(2):  # the second backward follows zero_grad(set_to_none=True)
            buckets.clear()
            x, y = trainer.data.dataset.batch(
                trainer.data.sampler.local_indices(it, rank, local), trainer.device
            )
            trainer._loss((x, y)).backward()
            in_bucket = {
                n: p.grad is not None and p.grad.untyped_storage().data_ptr() == buckets.get(id(p))
                for n, p in trainer.model.named_parameters()
            }
            checks.append((in_bucket, len(set(buckets.values()))))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        results[ckpt] = checks
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.e2e
def test_gradients_are_views_of_ddp_buckets_at_world_2(tmp_path: Path) -> None:
    spawn_gloo(_bucket_worker, 2, str(tmp_path))
    for rank in range(2):
        for ckpt, checks in torch.load(tmp_path / f"rank{rank}.pt").items():
            for it, (check, n_buckets) in enumerate(checks):
                where = f"rank {rank} checkpointing={ckpt} backward {it}"
                assert it == 0 or n_buckets > 1, f"{where}: expected several buckets, got {n_buckets}"
                apart = [n for n, same in check.items() if not same]
                assert not apart, f"{where}: expected every .grad in its bucket's storage, not: {apart}"


# ---- the benchmark ---------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_benchmark_smoke_saves_less_for_backward(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.memory", "--smoke", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"expected bench.memory --smoke to exit 0, got {proc.returncode}\n{proc.stderr}"
    )
    print(proc.stdout)
    results = {r["recipe"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"mlp", "lstm_lm", "cnn_bn"}, f"expected all three recipes, got {sorted(results)}"
    for recipe, r in results.items():
        off, on = r["off"]["saved_bytes"], r["on"]["saved_bytes"]
        assert 0 < on < off, (
            f"{recipe}: expected fewer bytes saved for backward with checkpointing, {off} -> {on}"
        )
        assert r["on"]["checkpointed"], f"{recipe}: expected something checkpointed, got {r['on']}"
