"""`dptrain sweep`: submit (with --wait, its exit codes), status (best first, user text inert), cancel.

Against a hand-written server that speaks the sweep contract of issue 34 (httpx.MockTransport).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dptrain.client import Client
from tests.cli.conftest import dptrain, flat, use_http

SWEEP_ID = "sw_0123456789abcdef"
SPEC = {
    "name": "lr-search",
    "base": {
        "name": "mlp-trial",
        "recipe": "mlp",
        "hyperparameters": {"global_batch_size": 32, "lr": 0.05, "steps": 20},
        "resources": {"processes_per_node": 2, "device": "cpu"},
    },
    "space": {
        "hyperparameters.lr": {"log_uniform": [1e-4, 1e-1]},
        "hyperparameters.momentum": {"uniform": [0, 0.9]},
    },
    "objective": {"metric": "eval/loss", "direction": "minimize"},
    "sampler": "random",
    "pruner": {"type": "none"},
    "max_trials": 3,
    "max_concurrent_trials": 2,
    "seed": 7,
}


def trial(
    number: int, objective: float | None, status: str = "succeeded", lr: float = 0.01
) -> dict[str, Any]:
    return {
        "number": number,
        "job_id": f"job{number}",
        "params": {"hyperparameters.lr": lr},
        "status": status,
        "objective": objective,
    }


def sweep(state: str = "running", trials: list[dict[str, Any]] | None = None, **over: Any) -> dict[str, Any]:
    trials = trials or []
    scored = [t for t in trials if t["objective"] is not None]
    best = min(scored, key=lambda t: t["objective"]) if scored else None
    return {
        "id": SWEEP_ID,
        "name": "lr-search",
        "owner": "admin",
        "state": state,
        "spec": SPEC,
        "trials": trials,
        "best": best,
        "created_at": "2026-11-26T10:00:00Z",
        "finished_at": None,
        **over,
    }


class Server:
    """Answers the sweep routes; `states` is the sequence of sweeps the GETs return (the last repeats)."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        path = request.url.path
        if request.method == "POST" and path == "/v1/sweeps":
            if body.get("max_trials", 1) < 1:
                detail = [{"loc": ["body", "max_trials"], "msg": "must be at least 1", "type": "value_error"}]
                return httpx.Response(422, json={"detail": detail})
            return httpx.Response(201, json=sweep())
        if request.method == "GET" and path == f"/v1/sweeps/{SWEEP_ID}":
            return httpx.Response(200, json=self.states.pop(0) if len(self.states) > 1 else self.states[0])
        if request.method == "GET" and path == "/v1/sweeps":
            return httpx.Response(200, json={"items": [self.states[-1]], "next_cursor": None})
        if request.method == "POST" and path == f"/v1/sweeps/{SWEEP_ID}/cancel":
            return httpx.Response(200, json=sweep("cancelled"))
        return httpx.Response(404, json={"detail": f"no route {path}"})


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[dict[str, Any]]], Server]:
    def start(states: list[dict[str, Any]]) -> Server:
        server = Server(states)
        use_http(
            monkeypatch, httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(server))
        )
        return server

    return start


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr("dptrain.sweeps.time.sleep", lambda _s: None)
    yield


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


def test_submit_posts_the_file_as_written(serve: Callable[..., Server], sweep_file: Path) -> None:
    server = serve([sweep()])
    r = dptrain("sweep", "submit", sweep_file)
    assert r.exit_code == 0 and SWEEP_ID in r.stdout, r.output
    assert server.requests == [("POST", "/v1/sweeps", SPEC)]
    r = dptrain("sweep", "submit", sweep_file, "--output", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["id"] == SWEEP_ID, r.output


@pytest.mark.parametrize(("state", "code"), [("succeeded", 0), ("failed", 1), ("cancelled", 4)])
def test_submit_wait_exits_like_a_job(
    serve: Callable[..., Server], sweep_file: Path, state: str, code: int
) -> None:
    trials = [trial(0, 0.5), trial(1, 0.2, lr=0.003), trial(2, None, "pruned")]
    serve([sweep("running", trials[:1]), sweep(state, trials)])
    r = dptrain("sweep", "submit", sweep_file, "--wait")
    assert r.exit_code == code, r.output
    assert f"{state}, 3 trials" in r.stdout and "best: trial 1 (job job1) 0.2" in flat(r.stdout), r.output


def test_submit_wait_times_out_with_exit_2(serve: Callable[..., Server], sweep_file: Path) -> None:
    serve([sweep("running", [trial(0, None, "running")])])
    r = dptrain("sweep", "submit", sweep_file, "--wait", "--timeout", "0.001", "--output", "json")
    assert r.exit_code == 2 and "still running" in r.stderr, r.output
    assert json.loads(r.stdout)["state"] == "running"


def test_a_refused_sweep_names_the_field(serve: Callable[..., Server], tmp_path: Path) -> None:
    serve([sweep()])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "max_trials": 0}))
    r = dptrain("sweep", "submit", path)
    assert r.exit_code == 3 and "max_trials" in r.stderr, r.output


