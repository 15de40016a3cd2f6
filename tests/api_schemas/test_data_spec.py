"""The spec's `data` section (DataLoader options, data files under the data root): what it refuses is a
422 naming the field and saying what is wrong, never a 500; what it accepts is stored as given and
validates again from what the job stores (placement and the engine read that)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api_schemas import JobSpec
from service.config import Settings
from tests.conftest import job_spec

JSON = {"Content-Type": "application/json"}
MLP: dict[str, Any] = job_spec(name="mlp", hyperparameters={"global_batch_size": 8, "steps": 2})
GPT: dict[str, Any] = job_spec(name="gpt", recipe="gpt", hyperparameters={"global_batch_size": 8, "steps": 2})
PLAN: dict[str, Any] = {"name": "plan", "entrypoint": "examples.custom_plan:build"}
COMMAND: dict[str, Any] = {"name": "cmd", "command": ["python", "train.py"]}
TOKENS: dict[str, Any] = {"kind": "token_file", "path": "tok/train.bin"}
SHARDS: dict[str, Any] = {"kind": "shards", "path": "shards/train"}
TRAIN_PATH = ("body", "data", "train", "token_file", "path")
SEGMENTS = "'.' or '..' segments"
CHARSET = "each starting with a letter, digit or '_'"


def tokens(path: str, **more: Any) -> dict[str, Any]:
    """A `data` section that trains from the token file `path`."""
    return {"train": {**TOKENS, "path": path, **more}}


# (case, body, loc, what the message says)
CASES: list[tuple[str, dict[str, Any], tuple[str | int, ...], str]] = [
    ("an absolute path", job_spec(GPT, data=tokens("/etc/passwd")), TRAIN_PATH, "not absolute"),
    ("a path up and out", job_spec(GPT, data=tokens("a/../../etc/passwd")), TRAIN_PATH, SEGMENTS),
    ("a path starting with ..", job_spec(GPT, data=tokens("../x.bin")), TRAIN_PATH, SEGMENTS),
    ("a . segment", job_spec(GPT, data=tokens("tok/./train.bin")), TRAIN_PATH, SEGMENTS),
    ("a lone ..", job_spec(GPT, data=tokens("..")), TRAIN_PATH, SEGMENTS),
    ("a hidden name", job_spec(GPT, data=tokens(".cache/x.bin")), TRAIN_PATH, CHARSET),
    ("a backslash", job_spec(GPT, data=tokens("a\\..\\b")), TRAIN_PATH, CHARSET),
    ("an empty segment", job_spec(GPT, data=tokens("tok//train.bin")), TRAIN_PATH, CHARSET),
    ("a trailing slash", job_spec(GPT, data=tokens("tok/")), TRAIN_PATH, CHARSET),
    ("a trailing newline", job_spec(GPT, data=tokens("tok/train.bin\n")), TRAIN_PATH, CHARSET),
    ("a space", job_spec(GPT, data=tokens("my data.bin")), TRAIN_PATH, CHARSET),
    ("an empty path", job_spec(GPT, data=tokens("")), TRAIN_PATH, "at least 1 character"),
    ("an over-long path", job_spec(GPT, data=tokens("a/" * 512 + "b")), TRAIN_PATH, "at most 1024"),
    (
        "a path of another type",
        job_spec(GPT, data={"train": {**TOKENS, "path": 7}}),
        TRAIN_PATH,
        "valid string",
    ),
    (
        "an absolute shard directory",
        job_spec(MLP, data={"train": {**SHARDS, "path": "/data"}}),
        ("body", "data", "train", "shards", "path"),
        "not absolute",
    ),
    (
        "an eval path up and out",
        job_spec(GPT, data={**tokens("tok/train.bin"), "eval": {**TOKENS, "path": "../val.bin"}}),
        ("body", "data", "eval", "token_file", "path"),
        SEGMENTS,
    ),
    (
        "an unknown kind",
        job_spec(GPT, data={"train": {"kind": "csv", "path": "a.csv"}}),
        ("body", "data", "train"),
        "'csv' found using 'kind' does not match any of the expected tags: 'token_file', 'shards'",
    ),
    (
        "no kind",
        job_spec(GPT, data={"train": {"path": "a.bin"}}),
        ("body", "data", "train"),
        "Unable to extract tag using discriminator 'kind'",
    ),
    (
        "a token dtype that is not unsigned",
        job_spec(GPT, data=tokens("a.bin", dtype="int16")),
        ("body", "data", "train", "token_file", "dtype"),
        "'uint16' or 'uint32'",
    ),
    (
        "a block size of 0",
        job_spec(PLAN, data=tokens("a.bin", block_size=0)),
        ("body", "data", "train", "token_file", "block_size"),
        "greater than or equal to 1",
    ),
    (
        "a block size on shards",
        job_spec(MLP, data={"train": {**SHARDS, "block_size": 8}}),
        ("body", "data", "train", "shards", "block_size"),
        "Extra inputs",
    ),
    (
        "an unknown data option",
        job_spec(MLP, data={"shuffle": True}),
        ("body", "data", "shuffle"),
        "Extra inputs",
    ),
    (
        "prefetch_factor without loader processes",
        job_spec(MLP, data={"prefetch_factor": 2}),
        ("body", "data", "prefetch_factor"),
        "prefetch_factor needs data.num_workers > 0",
    ),
    (
        "persistent_workers without loader processes",
        job_spec(MLP, data={"num_workers": 0, "persistent_workers": True}),
        ("body", "data", "persistent_workers"),
        "persistent_workers needs data.num_workers > 0",
    ),
    (
        "pinned memory on a cpu job",
        job_spec(MLP, data={"pin_memory": True}),
        ("body", "data", "pin_memory"),
        "a cpu job has none",
    ),
    (
        "num_workers past its bound",
        job_spec(MLP, data={"num_workers": 65}),
        ("body", "data", "num_workers"),
        "less than or equal to 64",
    ),
    (
        "negative num_workers",
        job_spec(MLP, data={"num_workers": -1}),
        ("body", "data", "num_workers"),
        "greater than or equal to 0",
    ),
    (
        "num_workers as text",
        job_spec(MLP, data={"num_workers": "2"}),
        ("body", "data", "num_workers"),
        "valid integer",
    ),
    (
        "num_workers true",
        job_spec(MLP, data={"num_workers": True}),
        ("body", "data", "num_workers"),
        "valid integer",
    ),
    (
        "num_workers 2.0",
        job_spec(MLP, data={"num_workers": 2.0}),
        ("body", "data", "num_workers"),
        "valid integer",
    ),
    (
        "prefetch_factor 0",
        job_spec(MLP, data={"num_workers": 2, "prefetch_factor": 0}),
        ("body", "data", "prefetch_factor"),
        "greater than or equal to 1",
    ),
    (
        "pin_memory as 1",
        job_spec(MLP, resources={"device": "cuda"}, data={"pin_memory": 1}),
        ("body", "data", "pin_memory"),
        "valid boolean",
    ),
    (
        "a command with loader options",
        {**COMMAND, "data": {"num_workers": 2}},
        ("body", "data"),
        "a command loads its own data (its files are under $DPTRAIN_DATA_ROOT); leave out data.num_workers",
    ),
    (
        "a command with a data file",
        {**COMMAND, "data": {"train": SHARDS}},
        ("body", "data"),
        "leave out data.train",
    ),
    (
        "eval data without training data",
        job_spec(GPT, data={"eval": TOKENS}),
        ("body", "data", "eval"),
        "data.eval needs data.train",
    ),
    (
        "a plan's eval data without training data",
        {**PLAN, "data": {"eval": {**TOKENS, "block_size": 8}}},
        ("body", "data", "eval"),
        "data.eval needs data.train",
    ),
    (
        "files for a recipe that makes its own data",
        job_spec(MLP, recipe="cnn_bn", data={"train": SHARDS}),
        ("body", "data", "train", "kind"),
        "recipe 'cnn_bn' makes its own data and reads no files",
    ),
    (
        "a token file for mlp",
        job_spec(MLP, data={"train": TOKENS}),
        ("body", "data", "train", "kind"),
        "recipe 'mlp' reads shards",
    ),
    (
        "a token file for mlp's evaluation",
        job_spec(MLP, data={"train": SHARDS, "eval": TOKENS}, evaluation={"every_steps": 1}),
        ("body", "data", "eval", "kind"),
        "recipe 'mlp' reads shards",
    ),
    (
        "shards for gpt",
        job_spec(GPT, data={"train": SHARDS}),
        ("body", "data", "train", "kind"),
        "recipe 'gpt' reads token_file",
    ),
    (
        "a gpt block size other than its seq_len",
        job_spec(GPT, hyperparameters={"seq_len": 32}, data=tokens("a.bin", block_size=64)),
        ("body", "data", "train", "block_size"),
        "recipe 'gpt' reads windows of its seq_len (32) tokens; leave block_size out",
    ),
    (
        "a plan's token file without a block size",
        {**PLAN, "data": {"train": TOKENS}},
        ("body", "data", "train", "block_size"),
        "a plan's token_file needs block_size (tokens per sample)",
    ),
    (
        "evaluating a recipe trained from files without eval data",
        job_spec(GPT, data={"train": TOKENS}, evaluation={"every_steps": 5}),
        ("body", "data", "eval"),
        "evaluating a recipe that trains from files needs data.eval",
    ),
]

# Accepted, each stored with its `data` as given.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("gpt from a token file", job_spec(GPT, data={"train": TOKENS})),
    (
        "gpt with a block size equal to its seq_len",
        job_spec(GPT, hyperparameters={"seq_len": 32}, data=tokens("a.bin", block_size=32)),
    ),
    (
        "gpt evaluated on its own eval file",
        job_spec(
            GPT,
            data={"train": TOKENS, "eval": {**TOKENS, "path": "tok/val.bin"}},
            evaluation={"every_steps": 5},
        ),
    ),
    (
        "a plan's token file with a block size",
        {**PLAN, "data": {"train": {**TOKENS, "dtype": "uint32", "block_size": 128}}},
    ),
    # A plan may evaluate on a dataset of its own, beside a token file it trains from.
    ("a plan evaluated without eval data", {**PLAN, "data": tokens("a.bin", block_size=8), "evaluation": {}}),
    ("mlp from shards", job_spec(MLP, data={"train": SHARDS})),
    (
        "mlp evaluated on its own shards",
        job_spec(MLP, data={"train": SHARDS, "eval": {**SHARDS, "path": "shards/val"}}, evaluation={}),
    ),
    (
        "loader processes, prefetch and persistence",
        job_spec(MLP, data={"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True}),
    ),
    ("pinned memory on a cuda job", job_spec(MLP, resources={"device": "cuda"}, data={"pin_memory": True})),
    ("no pinned memory on a cpu job", job_spec(MLP, data={"pin_memory": False})),
    ("a recipe that makes its own data, with loader options", job_spec(MLP, data={"num_workers": 1})),
    ("a path of every allowed character", job_spec(GPT, data=tokens("_a/B-1.2+x=y@z,w/t.bin"))),
    ("a path of 1024 characters", job_spec(GPT, data=tokens("a/" * 511 + "bc"))),
    ("a command", COMMAND),
    ("a command with data at its defaults", {**COMMAND, "data": {"num_workers": 0, "pin_memory": None}}),
]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The example plans' module prefix is allowed, so a plan's spec can be accepted."""
    return settings.model_copy(update={"allowed_entrypoints": "examples"})


