"""Data files under the data root: token files, shard directories, the paths that may name them, and
the `gpt` recipe and a plan trained from a token file at world 1 and 2."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from api_schemas import JobSpec
from dptrain import BuildContext
from dptrain.data import DataPathError, Shards, TokenFile, data_path
from tests.engine_fixtures import EngineRun, Launches, train_in_process
from workers.engine.recipes import RECIPES, plan_params
from workers.engine.recipes.mlp import ShardPairs
from workers.engine.spec_datasets import open_spec_data

ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "tests.fixtures"}
SGD_TOLERANCE = 1e-6


def _token_file(path: Path, tokens: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return path


# ---- TokenFile -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_windows_are_the_file_slices_at_their_offsets(tmp_path: Path, dtype: str) -> None:
    tokens = (np.arange(1000) * 7 % 50_000).astype(dtype)
    data = TokenFile(_token_file(tmp_path / "t.bin", tokens), block_size=16, dtype=dtype)
    assert len(data) == (1000 - 17) // 16 + 1
    for i in (0, 5, len(data) - 1):
        x, y = data[i]
        want = torch.from_numpy(tokens[i * 16 : i * 16 + 17].astype(np.int64))
        assert torch.equal(x, want[:-1]) and torch.equal(y, want[1:]) and x.dtype == torch.int64
    # batch() gathers the same windows in one read as item by item.
    idx = torch.tensor([3, 0, 57, 3])
    xs, ys = data.batch(idx, torch.device("cpu"))
    assert torch.equal(xs, torch.stack([data[int(i)][0] for i in idx]))
    assert torch.equal(ys, torch.stack([data[int(i)][1] for i in idx]))


def test_a_smaller_stride_gives_overlapping_windows(tmp_path: Path) -> None:
    data = TokenFile(_token_file(tmp_path / "t.bin", np.arange(40, dtype=np.uint16)), block_size=8, stride=3)
    assert len(data) == (40 - 9) // 3 + 1
    assert data[2][0].tolist() == list(range(6, 14))


def test_bad_token_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 11)
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        TokenFile(odd, block_size=2)
    short = _token_file(tmp_path / "short.bin", np.arange(8, dtype=np.uint16))
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenFile(short, block_size=8)
    with pytest.raises(ValueError, match="token dtype"):
        TokenFile(short, block_size=2, dtype="int8")
    with pytest.raises(FileNotFoundError, match="not a file"):
        TokenFile(tmp_path, block_size=2)


def test_a_token_past_the_vocabulary_names_its_sample(tmp_path: Path) -> None:
    tokens = np.zeros(100, dtype=np.uint16)
    tokens[45] = 70  # in window 5 of block 8 (tokens 40..48)
    data = TokenFile(_token_file(tmp_path / "t.bin", tokens), block_size=8, vocab_size=64)
    data.batch(torch.tensor([0, 1, 2]), torch.device("cpu"))
    with pytest.raises(ValueError, match="sample 5: token 70 of t.bin is not below vocab_size 64"):
        data.batch(torch.tensor([1, 5]), torch.device("cpu"))


def test_a_token_file_pickles_without_its_mapped_tokens(tmp_path: Path) -> None:
    data = TokenFile(
        _token_file(tmp_path / "t.bin", np.arange(200_000, dtype=np.uint32)), block_size=4, dtype="uint32"
    )
    data[0]  # maps the file
    copy = pickle.loads(pickle.dumps(data))  # what a spawn-started loader process receives
    assert len(pickle.dumps(data)) < 10_000
    assert torch.equal(copy[7][0], data[7][0])


# ---- paths under the data root ---------------------------------------------------------------------------


def test_data_paths_stay_inside_the_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    _token_file(root / "owt" / "train.bin", np.arange(10, dtype=np.uint16))
    _token_file(outside / "secret.bin", np.arange(10, dtype=np.uint16))
    (root / "escape.bin").symlink_to(outside / "secret.bin")
    (root / "inside.bin").symlink_to(root / "owt" / "train.bin")
    (root / "loop.bin").symlink_to(root / "loop.bin")
    monkeypatch.delenv("DPTRAIN_DATA_ROOT", raising=False)
    with pytest.raises(DataPathError, match="no data root"):
        data_path("owt/train.bin")
    monkeypatch.setenv("DPTRAIN_DATA_ROOT", str(root))
    assert data_path("owt/train.bin") == (root / "owt" / "train.bin").resolve()
    assert data_path("inside.bin") == (root / "owt" / "train.bin").resolve()  # a link that stays inside
    for bad, why in [
        ("escape.bin", "leads out of the data root"),
        ("../outside/secret.bin", "leads out of the data root"),
        (str(outside / "secret.bin"), "is absolute"),
        ("loop.bin", "cannot be resolved"),
    ]:
        with pytest.raises(DataPathError, match=why):
            data_path(bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        data_path("owt/val.bin")


# ---- Shards --------------------------------------------------------------------------------------------


def _shards(root: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """Three shards of one directory: two .pt dicts and one .npy pair... as a tuple .pt, 10 samples."""
    d = root / "shards"
    d.mkdir(parents=True)
    x = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    y = torch.arange(10) % 3
    torch.save({"inputs": x[:3].clone(), "targets": y[:3].clone()}, d / "a.pt")
    torch.save({"inputs": x[3:7].clone(), "targets": y[3:7].clone()}, d / "b.pt")
    torch.save({"inputs": x[7:].clone(), "targets": y[7:].clone()}, d / "c.pt")
    (d / "README").write_text("not a shard")
    return d, x, y


def test_shards_are_the_rows_of_every_file_in_name_order(tmp_path: Path) -> None:
    d, x, y = _shards(tmp_path)
    data = Shards(d, open_shards=1)  # one mapped at a time: every read below reopens another shard
    assert len(data) == 10 and [f.name for f in data.files] == ["a.pt", "b.pt", "c.pt"]
    for i in (9, 0, 4, 3, 7, 2):
        item = data[i]
        assert torch.equal(item["inputs"], x[i]) and int(item["targets"]) == int(y[i])
    with pytest.raises(IndexError):
        data[10]
    assert len(pickle.loads(pickle.dumps(data))) == 10


def test_npy_shards_and_bad_directories(tmp_path: Path) -> None:
    d = tmp_path / "npy"
    d.mkdir()
    np.save(d / "0.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    np.save(d / "1.npy", np.arange(4, dtype=np.float32).reshape(2, 2))
    data = Shards(d)
    assert len(data) == 8 and data[7].tolist() == [2.0, 3.0] and data[0].dtype == torch.float32
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no .pt or .npy file"):
        Shards(empty)
    with pytest.raises(NotADirectoryError):
        Shards(d / "0.npy")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    torch.save({"inputs": torch.zeros(3, 2), "targets": torch.zeros(4)}, mixed / "a.pt")
    with pytest.raises(ValueError, match="sharing their first"):
        Shards(mixed)


def test_mlp_trains_from_shards_and_checks_their_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _, _ = _shards(tmp_path / "root")
    monkeypatch.setenv("DPTRAIN_DATA_ROOT", str(tmp_path / "root"))
    spec = JobSpec.model_validate(
        {
            "name": "shards",
            "recipe": "mlp",
            "hyperparameters": {"global_batch_size": 4, "steps": 3, "input_size": 4, "num_classes": 3},
            "data": {"train": {"kind": "shards", "path": "shards"}},
        }
    )
    ctx = BuildContext(
        device=torch.device("cpu"), world_size=1, rank=0, local_batch_size=4, data=open_spec_data(spec)
    )
    plan = RECIPES["mlp"](plan_params(spec), 0, ctx)  # type: ignore[call-arg]
    assert isinstance(plan.dataset, ShardPairs) and len(plan.dataset) == 10 and plan.eval_dataset is None
    x, y = plan.dataset[4]
    assert x.shape == (4,) and y.dim() == 0
    wrong = {**plan_params(spec), "input_size": 5}
    with pytest.raises(ValueError, match=r"expected floats of shape \(5,\)"):
        RECIPES["mlp"](wrong, 0, ctx)  # type: ignore[call-arg]
    # The engine's loop reads them through its loader (world 1, in this process, no loader processes).
    state = train_in_process(spec, plan, tmp_path / "run")
    assert state["iter"] == 3 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_the_spec_s_token_file_opens_with_the_recipe_s_window_and_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _token_file(tmp_path / "tok" / "train.bin", np.arange(300, dtype=np.uint16) % 48)
    monkeypatch.setenv("DPTRAIN_DATA_ROOT", str(tmp_path))
    spec = JobSpec.model_validate(
        {
            "name": "gpt-file",
            "recipe": "gpt",
            "hyperparameters": {"seq_len": 16, "vocab_size": 48},
            "data": {"train": {"kind": "token_file", "path": "tok/train.bin"}},
        }
    )
    opened = open_spec_data(spec)
    data = opened["train"]
    assert isinstance(data, TokenFile) and (data.block_size, data.vocab_size) == (16, 48)
    assert open_spec_data(JobSpec.model_validate({"name": "none", "recipe": "gpt"})) == {}


# ---- trained from files under torchrun ------------------------------------------------------------------

GPT = {"vocab_size": 48, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "optimizer": "sgd"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with a train and a val token file (a learnable progression mod 48, with noise)."""
    root = tmp_path_factory.mktemp("data-root")
    rng = np.random.default_rng(0)
    for name, n in (("train", 6000), ("val", 700)):
        tokens = (np.arange(n) * 5 + rng.integers(0, 3, n)) % GPT["vocab_size"]
        _token_file(root / "tok" / f"{name}.bin", tokens.astype(np.uint16))
    return root


