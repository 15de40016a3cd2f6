"""A spec's data paths at submit, where the API host has the data root (DPTRAIN_DATA_ROOT): a path
that is missing, of the wrong type, or leads out of the root through a symbolic link is a 422 naming
the field; without a data root the API takes any path the spec's own rules allow."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from tests.conftest import job_spec

GPT: dict[str, Any] = job_spec(name="gpt", recipe="gpt", hyperparameters={"global_batch_size": 8, "steps": 2})
MLP: dict[str, Any] = job_spec(name="mlp", hyperparameters={"global_batch_size": 8, "steps": 2})
TRAIN_PATH = ("body", "data", "train", "token_file", "path")


def tokens(path: str, **more: Any) -> dict[str, Any]:
    """A `data` section that trains from the token file `path`."""
    return {"train": {"kind": "token_file", "path": path, **more}}


def shards(path: str) -> dict[str, Any]:
    """A `data` section that trains from the shard directory `path`."""
    return {"train": {"kind": "shards", "path": path}}


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    """A data root holding tok/train.bin and shards/; beside it, outside/ holds what no job may read."""
    root = tmp_path / "data"
    (root / "tok").mkdir(parents=True)
    (root / "tok" / "train.bin").write_bytes(bytes(64))
    (root / "shards").mkdir()
    (root / "shards" / "0.npy").write_bytes(b"")
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.bin").write_bytes(bytes(64))
    return root


@pytest.fixture
def settings(settings: Settings, data_root: Path) -> Settings:
    """The API host has the data root, resolved as Settings resolves DPTRAIN_DATA_ROOT."""
    return settings.model_copy(update={"data_root": data_root.resolve()})


def refusal(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """The one error of a refused submit; nothing was stored."""
    stored = len(client.get("/v1/jobs").json()["items"])
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, f"expected 422, got {r.status_code}: {r.text}"
    (error,) = r.json()["detail"]
    assert len(client.get("/v1/jobs").json()["items"]) == stored, "a refused spec must not be stored"
    return dict(error)


def test_an_existing_token_file_and_shard_directory_are_accepted(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=job_spec(GPT, data=tokens("tok/train.bin")))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["data"]["train"]["path"] == "tok/train.bin"
    r = client.post("/v1/jobs", json=job_spec(MLP, data=shards("shards")))
    assert r.status_code == 201, r.text


def test_a_symlink_that_stays_inside_the_root_is_accepted(client: TestClient, data_root: Path) -> None:
    (data_root / "current.bin").symlink_to(data_root / "tok" / "train.bin")
    r = client.post("/v1/jobs", json=job_spec(GPT, data=tokens("current.bin")))
    assert r.status_code == 201, r.text


def test_a_missing_file_is_422_at_its_path(client: TestClient) -> None:
    error = refusal(client, job_spec(GPT, data=tokens("tok/val.bin")))
    assert error["loc"] == list(TRAIN_PATH), error
    assert error["msg"] == "no such file in the data root (DPTRAIN_DATA_ROOT)", error
    assert error["input"] == "tok/val.bin", error


def test_a_missing_eval_file_is_422_at_the_eval_path(client: TestClient) -> None:
    data = {**tokens("tok/train.bin"), "eval": {"kind": "token_file", "path": "tok/val.bin"}}
    error = refusal(client, job_spec(GPT, data=data, evaluation={"every_steps": 1}))
    assert error["loc"] == ["body", "data", "eval", "token_file", "path"], error
    assert "no such file" in error["msg"], error


def test_a_symlink_out_of_the_root_is_422_saying_it_leads_out(client: TestClient, data_root: Path) -> None:
    (data_root / "tok" / "leak.bin").symlink_to(data_root.parent / "outside" / "secret.bin")
    error = refusal(client, job_spec(GPT, data=tokens("tok/leak.bin")))
    assert error["loc"] == list(TRAIN_PATH), error
    assert "leads out of the data root" in error["msg"], error


def test_a_symlinked_directory_out_of_the_root_is_422_too(client: TestClient, data_root: Path) -> None:
    (data_root / "elsewhere").symlink_to(data_root.parent / "outside", target_is_directory=True)
    error = refusal(client, job_spec(GPT, data=tokens("elsewhere/secret.bin")))
    assert error["loc"] == list(TRAIN_PATH) and "leads out" in error["msg"], error
    error = refusal(client, job_spec(MLP, data=shards("elsewhere/dir")))
    assert error["loc"] == ["body", "data", "train", "shards", "path"] and "leads out" in error["msg"], error


def test_a_symlink_loop_is_422_not_500(client: TestClient, data_root: Path) -> None:
    (data_root / "a.bin").symlink_to(data_root / "b.bin")
    (data_root / "b.bin").symlink_to(data_root / "a.bin")
    error = refusal(client, job_spec(GPT, data=tokens("a.bin")))
    assert error["loc"] == list(TRAIN_PATH), error
    assert "cannot be resolved" in error["msg"], error
    assert str(data_root) not in error["msg"], "the message does not show the server's own paths"


def test_a_token_file_naming_a_directory_is_422(client: TestClient) -> None:
    error = refusal(client, job_spec(GPT, data=tokens("tok")))
    assert error["loc"] == list(TRAIN_PATH), error
    assert error["msg"] == "no such file in the data root (DPTRAIN_DATA_ROOT)", error


def test_shards_naming_a_file_is_422(client: TestClient) -> None:
    error = refusal(client, job_spec(MLP, data=shards("tok/train.bin")))
    assert error["loc"] == ["body", "data", "train", "shards", "path"], error
    assert error["msg"] == "no such directory in the data root (DPTRAIN_DATA_ROOT)", error


def test_without_a_data_root_any_lexically_valid_path_is_accepted(
    client: TestClient, settings: Settings
) -> None:
    client.app.state.settings = settings.model_copy(update={"data_root": None})  # type: ignore[attr-defined]
    r = client.post("/v1/jobs", json=job_spec(GPT, data=tokens("nowhere/train.bin")))
    assert r.status_code == 201, r.text
    error = refusal(client, job_spec(GPT, name="abs", data=tokens("/etc/passwd")))
    assert error["loc"] == list(TRAIN_PATH) and "not absolute" in error["msg"], "the spec's rules still hold"


def test_a_data_root_the_api_host_lacks_is_left_to_the_workers(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    # The workers' data root is the one that counts; an API host without it cannot check anything.
    client.app.state.settings = settings.model_copy(update={"data_root": tmp_path / "not-here"})  # type: ignore[attr-defined]
    r = client.post("/v1/jobs", json=job_spec(GPT, data=tokens("nowhere/train.bin")))
    assert r.status_code == 201, r.text


def test_an_empty_data_root_setting_means_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DPTRAIN_DATA_ROOT", "")
    assert Settings(home=tmp_path).data_root is None, "not the current directory"
    monkeypatch.delenv("DPTRAIN_DATA_ROOT")
    assert Settings(home=tmp_path).data_root is None


def test_the_data_root_setting_is_resolved(monkeypatch: pytest.MonkeyPatch, data_root: Path) -> None:
    link = data_root.parent / "data-link"
    link.symlink_to(data_root, target_is_directory=True)
    monkeypatch.setenv("DPTRAIN_DATA_ROOT", os.fspath(link))
    assert Settings(home=data_root.parent).data_root == data_root.resolve()
