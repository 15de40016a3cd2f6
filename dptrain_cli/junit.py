"""A JUnit XML report of one job, for CI systems that show test results (`dptrain submit --junit`)."""

from __future__ import annotations

import re
from typing import Any
from xml.etree import ElementTree as ET

from api_schemas import JobStatus
from dptrain_cli.output import step_text

# What XML 1.0 allows in a document: a traceback can hold ANSI escapes or other control
# characters, which no parser would read back, so they are dropped rather than escaped.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
TRACEBACK_LINES = 200


def _clean(text: object) -> str:
    return _NOT_XML.sub("", str(text))


def _summary(job: dict[str, Any]) -> str:
    progress = job.get("progress") or {}
    step = step_text(progress.get("step", 0), progress.get("total_steps"))
    lines = [f"job {job['id']} {job['status']} at step {step}"]
    lines += [f"{name} = {value:.6g}" for name, value in sorted((job.get("latest_metrics") or {}).items())]
    return "\n".join(lines)


def _where(error: dict[str, Any]) -> str:
    """`AssertionError on rank 1`: what failed, and where (no rank: the launcher or the service)."""
    kind, rank = error.get("type", "Failed"), error.get("rank")
    return f"{kind} on rank {rank}" if rank is not None else str(kind)


def _failure_text(error: dict[str, Any]) -> str:
    where = _where(error)
    lines = [where if error.get("rank") is not None else f"{where} (the launcher or the service)"]
    lines.append(str(error.get("message", "")))
    if error.get("traceback"):
        lines += ["", *str(error["traceback"]).splitlines()[-TRACEBACK_LINES:]]
    return "\n".join(lines)


def junit_report(job: dict[str, Any], *, elapsed: float, timed_out: bool) -> bytes:
    """One `<testsuite>` with one `<testcase>` for `job` as `GET /v1/jobs/{id}` answers it, as UTF-8 XML."""
    status = JobStatus(job["status"])
    seconds = f"{max(elapsed, 0.0):.3f}"
    failed = not timed_out and status in (JobStatus.FAILED, JobStatus.CANCELLED)
    suite = ET.Element(
        "testsuite",
        name="dptrain",
        tests="1",
        failures=str(int(failed)),
        errors=str(int(timed_out)),
        time=seconds,
    )
    case = ET.SubElement(
        suite, "testcase", classname=_clean(f"dptrain.{job['name']}"), name=_clean(job["id"]), time=seconds
    )
    if timed_out:
        message = f"still {status.value} after {elapsed:.0f} s; the job keeps running"
        ET.SubElement(case, "error", type="Timeout", message=message).text = message
    elif status is JobStatus.FAILED:
        error = job.get("error") or {"type": "Failed", "message": "the job failed without an error report"}
        # The message attribute is what most CI pages show of a failure: it names the type and the rank.
        kind, message = (
            _clean(error.get("type", "Failed")),
            _clean(f"{_where(error)}: {error.get('message', '')}"),
        )
        ET.SubElement(case, "failure", type=kind, message=message).text = _clean(_failure_text(error))
    elif status is JobStatus.CANCELLED:
        message = f"cancelled at step {(job.get('progress') or {}).get('step', 0)}"
        ET.SubElement(case, "failure", type="Cancelled", message=message).text = message
    elif status is JobStatus.PRUNED:
        # Its sweep's pruner stopped it: an outcome of the search, not a failure of the job.
        message = f"pruned by its sweep at step {(job.get('progress') or {}).get('step', 0)}"
        ET.SubElement(case, "skipped", message=message)
    ET.SubElement(case, "system-out").text = _clean(_summary(job))
    return bytes(ET.tostring(suite, encoding="utf-8", xml_declaration=True))
