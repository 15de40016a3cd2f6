"""The CLI's client submits under an Idempotency-Key and retries with the same key; spec files it reads."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from api_schemas import JobSpec
from dptrain.client import Client
from tests.api_fixtures import queued_job_json
from tests.conftest import job_spec


def test_a_submit_whose_answer_was_lost_is_retried_with_the_same_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dptrain.client.time.sleep", lambda _s: None)
    keys: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        if len(keys) == 1:  # accepted, but the answer never arrives
            raise httpx.ReadTimeout("lost", request=request)
        return httpx.Response(200, json=queued_job_json("job-1"))

    client = Client("http://api", token="t")
    client.http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(server))
    assert client.submit(job_spec()).id == "job-1"
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0], f"expected one key sent twice, got {keys}"
    client.submit(job_spec(name="y"))
    assert keys[2] != keys[0], "each submit has a key of its own"


def test_a_yaml_spec_reads_exponent_floats_as_numbers(tmp_path: Path) -> None:
    # YAML 1.2 reads `1e-4` as a float, PyYAML's 1.1 as a string, which the spec's strict types refuse.
    from dptrain.specfile import load_spec as _load_spec

    path = tmp_path / "job.yaml"
    path.write_text("name: x\nrecipe: mlp\nhyperparameters: {lr: 1e-3, weight_decay: 1.0e-4, steps: 5}\n")
    hp = _load_spec(path)["hyperparameters"]
    assert hp == {"lr": 1e-3, "weight_decay": 1e-4, "steps": 5}, hp
    assert JobSpec.model_validate(_load_spec(path)).hyperparameters.lr == 1e-3
