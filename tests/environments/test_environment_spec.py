"""A job's `environment`: its shape, who may set it, and the requirements a server refuses (issue 33)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api_schemas import JobSpec
from api_schemas.environment import MAX_REQUIREMENTS
from service.jobs.requirements import normalised, parse_lines, problems
from tests.api_fixtures import SPEC, as_user
from tests.conftest import job_spec

COMMAND = job_spec(SPEC, recipe=None, command=["python", "-c", "pass"], hyperparameters={"steps": 1})


def _with(environment: dict[str, Any]) -> dict[str, Any]:
    return job_spec(COMMAND, environment=environment)


def _user(client: TestClient, name: str, *, can_run_code: bool) -> dict[str, str]:
    r = client.post("/v1/users", json={"name": name, "can_run_code": can_run_code})
    assert r.status_code == 201, r.text
    return as_user(r.json()["token"])


@pytest.mark.parametrize(
    ("environment", "where"),
    [
        ({}, ()),
        ({"requirements": ["a"], "requirements_file": "r.txt"}, ()),
        ({"requirements": []}, ("requirements",)),
        ({"requirements": ["a\nb"]}, ("requirements", 0)),
        ({"requirements": ["x" * 1001]}, ("requirements", 0)),
        ({"requirements": ["a"] * (MAX_REQUIREMENTS + 1)}, ("requirements",)),
        ({"requirements_file": "../r.txt"}, ("requirements_file",)),
        ({"requirements_file": "/etc/passwd"}, ("requirements_file",)),
        ({"pip": ["a"]}, ("pip",)),
    ],
)
def test_the_spec_refuses_a_malformed_environment(
    environment: dict[str, Any], where: tuple[Any, ...]
) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(_with(environment))
    locs = [e["loc"] for e in info.value.errors()]
    assert any(loc[:1] == ("environment",) and loc[1 : 1 + len(where)] == where for loc in locs), locs


def test_a_requirements_file_needs_the_code() -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(_with({"requirements_file": "requirements.txt"}))
    assert [e["loc"] for e in info.value.errors()] == [("environment", "requirements_file")]


def test_the_rules_refuse_the_workers_packages_and_options() -> None:
    lines = ["einops==0.8", "Torch>=2", "numpy", "dptrain-cli", "api_schemas", "workers"]
    lines += ["-i http://x", "./a.whl"]
    found = {p.index: p.reason for p in problems(lines, allow_options=False)}
    assert sorted(found) == [1, 2, 3, 4, 5, 6, 7], found
    assert "always comes from the worker" in found[1]
    allowed = {p.index for p in problems(lines, allow_options=True)}
    assert allowed == {1, 2, 3, 4, 5}, "the operator's switch allows options and paths, never torch"
    assert "not a PEP 508 requirement" in problems(["bad req !!"], allow_options=True)[0].reason


def test_normalised_requirements_do_not_depend_on_spelling_or_order() -> None:
    assert normalised(["Foo_Bar>=1,<2", "a"]) == normalised(["a", "foo-bar<2,>=1"])
    assert parse_lines("# c\nfoo==1  # why\n\n  bar\n") == ["foo==1", "bar"]


def test_a_requirement_on_torch_is_a_422_naming_it(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_with({"requirements": ["einops", "torch==2.0"]}))
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "environment", "requirements", 1], error
    assert "torch" in error["msg"], error


def test_an_index_option_is_refused_unless_the_operator_allows_it(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_with({"requirements": ["--index-url https://evil.example/simple"]}))
    assert r.status_code == 422, r.text
    assert "DPTRAIN_PIP_ALLOW_OPTIONS" in r.json()["detail"][0]["msg"]


def test_only_users_with_the_code_grant_may_set_it(client: TestClient) -> None:
    eve = _user(client, "eve", can_run_code=False)
    recipe = job_spec(SPEC, environment={"requirements": ["einops"]})
    r = client.post("/v1/jobs", json=recipe, headers=eve)
    assert r.status_code == 403, r.text
    assert "may not set `environment`" in r.json()["detail"]
    # The grant is heard first: not which requirement the spec refuses.
    r = client.post("/v1/jobs", json=job_spec(recipe, environment={"requirements": ["torch"]}), headers=eve)
    assert r.status_code == 403, r.text
    fay = _user(client, "fay", can_run_code=True)
    r = client.post("/v1/jobs", json=_with({"requirements": ["Einops==0.8.0"]}), headers=fay)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["environment"] == {"requirements": ["Einops==0.8.0"], "requirements_file": None}
