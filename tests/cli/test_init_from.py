"""`dptrain submit --from ID[:STEP|:best]` and `dptrain continue ID`: the init_from they send."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_fixtures import queued_job_json
from tests.cli.conftest import dptrain, flat, use_http
from tests.conftest import job_spec

SOURCE = "a" * 32


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A server that answers GET with the source job and POST with the job sent; the bodies POSTed."""
    bodies: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(
                200, json=queued_job_json(SOURCE, job_spec(name="run-1", labels={"team": "a"}), owner="me")
            )
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json=queued_job_json("b" * 32, bodies[-1], owner="me"))

    use_http(monkeypatch, httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(server)))
    return bodies


@pytest.mark.parametrize(
    ("args", "init"),
    [
        ([SOURCE], {"job": SOURCE, "resume": False}),
        ([f"{SOURCE}:20"], {"job": SOURCE, "step": 20, "resume": False}),
        ([f"{SOURCE}:best"], {"job": SOURCE, "best": True, "resume": False}),
        ([f"{SOURCE}:20", "--resume"], {"job": SOURCE, "step": 20, "resume": True}),
    ],
)
def test_submit_from_sends_the_init_from_it_names(
    posted: list[dict[str, Any]], spec_file: Callable[..., Path], args: list[str], init: dict[str, Any]
) -> None:
    r = dptrain("submit", spec_file(), "--from", *args)
    assert r.exit_code == 0, r.output
    assert [b["init_from"] for b in posted] == [init]


@pytest.mark.parametrize("bad", [f"{SOURCE}:", ":20", f"{SOURCE}:twenty", f"{SOURCE}:²"])
def test_a_malformed_from_is_refused_before_anything_is_sent(
    posted: list[dict[str, Any]], spec_file: Callable[..., Path], bad: str
) -> None:
    r = dptrain("submit", spec_file(), "--from", bad)
    assert r.exit_code == 2 and "ID:STEP" in flat(r.output), r.output
    assert posted == []


def test_resume_without_from_is_refused(posted: list[dict[str, Any]], spec_file: Callable[..., Path]) -> None:
    r = dptrain("submit", spec_file(), "--resume")
    assert r.exit_code == 2 and "--resume needs --from" in flat(r.output), r.output
    assert posted == []


def test_continue_resubmits_the_spec_as_it_ran_resumed_from_its_newest_checkpoint(
    posted: list[dict[str, Any]],
) -> None:
    r = dptrain("continue", SOURCE)
    assert r.exit_code == 0 and r.stdout.strip() == "b" * 32, r.output
    (body,) = posted
    assert body["init_from"] == {"job": SOURCE, "resume": True}
    assert body["name"] == "run-1" and body["labels"] == {"team": "a"}, "the same spec, its name kept"
