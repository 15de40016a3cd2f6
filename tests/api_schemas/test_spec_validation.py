"""Every invalid spec answers 422 naming the field path and the reason; nothing is queued."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api_schemas import RECIPES, JobSpec
from tests.conftest import job_spec

VALID: dict[str, Any] = job_spec(name="ok", hyperparameters={"global_batch_size": 8, "steps": 2})

CASES: list[tuple[str, dict[str, Any], tuple[str | int, ...], str]] = [
    ("missing name", {"recipe": "mlp"}, ("body", "name"), "Field required"),
    ("bad name", {**VALID, "name": "has space"}, ("body", "name"), "pattern"),
    ("unknown top-level field", {**VALID, "gpus": 2}, ("body", "gpus"), "Extra inputs"),
    (
        "unknown resources field",
        {**VALID, "resources": {"gpus": 1}},
        ("body", "resources", "gpus"),
        "Extra inputs",
    ),
    (
        "negative lr",
        {**VALID, "hyperparameters": {"lr": -1}},
        ("body", "hyperparameters", "lr"),
        "greater than 0",
    ),
    (
        "zero steps",
        {**VALID, "hyperparameters": {"steps": 0}},
        ("body", "hyperparameters", "steps"),
        "greater than",
    ),
    (
        "momentum 1",
        {**VALID, "hyperparameters": {"momentum": 1.0}},
        ("body", "hyperparameters", "momentum"),
        "less",
    ),
    (
        "bad device",
        {**VALID, "resources": {"device": "tpu"}},
        ("body", "resources", "device"),
        "'cpu' or 'cuda'",
    ),
    (
        "nodes > 256",
        {**VALID, "resources": {"nodes": 257}},
        ("body", "resources", "nodes"),
        "less than or equal",
    ),
    (
        "zero processes",
        {**VALID, "resources": {"processes_per_node": 0}},
        ("body", "resources", "processes_per_node"),
        "",
    ),
    ("keep_last 0", {**VALID, "checkpoint": {"keep_last": 0}}, ("body", "checkpoint", "keep_last"), ""),
    (
        "unknown engine option",
        {**VALID, "engine": {"turbo": True}},
        ("body", "engine", "turbo"),
        "Extra inputs",
    ),
    ("unknown recipe", {**VALID, "recipe": "gpt5"}, ("body", "recipe"), "unknown recipe 'gpt5'"),
    ("neither recipe nor entrypoint", {"name": "x"}, ("body", "recipe"), "exactly one of"),
    (
        "both recipe and entrypoint",
        {**VALID, "entrypoint": "examples.custom_plan:build"},
        ("body", "recipe"),
        "exactly one of",
    ),
    (
        "malformed entrypoint",
        {"name": "x", "entrypoint": "os.system"},
        ("body", "entrypoint"),
        "package.module",
    ),
    (
        "entrypoint not under an allowed prefix",
        {"name": "x", "entrypoint": "os:system"},
        ("body", "entrypoint"),
        "not under an allowed prefix (DPTRAIN_ALLOWED_ENTRYPOINTS: none)",
    ),
    (
        "batch not divisible by world",
        {**VALID, "hyperparameters": {"global_batch_size": 10}, "resources": {"processes_per_node": 4}},
        ("body", "hyperparameters", "global_batch_size"),
        "not divisible by the world size 4",
    ),
    (
        "unknown recipe extra",
        {**VALID, "hyperparameters": {"hidden_sise": 8}},
        ("body", "hyperparameters", "hidden_sise"),
        "not a hyperparameter of recipe 'mlp'",
    ),
    (
        "bad recipe extra",
        {**VALID, "hyperparameters": {"hidden_size": 0}},
        ("body", "hyperparameters", "hidden_size"),
        "greater than or equal to 1",
    ),
    ("bad label key", {**VALID, "labels": {"-x": "y"}}, ("body", "labels", "-x", "[key]"), ""),
    (
        "accumulation that leaves unequal micro-batches",
        {
            **VALID,
            "hyperparameters": {"global_batch_size": 64},
            "resources": {"processes_per_node": 2},
            "engine": {"grad_accumulation_steps": 3},
        },
        ("body", "hyperparameters", "global_batch_size"),
        "world size 2 x engine.grad_accumulation_steps 3 = 6",
    ),
    (
        "seed past 31 bits",
        {**VALID, "hyperparameters": {"seed": 2**31}},
        ("body", "hyperparameters", "seed"),
        "",
    ),
    (
        "steps true",
        {**VALID, "hyperparameters": {"steps": True}},
        ("body", "hyperparameters", "steps"),
        "integer",
    ),
    (
        "steps as text",
        {**VALID, "hyperparameters": {"steps": "5"}},
        ("body", "hyperparameters", "steps"),
        "integer",
    ),
    (
        "steps 5.0",
        {**VALID, "hyperparameters": {"steps": 5.0}},
        ("body", "hyperparameters", "steps"),
        "integer",
    ),
    ("lr as text", {**VALID, "hyperparameters": {"lr": "0.1"}}, ("body", "hyperparameters", "lr"), "number"),
    (
        "flag as 1",
        {**VALID, "engine": {"sync_batchnorm": 1}},
        ("body", "engine", "sync_batchnorm"),
        "boolean",
    ),
    ("name as number", {**VALID, "name": 5}, ("body", "name"), "string"),
    (
        "entrypoint with a trailing newline",
        {"name": "x", "entrypoint": "examples.custom_plan:build\n"},
        ("body", "entrypoint"),
        "package.module:function",
    ),
    (
        "entrypoint naming a private function",
        {"name": "x", "entrypoint": "examples.custom_plan:_dataset"},
        ("body", "entrypoint"),
        "public function",
    ),
    (
        "recipe extra of the wrong type",
        {**VALID, "hyperparameters": {"hidden_size": "64"}},
        ("body", "hyperparameters", "hidden_size"),
        "integer",
    ),
    (
        "recipe extra past its bound",
        {**VALID, "hyperparameters": {"hidden_size": 10**6}},
        ("body", "hyperparameters", "hidden_size"),
        "less than or equal to 65536",
    ),
    (
        "entrypoint extra beyond 64 bits",
        {"name": "x", "entrypoint": "examples.custom_plan:build", "hyperparameters": {"big": 2**64}},
        ("body", "hyperparameters", "big"),
        "64 bits",
    ),
    (
        "entrypoint extra nested too deep",
        {
            "name": "x",
            "entrypoint": "examples.custom_plan:build",
            "hyperparameters": {
                "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
            },
        },
        ("body", "hyperparameters", "deep"),
        "nested more than 32 levels deep",
    ),
    (
        "keep_best without evaluation",
        {**VALID, "checkpoint": {"keep_best": {"metric": "eval/loss"}}},
        ("body", "checkpoint", "keep_best"),
        "keep_best needs 'evaluation'",
    ),
    (
        "keep_best on a metric the recipe does not report",
        {**VALID, "evaluation": {"every_steps": 5}, "checkpoint": {"keep_best": {"metric": "eval/f1"}}},
        ("body", "checkpoint", "keep_best", "metric"),
        "recipe 'mlp' reports eval/loss, eval/accuracy, not 'eval/f1'",
    ),
    (
        "keep_best on a training metric",
        {**VALID, "evaluation": {"every_steps": 5}, "checkpoint": {"keep_best": {"metric": "loss"}}},
        ("body", "checkpoint", "keep_best", "metric"),
        "pattern",
    ),
    (
        "keep_best mode",
        {**VALID, "evaluation": {"every_steps": 5}, "checkpoint": {"keep_best": {"mode": "lowest"}}},
        ("body", "checkpoint", "keep_best", "mode"),
        "'min' or 'max'",
    ),
    (
        "evaluation of a command",
        {"name": "x", "command": ["python", "t.py"], "evaluation": {"every_steps": 5}},
        ("body", "evaluation"),
        "a command evaluates on its own",
    ),
    (
        "evaluation every 0 steps",
        {**VALID, "evaluation": {"every_steps": 0}},
        ("body", "evaluation", "every_steps"),
        "greater than or equal to 1",
    ),
    (
        "compile with buckets DDPOptimizer refuses",
        {
            **VALID,
            "resources": {"processes_per_node": 2},
            "engine": {"compile": True, "bucket_cap_mb": 0.5},
        },
        ("body", "engine", "bucket_cap_mb"),
        "engine.compile needs buckets of at least 1 MiB",
    ),
    (
        "unknown compile backend",
        {**VALID, "engine": {"compile": True, "compile_backend": "tvm"}},
        ("body", "engine", "compile_backend"),
        "'inductor', 'aot_eager' or 'eager'",
    ),
    (
        "gpt width not divisible by heads",
        {"name": "x", "recipe": "gpt", "hyperparameters": {"d_model": 30, "n_heads": 4}},
        ("body", "hyperparameters"),
        "d_model 30 is not divisible by n_heads 4",
    ),
]

# Non-finite numbers as a client's JSON library writes them (Python's parser takes all three, and
# 1e999 overflows to infinity): refused wherever they appear, with the field's path.
NON_FINITE = [
    ('{"name": "x", "recipe": "mlp", "hyperparameters": {"lr": NaN}}', ("body", "hyperparameters", "lr")),
    ('{"name": "x", "recipe": "mlp", "hyperparameters": {"lr": 1e999}}', ("body", "hyperparameters", "lr")),
    (
        '{"name": "x", "recipe": "mlp", "engine": {"grad_clip_norm": Infinity}}',
        ("body", "engine", "grad_clip_norm"),
    ),
    (
        '{"name": "x", "recipe": "partial_fc", "hyperparameters": {"sample_rate": -Infinity}}',
        ("body", "hyperparameters", "sample_rate"),
    ),
    (
        '{"name": "x", "entrypoint": "examples.custom_plan:build", "hyperparameters": {"w": [1, 1e999]}}',
        ("body", "hyperparameters", "w"),
    ),
    ('{"name": "x", "recipe": "mlp", "labels": {"a": NaN}}', ("body", "labels", "a")),
]


@pytest.mark.parametrize(("case", "body", "loc", "reason"), CASES, ids=[c[0] for c in CASES])
def test_invalid_spec_is_422_with_field_path(
    client: TestClient, scheduler: Any, case: str, body: dict[str, Any], loc: tuple[Any, ...], reason: str
) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, f"{case}: expected 422, got {r.status_code}: {r.text}"
    errors = r.json()["detail"]
    locs = [tuple(e["loc"]) for e in errors]
    assert loc in locs, f"{case}: expected an error at {loc}, got {locs}"
    msg = next(e["msg"] for e in errors if tuple(e["loc"]) == loc)
    assert reason in msg, f"{case}: expected {reason!r} in the message, got {msg!r}"
    assert scheduler.kicks == 0, "a refused spec never reaches placement"
    assert client.get("/v1/jobs").json()["items"] == [], "a refused spec must not be stored"


@pytest.mark.parametrize(("body", "loc"), NON_FINITE, ids=[b[1][-1] for b in NON_FINITE])
def test_non_finite_numbers_are_422_and_never_stored(
    client: TestClient, body: str, loc: tuple[str, ...]
) -> None:
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, f"expected 422, got {r.status_code}: {r.text}"
    assert loc in [tuple(e["loc"]) for e in r.json()["detail"]], r.json()
    assert client.get("/v1/jobs").json()["items"] == [], "a refused spec must not be stored"


@pytest.mark.parametrize(
    ("spec", "loc"),
    [
        ({"name": "x", "recipe": "mlp", "labels": {"team": "a\x00b"}}, ("labels", "team")),
        (
            {"name": "x", "entrypoint": "team.m:build", "hyperparameters": {"tag": "a\x00"}},
            ("hyperparameters", "tag"),
        ),
        (
            {"name": "x", "entrypoint": "team.m:build", "hyperparameters": {"m": {"k\x00": 1}}},
            ("hyperparameters", "m"),
        ),
    ],
)
def test_nul_in_spec_text_is_refused_by_the_model_itself(spec: dict[str, Any], loc: tuple[str, ...]) -> None:
    # PostgreSQL stores no NUL; the rule is the model's, so the engine reading spec.json applies it too.
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(spec)
    assert [e["loc"] for e in refused.value.errors()] == [loc], refused.value


def test_the_valid_spec_validates_with_every_rule() -> None:
    spec = JobSpec.model_validate(VALID)
    assert spec.local_batch_size() == 8 and spec.recipe_params() is not None


def test_engine_registers_exactly_the_recipes_the_api_accepts() -> None:
    from workers.engine.recipes import RECIPES as ENGINE_RECIPES

    assert set(ENGINE_RECIPES) == set(RECIPES), (
        f"api accepts {set(RECIPES)}, engine has {set(ENGINE_RECIPES)}"
    )


def test_stored_spec_states_every_recipe_hyperparameter(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=VALID).json()
    hp = job["spec"]["hyperparameters"]
    assert {"input_size", "hidden_size", "num_layers", "num_classes", "dataset_size"} <= set(hp), hp


def test_entrypoints_run_only_under_the_allowed_prefixes(client: TestClient, settings: Any) -> None:
    client.app.state.settings = settings.model_copy(update={"allowed_entrypoints": "examples, team_a.models"})  # type: ignore[attr-defined]
    ok = client.post("/v1/jobs", json={"name": "u", "entrypoint": "team_a.models.resnet:plan"})
    assert ok.status_code == 201, ok.text
    for refused in ("team_a:plan", "team_abc.models:plan", "examplesx:plan", "os:system"):
        r = client.post("/v1/jobs", json={"name": "u", "entrypoint": refused})
        assert r.status_code == 422, f"{refused}: expected 422, got {r.status_code}"
        assert "examples, team_a.models" in r.json()["detail"][0]["msg"]
