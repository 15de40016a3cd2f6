"""A lone surrogate (`"\\ud800"`) anywhere in a JSON body: a 422 in valid UTF-8 JSON, never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.errors import jsonable, text
from tests.api_fixtures import SPEC

JSON = {"Content-Type": "application/json"}
LONE = "\\ud800"  # as JSON text writes it: a high surrogate with no low one after it


def _raw(value: Any) -> bytes:
    # json.dumps writes the placeholder as is; the escape goes in afterwards, as a client would send it.
    return json.dumps(value).replace("@@", LONE).encode()


def _refused(r: Any) -> dict[str, Any]:
    assert r.status_code == 422, f"expected 422, got {r.status_code}: {r.content[:300]!r}"
    body = json.loads(r.content.decode("utf-8"))  # strict UTF-8: no surrogate made it into the answer
    (error,) = body["detail"]
    assert error["type"] == "string_surrogate", error
    return dict(error)


JOB_CASES = {
    "a value": ({**SPEC, "name": "a@@b"}, ["body", "name"]),
    "a label value": ({**SPEC, "labels": {"team": "@@"}}, ["body", "labels", "team"]),
    "a label key": ({**SPEC, "labels": {"t@@": "x"}}, ["body", "labels", "t\\ud800"]),
    "a top-level key": ({**SPEC, "na@@me": 1}, ["body", "na\\ud800me"]),
    "a free-form extra": ({**SPEC, "hyperparameters": {"hidden_size": ["@@"]}}, None),
}


@pytest.mark.parametrize("case", JOB_CASES)
def test_post_jobs(client: TestClient, case: str) -> None:
    spec, loc = JOB_CASES[case]
    error = _refused(client.post("/v1/jobs", content=_raw(spec), headers=JSON))
    if loc is not None:
        assert error["loc"] == loc, error
    assert LONE in json.dumps(error["input"]), f"the input is echoed, escaped: {error}"


@pytest.mark.parametrize(
    ("body", "loc"),
    [({"name": "ev@@e"}, ["body", "name"]), ({"name": "eve", "@@": True}, ["body", "\\ud800"])],
    ids=["value", "key"],
)
def test_post_users(client: TestClient, body: dict[str, Any], loc: list[str]) -> None:
    error = _refused(client.post("/v1/users", content=_raw(body), headers=JSON))
    assert error["loc"] == loc, error


def test_a_surrogate_pair_is_one_character_and_accepted(client: TestClient) -> None:
    # `\ud83d\ude00` is one character (U+1F600) once parsed: nothing to refuse.
    body = json.dumps({**SPEC, "labels": {"mood": "@@"}}).replace("@@", "\\ud83d\\ude00").encode()
    r = client.post("/v1/jobs", content=body, headers=JSON)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["labels"]["mood"] == "\U0001f600", r.text


def test_the_error_handler_escapes_a_surrogate_whatever_brings_it() -> None:
    # Defence in depth for 4xx answers built elsewhere: echoed text, keys and messages encode.
    value = {"k\ud800": ["v\udfff", "ok", "é"]}
    shown = jsonable(value)
    json.dumps(shown, ensure_ascii=False).encode("utf-8")
    assert shown == {"k\\ud800": ["v\\udfff", "ok", "é"]}, shown
    assert text("plain") == "plain"
