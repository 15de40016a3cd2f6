"""`dptrain.Client`: the v1 API from Python, typed with the wire models of `api_schemas`.

    import dptrain

    with dptrain.Client() as client:          # DPTRAIN_API_URL and DPTRAIN_TOKEN (or DPTRAIN_HOME/token)
        job = client.submit("job.yaml", workdir=".")
        job = client.wait(job.id, on_progress=lambda j: print(j.progress.step))
        for line in client.logs(job.id):
            print(line.line)
        client.download(job.id, "model.pt")
        client.download_artifact(job.id, "final/model.bin", "model.bin")   # from DPTRAIN_OUTPUT_DIR

Needs httpx and pydantic only (the light `pip install dptrain`): nothing here imports torch,
Celery, SQLAlchemy or FastAPI. The CLI is built on it. See docs/sdk.md.
"""

from __future__ import annotations

import builtins
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from api_schemas import (
    ArtifactInfo,
    ArtifactList,
    CheckpointInfo,
    CheckpointList,
    Job,
    JobList,
    JobSpec,
    JobStacks,
    JobStatus,
    LogLine,
    LogPage,
    MetricSeries,
    WebhookCreated,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookInfo,
    WebhookList,
)
from dptrain.code_routes import CodeRoutes, CodeTooLarge, CodeUpload
from dptrain.errors import DataLeftOut, Unplaceable, WaitTimeout, api_error
from dptrain.left_out import data_warning
from dptrain.settings import ClientSettings
from dptrain.specfile import load_spec
from dptrain.sweeps import SweepRoutes
from dptrain.transfer import download_verified, raise_for_status, retry_after_seconds

__all__ = ["Client", "CodeTooLarge", "CodeUpload"]

# Requests that are safe to send again (reads, and a submit under its Idempotency-Key) are retried
# this many times in all on a broken connection or a 429/503, backing off.
ATTEMPTS = 3
RETRY_STATUS = (429, 503)
MAX_BACKOFF_S = 10.0


