"""A job's `env`: only users who may run code set it, and never a name that steers the worker (issue 30)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api_fixtures import SPEC, as_user
from tests.conftest import job_spec
from workers.sandbox.rank_env import rank_environment

# Finding 1: inductor's compiler probe ran `$CXX --version`, bash read BASH_ENV and ran it, as root.
FINDING_ENV = {"CXX": "/bin/bash", "BASH_ENV": "$(id > /tmp/x_$$)"}
FINDING_JOB = job_spec(SPEC, engine={"compile": True}, env=FINDING_ENV)
FINDING_NAMES = ["CXX", "BASH_ENV", "CC", "ENV", "GCONV_PATH", "OPENSSL_CONF", "GLIBC_TUNABLES"]


def _user(client: TestClient, name: str, *, can_run_code: bool) -> dict[str, str]:
    r = client.post("/v1/users", json={"name": name, "can_run_code": can_run_code})
    assert r.status_code == 201, r.text
    return as_user(r.json()["token"])


def _h(headers: dict[str, str]) -> dict[str, Any]:
    # No headers: the client's own, the admin's.
    return {"headers": headers} if headers else {}


def test_the_finding_job_is_forbidden_to_a_user_without_the_code_grant(client: TestClient) -> None:
    eve = _user(client, "eve", can_run_code=False)
    r = client.post("/v1/jobs", json=FINDING_JOB, headers=eve)
    assert r.status_code == 403, r.text
    detail = r.json()["detail"]
    assert "user eve may not set `env`" in detail, detail
    assert "dptrain users grant eve --can-run-code" in detail, detail
    assert client.post("/v1/jobs", json=SPEC, headers=eve).status_code == 201, "no env needs no grant"
    assert client.post("/v1/jobs", json=job_spec(SPEC, env={}), headers=eve).status_code == 201


def test_a_user_without_the_grant_may_not_set_even_a_harmless_name(client: TestClient) -> None:
    # Any variable reaches the programs a recipe's ranks start, so any is the grant's business.
    eve = _user(client, "eve", can_run_code=False)
    spec = job_spec(SPEC, engine={"compile": True}, env={"WANDB_MODE": "offline"})
    r = client.post("/v1/jobs", json=spec, headers=eve)
    assert r.status_code == 403, r.text
    assert client.get("/v1/jobs", headers=eve).json()["items"] == [], "nothing was submitted"


@pytest.mark.parametrize("name", FINDING_NAMES)
@pytest.mark.parametrize("who", ["granted", "admin"])
def test_each_name_of_the_finding_is_a_422_naming_it(client: TestClient, name: str, who: str) -> None:
    headers = _user(client, "fay", can_run_code=True) if who == "granted" else {}
    r = client.post("/v1/jobs", json=job_spec(SPEC, env={name: "/bin/bash"}), **_h(headers))
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"][:3] == ["body", "env", name], error
    assert name in error["msg"], error


def test_a_granted_user_and_an_admin_may_set_their_own_names(client: TestClient) -> None:
    fay = _user(client, "fay", can_run_code=True)
    for headers in (fay, {}):
        spec = job_spec(SPEC, env={"MY_FLAG": "on", "NCCL_DEBUG": "INFO"})
        r = client.post("/v1/jobs", json=spec, **_h(headers))
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["env"] == {"MY_FLAG": "on", "NCCL_DEBUG": "INFO"}


def test_the_worker_drops_a_refused_name_a_stored_spec_still_has(tmp_path: Path) -> None:
    # Defence in depth: a spec stored before a name was refused reaches the worker as it was stored.
    stored = {**FINDING_ENV, "LD_PRELOAD": "/tmp/x.so", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "MY_FLAG": "1"}
    worker = {"CUDA_VISIBLE_DEVICES": "2", "LANG": "C.UTF-8"}
    env = rank_environment(
        worker_env=worker, dptrain={}, user=stored, home=tmp_path, tmp=tmp_path / "tmp", code_dir=None
    )
    assert env["MY_FLAG"] == "1", env
    assert env["CUDA_VISIBLE_DEVICES"] == "2", "the worker's device assignment must stand"
    for name in ("CXX", "BASH_ENV", "LD_PRELOAD"):
        assert name not in env, env
