"""Request bodies: non-finite numbers, deep nesting and NUL are 422s naming the field, never 500s."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from service.app import create_app
from service.errors import install_error_handler
from service.strict_json import MAX_DEPTH, StrictJSONRoute
from tests.api_fixtures import ADMIN_TOKEN, SPEC, RecordingScheduler
from tests.backends import sqlite_app_settings

JSON = {"Content-Type": "application/json"}


def _strict(text: str) -> Any:
    """Parse as a strict client would: NaN and Infinity are not JSON."""

    def refuse(literal: str) -> None:
        raise ValueError(f"{literal} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _spec_with(path: str, literal: str) -> str:
    """SPEC's JSON text with `literal` (written as is, e.g. NaN) at the dotted `path`."""
    marker = "__LITERAL__"
    spec: dict[str, Any] = json.loads(json.dumps(SPEC))
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = marker
    return json.dumps(spec).replace(f'"{marker}"', literal)


def _only_error(r: Any) -> dict[str, Any]:
    assert r.status_code == 422, f"expected 422, got {r.status_code}: {r.text[:300]}"
    detail = _strict(r.text)["detail"]
    assert len(detail) == 1, detail
    return dict(detail[0])


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1E400", "1" + "0" * 400 + ".0"]
# A validated float, one without an upper bound (it used to be stored: 201, shown back as null),
# a recipe extra, a label, a field that does not exist.
FIELDS = [
    "hyperparameters.lr",
    "engine.grad_clip_norm",
    "hyperparameters.hidden_size",
    "labels.team",
    "bogus",
]


class TestNonFiniteNumbers:
    """The models refuse them (api_schemas); what is checked here is the answer around the refusal."""

    @pytest.mark.parametrize("literal", NON_FINITE)
    @pytest.mark.parametrize("field", FIELDS)
    def test_a_non_finite_number_is_a_422_naming_its_field_and_nothing_is_stored(
        self, client: TestClient, field: str, literal: str
    ) -> None:
        error = _only_error(client.post("/v1/jobs", content=_spec_with(field, literal), headers=JSON))
        assert error["loc"] == ["body", *field.split(".")], error
        # In strict JSON, whatever the input was: a 500 used to come from encoding it.
        sign = "-" if literal.startswith("-") else ""
        assert error["input"] == ("NaN" if literal == "NaN" else f"{sign}Infinity"), error
        assert client.get("/v1/jobs").json()["items"] == [], "no job was stored"

    def test_inside_an_array_and_twice(self, client: TestClient) -> None:
        body = _spec_with("hyperparameters.lr", "[1, NaN]").replace('"steps": 4', '"steps": Infinity')
        r = client.post("/v1/jobs", content=body, headers=JSON)
        assert r.status_code == 422, r.text
        locs = [e["loc"][:3] for e in _strict(r.text)["detail"]]
        assert ["body", "hyperparameters", "lr"] in locs and ["body", "hyperparameters", "steps"] in locs, (
            locs
        )

    def test_the_users_route_too(self, client: TestClient) -> None:
        error = _only_error(client.post("/v1/users", content='{"name": "x", "admin": NaN}', headers=JSON))
        assert (error["loc"], error["input"]) == (["body", "admin"], "NaN"), error

    def test_finite_numbers_and_an_ordinary_spec_still_pass(self, client: TestClient) -> None:
        body = _spec_with("engine.grad_clip_norm", "1.5e3")
        r = client.post("/v1/jobs", content=body, headers=JSON)
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["engine"]["grad_clip_norm"] == 1500.0


class TestDeepNesting:
    @pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 500, 900, 950, 990, 1_000, 5_000, 100_000])
    @pytest.mark.parametrize("field", ["hyperparameters.hidden_size", "labels.team", "bogus"])
    def test_a_body_nested_too_deep_is_a_422(self, client: TestClient, field: str, depth: int) -> None:
        # Around the interpreter's recursion limit a body used to parse and then fail to render
        # its own validation error (a RecursionError, a 500); far beyond it, fail to parse.
        body = _spec_with(field, "[" * depth + "]" * depth)
        error = _only_error(client.post("/v1/jobs", content=body, headers=JSON))
        assert error["type"] == "json_invalid" and "nested too deeply" in error["msg"], error
        if depth < 900:  # parsed, so the refusal says where
            assert error["loc"][: 1 + len(field.split("."))] == ["body", *field.split(".")], error

    def test_a_whole_body_of_brackets(self, client: TestClient) -> None:
        error = _only_error(client.post("/v1/jobs", content="[" * 200_000 + "]" * 200_000, headers=JSON))
        assert error["loc"] == ["body"] and "nested too deeply" in error["msg"], error

    def test_nesting_up_to_the_limit_is_left_to_the_model(self, client: TestClient) -> None:
        # Depth MAX_DEPTH in all (the spec object and hyperparameters are two of it): a model error.
        inner = MAX_DEPTH - 2
        body = _spec_with("hyperparameters.hidden_size", "[" * inner + "]" * inner)
        error = _only_error(client.post("/v1/jobs", content=body, headers=JSON))
        assert error["loc"] == ["body", "hyperparameters", "hidden_size"], error
        assert "nested too deeply" not in error["msg"], error