class Client(CodeRoutes, SweepRoutes):
    """A connection to one dptrain API as one user."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        """Talk to `url` with `token`; each left out comes from the environment (ClientSettings)."""
        env = ClientSettings.from_env() if url is None or token is None else ClientSettings()
        token = env.token if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if http is None:
            http = httpx.Client(base_url=(url or env.api_url).rstrip("/"), timeout=timeout)
        # `http` lets a test (or a caller with its own transport, proxies or TLS) supply the connection.
        self.http = http
        self.http.headers.update(headers)

    @classmethod
    def from_env(cls) -> Client:
        """A client configured from DPTRAIN_API_URL and DPTRAIN_TOKEN / DPTRAIN_HOME."""
        return cls()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    # -- requests -------------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request, sent again on a broken connection, a 429 or a 503 (each one retry-safe)."""
        for attempt in range(ATTEMPTS):
            last = attempt == ATTEMPTS - 1
            try:
                r = self.http.request(method, path, **kw)
            except httpx.TransportError:
                # A submit may have been accepted before the connection broke: its Idempotency-Key
                # makes the retry answer that job instead of creating a second one.
                if last:
                    raise
                time.sleep(min(MAX_BACKOFF_S, 0.5 * 2**attempt))
                continue
            if r.status_code in RETRY_STATUS and not last:
                time.sleep(
                    min(MAX_BACKOFF_S, retry_after_seconds(r.headers.get("Retry-After"), 0.5 * 2**attempt))
                )
                continue
            return raise_for_status(r)
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._send(method, path, **kw).json()

    # -- jobs -----------------------------------------------------------------------------------

    def submit(
        self,
        spec: JobSpec | Mapping[str, Any] | str | os.PathLike[str],
        *,
        workdir: str | os.PathLike[str] | None = None,
        idempotency_key: str | None = None,
        max_code_bytes: int | None = None,
        include: Sequence[str] = (),
    ) -> Job:
        """Submit a job (a JobSpec, a dict, or a YAML/JSON file), with `workdir` uploaded as its code.

        Sent under an Idempotency-Key (one of its own unless given) that a retry reuses: one call
        never makes two jobs. The answer's `warnings` say, e.g., that no live node can hold it.
        `include` (upload_code) takes ignored files; ignored data or weights left out warn DataLeftOut.
        """
        if isinstance(spec, JobSpec):
            body = spec.model_dump(mode="json", exclude_unset=True)
        elif isinstance(spec, Mapping):
            body = dict(spec)
        else:
            body = load_spec(Path(spec))
        if workdir is not None:
            code = self.upload_code(workdir, max_bytes=max_code_bytes, include=include)
            if (said := data_warning(code.left_out, os.fspath(workdir))) is not None:
                warnings.warn(said, DataLeftOut, stacklevel=2)
            body["code"] = {"sha256": code.sha256}
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return Job.model_validate(self._json("POST", "/v1/jobs", json=body, headers=headers))

    def continue_job(self, job_id: str, *, idempotency_key: str | None = None) -> Job:
        """Submit job `job_id`'s spec again, continuing from its newest checkpoint (`init_from.resume`).

        The new job keeps the spec as it ran, its name included; only `init_from` changes (to
        `{job: job_id, resume: true}`), so its `steps` count on from that checkpoint's step.
        """
        spec = self.get(job_id).spec.model_dump(mode="json", exclude_unset=True)
        spec["init_from"] = {"job": job_id, "resume": True}
        return self.submit(spec, idempotency_key=idempotency_key)

    def get(self, job_id: str) -> Job:
        """One job."""
        return Job.model_validate(self._json("GET", f"/v1/jobs/{job_id}"))

    def list(
        self,
        *,
        status: JobStatus | str | None = None,
        labels: Mapping[str, str] | None = None,
        page_size: int | None = None,
    ) -> Iterator[Job]:
        """Every job this user may see, newest first, fetched a page at a time as it is iterated."""
        params: dict[str, Any] = {}
        if status is not None:
            params["status"] = JobStatus(status).value
        if labels:
            params["label"] = [f"{k}={v}" for k, v in labels.items()]
        if page_size is not None:
            params["limit"] = page_size
        cursor: str | None = None
        while True:
            page = JobList.model_validate(
                self._json("GET", "/v1/jobs", params={**params, **({"cursor": cursor} if cursor else {})})
            )
            yield from page.items
            if page.next_cursor is None or not page.items:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> Job:
        """Ask a job to stop (a queued one ends at once); cancelling an ended job changes nothing."""
        return Job.model_validate(self._json("POST", f"/v1/jobs/{job_id}/cancel"))

    def stacks(self, job_id: str, *, wait: float = 10.0) -> JobStacks:
        """Every thread of every rank of a running job, read by its workers (who get `wait` s to answer)."""
        # The server waits up to `wait` seconds for the dump: the read must outlast it.
        timeout = httpx.Timeout(30.0, read=wait + 30.0)
        data = self._json("GET", f"/v1/jobs/{job_id}/stacks", params={"wait": wait}, timeout=timeout)
        return JobStacks.model_validate(data)

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        poll_interval: float = 1.0,
        on_progress: Callable[[Job], None] | None = None,
        unplaceable_timeout: float | None = None,
    ) -> Job:
        """Poll until the job ends; the ended job (whatever its status: check `job.status`).

        `on_progress(job)` is called with the first answer and with every change. Raises
        WaitTimeout after `timeout` seconds, and Unplaceable once no live node could hold the job for
        `unplaceable_timeout` seconds on end; either way the job itself goes on.
        """
        start = time.monotonic()
        unplaceable_since: float | None = None
        etag: str | None = None
        job: Job | None = None
        while True:
            # If-None-Match: an unchanged job costs the server a 304 from its cache and no body.
            r = self._send("GET", f"/v1/jobs/{job_id}", headers={"If-None-Match": etag} if etag else {})
            now = time.monotonic()
            if r.status_code != 304 or job is None:
                job = Job.model_validate(r.json())
                etag = r.headers.get("ETag")
                if on_progress is not None:
                    on_progress(job)
            if job.status.is_terminal():
                return job
            if job.unplaceable:
                unplaceable_since = now if unplaceable_since is None else unplaceable_since
                if unplaceable_timeout is not None and now - unplaceable_since >= unplaceable_timeout:
                    raise Unplaceable(job, unplaceable_timeout)
            else:
                unplaceable_since = None
            if timeout is not None and now - start >= timeout:
                raise WaitTimeout(job, timeout)
            time.sleep(poll_interval)

    def logs(
        self,
        job_id: str,
        *,
        rank: int | None = None,
        after: int | None = None,
        follow: bool = False,
        poll_interval: float = 1.0,
    ) -> Iterator[LogLine]:
        """A job's output lines in order (from after line id `after`); with `follow`, until it ends."""
        cursor, ended = after, False
        while True:
            params = {k: v for k, v in {"after": cursor, "rank": rank}.items() if v is not None}
            page = LogPage.model_validate(self._json("GET", f"/v1/jobs/{job_id}/logs", params=params))
            yield from page.items
            cursor = page.next_cursor
            if page.items:
                continue
            if not follow or ended:
                return
            # Seen ended, the loop reads once more: lines shipped just before its end are kept.
            ended = self.get(job_id).status.is_terminal()
            if not ended:
                time.sleep(poll_interval)

    def metrics(
        self,
        job_id: str,
        *,
        names: builtins.list[str] | None = None,
        since_step: int | None = None,
        max_points: int | None = None,
    ) -> MetricSeries:
        """The job's metric series (`[step, value]` per name), optionally only some names or after a step."""
        params: dict[str, Any] = {"since_step": since_step, "max_points": max_points}
        if names:
            params["name"] = ",".join(names)
        query = {k: v for k, v in params.items() if v is not None}
        return MetricSeries.model_validate(self._json("GET", f"/v1/jobs/{job_id}/metrics", params=query))

    def checkpoints(self, job_id: str) -> builtins.list[CheckpointInfo]:
        """The job's checkpoints, oldest first."""
        return CheckpointList.model_validate(self._json("GET", f"/v1/jobs/{job_id}/checkpoints")).items

    def download(
        self, job_id: str, dest: str | os.PathLike[str], *, step: int | None = None, best: bool = False
    ) -> CheckpointInfo:
        """Save a checkpoint file at `dest`: the newest, the one of `step`, or (`best`) the best one.

        Streamed to a temporary file beside `dest` and checked against the sha256 the server
        recorded before it is renamed into place: `dest` is never a partial or corrupt file.
        Open it with `torch.load(dest, weights_only=True)`.
        """
        items = self.checkpoints(job_id)
        if best:
            items = [c for c in items if c.best]
        if step is not None:
            items = [c for c in items if c.step == step]
        if not items:
            what = (
                "best checkpoint" if best else "checkpoint" + (f" at step {step}" if step is not None else "")
            )
            raise api_error(404, f"job {job_id} has no {what}", error="NotFound")
        ckpt = items[-1]
        download_verified(
            self.http, f"/v1/jobs/{job_id}/checkpoints/{ckpt.id}/download", Path(dest), ckpt.sha256
        )
        return ckpt

    def artifacts(self, job_id: str) -> builtins.list[ArtifactInfo]:
        """The job's artifacts: the files its DPTRAIN_OUTPUT_DIR held when its last attempt ended."""
        return ArtifactList.model_validate(self._json("GET", f"/v1/jobs/{job_id}/artifacts")).items

    def download_artifact(self, job_id: str, path: str, dest: str | os.PathLike[str]) -> ArtifactInfo:
        """Save the artifact `path` at `dest`, checked against its sha256 as `download` checks checkpoints."""
        found = [a for a in self.artifacts(job_id) if a.path == path]
        if not found:
            raise api_error(404, f"job {job_id} has no artifact {path!r}", error="NotFound")
        download_verified(
            self.http, f"/v1/jobs/{job_id}/artifacts/{quote(path)}", Path(dest), found[0].sha256
        )
        return found[0]

    # -- webhooks (admins) ----------------------------------------------------------------------

    def create_webhook(
        self, url: str, *, events: str | Sequence[str] = "all", owner: str | None = None
    ) -> WebhookCreated:
        """Register a webhook for job state changes; the answer holds its secret, shown this once."""
        body = {"url": url, "events": events if isinstance(events, str) else list(events), "owner": owner}
        return WebhookCreated.model_validate(self._json("POST", "/v1/webhooks", json=body))

    def webhooks(self) -> builtins.list[WebhookInfo]:
        """Every registered webhook (never its secret)."""
        return WebhookList.model_validate(self._json("GET", "/v1/webhooks")).items

    def delete_webhook(self, webhook_id: str) -> None:
        """Remove a webhook; its deliveries not yet sent are dropped."""
        self._send("DELETE", f"/v1/webhooks/{quote(webhook_id)}")

    def webhook_deliveries(self, webhook_id: str, *, limit: int = 100) -> builtins.list[WebhookDelivery]:
        """A webhook's newest deliveries, each with its last status."""
        path = f"/v1/webhooks/{quote(webhook_id)}/deliveries"
        return WebhookDeliveryList.model_validate(self._json("GET", path, params={"limit": limit})).items
