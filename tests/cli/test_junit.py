"""The JUnit report of a job reads back as CI systems read it, whatever its traceback holds."""

from __future__ import annotations

from typing import Any
from xml.etree import ElementTree as ET

import pytest

from dptrain_cli.junit import junit_report


def job(status: str, **fields: Any) -> dict[str, Any]:
    """A job as `GET /v1/jobs/{id}` answers it, with the fields the report reads."""
    return {
        "id": "job-42",
        "name": "mnist-ci",
        "status": status,
        "progress": {"step": 7, "total_steps": 50},
        "latest_metrics": {"loss": 0.125, "accuracy": 0.9},
        "error": None,
        **fields,
    }


def parse(report: bytes) -> tuple[ET.Element, ET.Element]:
    """The suite and its only test case."""
    assert report.startswith(b"<?xml"), report[:40]
    suite = ET.fromstring(report)
    assert suite.tag == "testsuite" and suite.get("name") == "dptrain" and suite.get("tests") == "1"
    (case,) = suite.findall("testcase")
    return suite, case


def test_a_succeeded_job_is_a_passing_case_with_its_step_and_metrics() -> None:
    suite, case = parse(
        junit_report(
            job("succeeded", progress={"step": 50, "total_steps": 50}), elapsed=12.5, timed_out=False
        )
    )
    assert (suite.get("failures"), suite.get("errors"), suite.get("time")) == ("0", "0", "12.500")
    assert case.attrib == {"classname": "dptrain.mnist-ci", "name": "job-42", "time": "12.500"}
    assert [c.tag for c in case] == ["system-out"], "a pass has no failure or error child"
    text = case.findtext("system-out") or ""
    assert "step 50/50" in text and "loss = 0.125" in text and "accuracy = 0.9" in text, text


def test_a_failed_job_is_a_failure_with_the_rank_message_and_traceback() -> None:
    message = 'CUDA out of memory <at> step 7 & "more"'
    error = {
        "type": "RuntimeError",
        "message": message,
        "rank": 3,
        "traceback": 'Traceback (most recent call last):\n  File "train.py", line 9\nRuntimeError: boom',
    }
    suite, case = parse(junit_report(job("failed", error=error), elapsed=3, timed_out=False))
    assert (suite.get("failures"), suite.get("errors")) == ("1", "0")
    failure = case.find("failure")
    assert failure is not None
    assert (
        failure.get("type") == "RuntimeError"
        and failure.get("message") == f"RuntimeError on rank 3: {message}"
    )
    text = failure.text or ""
    assert text.startswith(f"RuntimeError on rank 3\n{message}"), text
    assert text.endswith('File "train.py", line 9\nRuntimeError: boom'), text


def test_a_cancelled_job_is_a_cancelled_failure() -> None:
    suite, case = parse(junit_report(job("cancelled"), elapsed=1, timed_out=False))
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "Cancelled", ET.tostring(case)
    assert "step 7" in (failure.get("message") or "")
    assert (suite.get("failures"), suite.get("errors")) == ("1", "0")


@pytest.mark.parametrize("status", ["queued", "running"])
def test_a_timeout_is_an_error_saying_the_job_keeps_running(status: str) -> None:
    suite, case = parse(junit_report(job(status), elapsed=900, timed_out=True))
    error = case.find("error")
    assert error is not None and error.get("type") == "Timeout", ET.tostring(case)
    assert f"still {status} after 900 s" in (error.get("message") or "")
    assert "keeps running" in (error.get("message") or "")
    assert case.find("failure") is None and (suite.get("failures"), suite.get("errors")) == ("0", "1")


def test_control_characters_are_dropped_and_the_rest_kept() -> None:
    # ANSI colours, a NUL, a form feed and an unpaired surrogate: none may appear in XML 1.0.
    nasty = "\x1b[31mred\x1b[0m\x00 tab\there\x0c é ✓ \ud800 <tag> & done\r\nnext"
    error = {"type": "Bad\x07Type", "message": nasty, "rank": 0, "traceback": nasty}
    report = junit_report(job("failed", name="n\x01ame", error=error), elapsed=1, timed_out=False)
    _, case = parse(report)
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("type") == "BadType" and case.get("classname") == "dptrain.name"
    expected = "[31mred[0m tab\there é ✓  <tag> & done"
    assert (failure.get("message") or "").startswith(f"BadType on rank 0: {expected}"), failure.get("message")
    assert expected in (failure.text or ""), failure.text


def test_a_launcher_failure_has_no_rank() -> None:
    error = {"type": "RendezvousFailed", "message": "the nodes did not all join", "rank": None}
    _, case = parse(junit_report(job("failed", error=error), elapsed=1, timed_out=False))
    failure = case.find("failure")
    assert failure is not None and failure.get("message") == "RendezvousFailed: the nodes did not all join"
    assert (failure.text or "").startswith("RendezvousFailed (the launcher or the service)\n"), failure.text