class TestNul:
    @pytest.mark.parametrize("field", ["labels.team", "name", "hyperparameters.hidden_size"])
    def test_a_nul_in_a_string_is_a_422_not_a_database_error(self, client: TestClient, field: str) -> None:
        # PostgreSQL refuses \u0000 in JSONB: a label carrying one used to fail the INSERT (500).
        error = _only_error(client.post("/v1/jobs", content=_spec_with(field, '"a\\u0000b"'), headers=JSON))
        assert (error["loc"], error["type"]) == (["body", *field.split(".")], "string_nul"), error

    def test_in_a_key_too(self, client: TestClient) -> None:
        body = _spec_with("labels", '{"te\\u0000am": "x"}')
        assert _only_error(client.post("/v1/jobs", content=body, headers=JSON))["type"] == "string_nul"


class TestValidationErrorsAlwaysRender:
    """Whatever a validation error carries, the answer is a 422 in strict JSON with the field path."""

    ODD = [float("nan"), float("inf"), float("-inf"), b"\xff\xfebytes", ValueError("boom"), {1, 2}, object()]

    @pytest.fixture
    def odd_client(self) -> TestClient:
        app = FastAPI()
        install_error_handler(app)

        @app.get("/odd/{i}")
        def odd(i: int) -> None:
            value = self.ODD[i]
            deep: Any = value
            for _ in range(5_000):
                deep = [deep]
            raise RequestValidationError(
                [
                    {
                        "type": "x",
                        "loc": ("body", "f"),
                        "msg": "odd input",
                        "input": value,
                        "ctx": {"le": value},
                    },
                    {"type": "y", "loc": ("body", "g", 0), "msg": "deep input", "input": deep},
                ]
            )

        return TestClient(app)

    @pytest.mark.parametrize("i", range(len(ODD)))
    def test_an_unencodable_entry_still_answers_422_with_its_loc(
        self, odd_client: TestClient, i: int
    ) -> None:
        r = odd_client.get(f"/odd/{i}")
        assert r.status_code == 422, f"{self.ODD[i]!r}: expected 422, got {r.status_code}"
        detail = _strict(r.text)["detail"]
        assert [e["loc"] for e in detail] == [["body", "f"], ["body", "g", 0]], detail

    def test_non_finite_floats_are_named(self, odd_client: TestClient) -> None:
        got = [_strict(odd_client.get(f"/odd/{i}").text)["detail"][0]["input"] for i in range(3)]
        assert got == ["NaN", "Infinity", "-Infinity"], got


def test_every_route_with_a_body_parses_it_strictly(tmp_path: Path) -> None:
    app = create_app(sqlite_app_settings(tmp_path), scheduler=RecordingScheduler())
    loose = [
        r.path
        for r in app.routes
        if isinstance(r, APIRoute) and r.body_field is not None and not isinstance(r, StrictJSONRoute)
    ]
    assert loose == [], f"routes that read a body with Python's lenient json: {loose}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The real app under uvicorn on a free port, for what only a real connection shows."""
    app = create_app(sqlite_app_settings(tmp_path), scheduler=RecordingScheduler())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(10)


def test_the_connection_stays_usable_after_a_refused_body(server: tuple[str, int]) -> None:
    conn = http.client.HTTPConnection(*server, timeout=10)
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}", **JSON}
    for literal in ["NaN", "1e999"]:
        conn.request("POST", "/v1/jobs", body=_spec_with("hyperparameters.lr", literal), headers=auth)
        r = conn.getresponse()
        body = r.read()
        assert r.status == 422, f"{literal}: expected 422, got {r.status}: {body[:300]!r}"
        assert not r.will_close, f"{literal}: the server closed the connection after its answer"
    sock = conn.sock
    conn.request("GET", "/v1/users/me", headers=auth)
    r = conn.getresponse()
    assert (r.status, json.loads(r.read())["name"]) == (200, "admin")
    assert conn.sock is sock, "the next request went over the same connection"
    conn.close()