@pytest.mark.parametrize("text", ["[1, 2]", "name: [unclosed"])
def test_a_file_that_is_no_sweep_is_refused_before_sending(
    serve: Callable[..., Server], tmp_path: Path, text: str
) -> None:
    server = serve([sweep()])
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = dptrain("sweep", "submit", path)
    assert r.exit_code == 3 and "bad.yaml" in r.stderr and server.requests == [], r.output
    assert dptrain("sweep", "submit", tmp_path / "missing.yaml").exit_code == 3


def test_status_sorts_by_objective_and_marks_the_best(serve: Callable[..., Server]) -> None:
    trials = [trial(0, 0.5, lr=0.1), trial(1, None, "pruned"), trial(2, 0.125, lr=0.001), trial(3, 0.25)]
    serve([sweep("succeeded", trials)])
    r = dptrain("sweep", "status", SWEEP_ID)
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if "job" in line and "│" in line]
    assert [row.split("│")[2].strip() for row in rows] == ["2", "3", "0", "1"], r.stdout
    assert rows[0].split("│")[1].strip() == "*" and "*" not in rows[1].split("│")[1], r.stdout
    assert "pruned" in rows[3] and "hyperparameters.lr" in flat(r.stdout)


def test_status_ranks_a_maximized_objective_highest_first(serve: Callable[..., Server]) -> None:
    spec = {**SPEC, "objective": {"metric": "eval/accuracy", "direction": "maximize"}}
    serve([sweep("running", [trial(0, 0.5), trial(1, 0.9)], spec=spec, best=trial(1, 0.9))])
    r = dptrain("sweep", "status", SWEEP_ID)
    rows = [line for line in r.stdout.splitlines() if "job" in line and "│" in line]
    assert [row.split("│")[2].strip() for row in rows] == ["1", "0"], r.stdout
    assert "eval/accuracy" in r.stdout


def test_user_written_values_stay_inert(serve: Callable[..., Server]) -> None:
    hostile = "[link=http://evil]x[/link]\x1b]0;pwned\x07"
    bad = trial(0, 0.5)
    bad["params"] = {"hyperparameters.optimizer": hostile}
    serve([sweep("running", [bad], name=hostile)])
    r = dptrain("sweep", "status", SWEEP_ID)
    assert r.exit_code == 0, r.output
    assert (
        "[link=http://evil]x[/link]" in flat(r.stdout) and "\x1b" not in r.stdout and "\x07" not in r.stdout
    )


def test_status_json_and_list_and_cancel(serve: Callable[..., Server]) -> None:
    server = serve([sweep("running", [trial(0, 0.5)])])
    r = dptrain("sweep", "status", SWEEP_ID, "--output", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["trials"][0]["job_id"] == "job0", r.output
    r = dptrain("sweep", "list")
    assert r.exit_code == 0 and "lr-search" in r.stdout and "0.5" in r.stdout, r.output
    r = dptrain("sweep", "cancel", SWEEP_ID)
    assert r.exit_code == 0 and "cancelled" in r.stdout, r.output
    assert ("POST", f"/v1/sweeps/{SWEEP_ID}/cancel", None) in server.requests


def test_an_unknown_sweep_is_exit_3(serve: Callable[..., Server]) -> None:
    serve([sweep()])
    r = dptrain("sweep", "status", "nope")
    assert r.exit_code == 3 and "404" in r.stderr, r.output


def test_the_client_methods(serve: Callable[..., Server]) -> None:
    serve([sweep("running"), sweep("succeeded", [trial(0, 0.1)])])
    seen: list[str] = []
    with Client.from_env() as client:
        assert client.submit_sweep(SPEC)["id"] == SWEEP_ID
        done = client.wait_sweep(SWEEP_ID, on_progress=lambda s: seen.append(s["state"]))
        assert done["best"] is not None and done["best"]["number"] == 0
        assert client.sweeps()["items"][0]["id"] == SWEEP_ID
        assert client.cancel_sweep(SWEEP_ID)["state"] == "cancelled"
    assert seen == ["running", "succeeded"]