def _final(run: EngineRun, step: int) -> dict[str, torch.Tensor]:
    assert run.returncode == 0, run.describe()
    return run.checkpoint(step)["model"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _evals(run: EngineRun) -> dict[int, float]:
    return {e["step"]: e["values"]["eval/loss"] for e in run.events(0) if "eval/loss" in e.get("values", {})}


@pytest.mark.e2e
def test_gpt_trains_from_a_token_file_alike_at_world_1_and_2(
    launched: Launches, make_spec: Any, data_root: Path
) -> None:
    spec = make_spec(
        recipe="gpt",
        hyperparameters={"global_batch_size": 8, "steps": 6, "lr": 0.1, **GPT},
        data={
            "train": {"kind": "token_file", "path": "tok/train.bin"},
            "eval": {"kind": "token_file", "path": "tok/val.bin"},
        },
        evaluation={"every_steps": 3, "batch_size": 8},
    )
    env = {"DPTRAIN_DATA_ROOT": str(data_root)}
    one, two = launched.torchrun(spec, 1, extra_env=env), launched.torchrun(spec, 2, extra_env=env)
    diff = _max_diff(_final(one, 6), _final(two, 6))
    assert diff <= SGD_TOLERANCE, f"gpt on a token file: world 1 and 2 differ by {diff}"
    # 700 val tokens: 42 windows of 17, six eval batches of 8 and one of 2, split 4/3 at world 2.
    ev1, ev2 = _evals(one), _evals(two)
    assert sorted(ev1) == [3, 6] and ev1.keys() == ev2.keys()
    assert all(abs(ev1[s] - ev2[s]) <= 1e-6 for s in ev1), (ev1, ev2)


@pytest.mark.e2e
def test_a_plan_reads_the_spec_s_token_file_through_loader_processes(
    launched: Launches, make_spec: Any, data_root: Path
) -> None:
    spec = make_spec(hyperparameters={"global_batch_size": 8, "steps": 5, "vocab_size": 48})
    spec.update(recipe=None, entrypoint="tests.fixtures.data_plans:from_files")
    spec["data"] = {"train": {"kind": "token_file", "path": "tok/train.bin", "block_size": 12}}
    env = {**ALLOWED, "DPTRAIN_DATA_ROOT": str(data_root)}
    one = launched.torchrun(spec, 1, extra_env=env)
    two = launched.torchrun({**spec, "data": {**spec["data"], "num_workers": 2}}, 2, extra_env=env)
    diff = _max_diff(_final(one, 5), _final(two, 5))
    assert diff <= SGD_TOLERANCE, f"world 1 (in the rank) and 2 (loader processes) differ by {diff}"


@pytest.mark.e2e
def test_a_path_out_of_the_data_root_fails_the_job_naming_it(
    engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.bin").symlink_to(_token_file(tmp_path / "elsewhere.bin", np.arange(100, dtype=np.uint16)))
    spec = make_spec(
        recipe="gpt",
        hyperparameters={"global_batch_size": 8, "steps": 2, **GPT},
        data={"train": {"kind": "token_file", "path": "link.bin"}},
    )
    run = engine_runner(spec, 1, extra_env={"DPTRAIN_DATA_ROOT": str(root)})
    assert run.returncode != 0
    errors = [e for e in run.events(0) if e["type"] == "error"]
    assert [e["error_type"] for e in errors] == ["DataPathError"], run.describe()
    assert "'link.bin' leads out of the data root" in errors[0]["message"]