@pytest.mark.parametrize(("case", "body", "loc", "reason"), CASES, ids=[c[0] for c in CASES])
def test_an_invalid_data_section_is_422_naming_the_field_and_the_reason(
    client: TestClient, case: str, body: dict[str, Any], loc: tuple[str | int, ...], reason: str
) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, f"{case}: expected 422, got {r.status_code}: {r.text}"
    errors = r.json()["detail"]
    assert [tuple(e["loc"]) for e in errors] == [loc], f"{case}: expected one error at {loc}: {errors}"
    assert reason in errors[0]["msg"], f"{case}: expected {reason!r} in {errors[0]['msg']!r}"
    assert client.get("/v1/jobs").json()["items"] == [], "a refused spec must not be stored"


def test_the_model_refuses_a_nul_in_a_data_path_at_the_path() -> None:
    # Through the API the JSON layer refuses NUL anywhere first (the next test); the engine reads
    # spec.json with the model, whose pattern refuses it as well.
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(job_spec(GPT, data=tokens("tok/a\x00b.bin")))
    (error,) = refused.value.errors()
    assert error["loc"] == TRAIN_PATH[1:] and CHARSET in error["msg"], error


def test_a_nul_in_a_data_path_through_the_api_is_string_nul(client: TestClient) -> None:
    body = '{"name": "x", "recipe": "gpt", "data": {"train": {"kind": "token_file", "path": "a\\u0000b"}}}'
    r = client.post("/v1/jobs", content=body, headers=JSON)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert (error["loc"], error["type"]) == (["body", "data", "train", "path"], "string_nul"), error


@pytest.mark.parametrize(("case", "body"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_a_valid_data_section_is_accepted_and_stored_as_given(
    client: TestClient, case: str, body: dict[str, Any]
) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, f"{case}: {r.text}"
    job = r.json()
    assert job["error"] is None, f"{case}: the stored spec must validate again: {job['error']}"
    stored = job["spec"]["data"]
    for name, value in body.get("data", {}).items():
        got = {k: stored[name][k] for k in value} if isinstance(value, dict) else stored[name]
        assert got == value, f"{case}: data.{name} stored as {stored[name]!r}"
    shown = client.get(f"/v1/jobs/{job['id']}").json()
    assert shown["error"] is None and shown["spec"]["data"] == stored, shown


@pytest.mark.parametrize(("case", "body"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_an_accepted_spec_validates_again_from_its_stored_form(case: str, body: dict[str, Any]) -> None:
    # The job stores the spec with every default filled in; placement, the job's page and the ranks'
    # spec.json validate that again, so a rule that depends on which fields were given breaks them.
    spec = JobSpec.model_validate(body)
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec, case
