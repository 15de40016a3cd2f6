"""`GET /metrics` in Prometheus format: the database's view read at scrape time, plus request latency.

Job counts, the queue, start delays and heartbeats live in the database (workers write them from
other processes), so a custom collector reads them when Prometheus scrapes; request latency is
measured here, in this process, by an ASGI middleware.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas import JobStatus
from service.models.base import utcnow
from service.nodes.service import public_name
from service.ops import repository

START_DELAY_WINDOW = timedelta(hours=1)
START_DELAY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
INGEST_WINDOW_SECONDS = 60.0


class DatabaseCollector(Collector):
    """Reads job, worker and ingest figures from the database at each scrape.

    Not registered in a registry: what it answers depends on who scrapes (`Scrape`).
    """

    def __init__(self, sessions: Callable[[], Session]) -> None:
        self.sessions = sessions
        # (monotonic time, newest metric id) of recent scrapes: the ingest rate is the id's growth.
        self.samples: deque[tuple[float, int]] = deque()

    def collect(self, *, reveal_hosts: bool = False) -> Iterator[Metric]:
        """The figures now; worker names as `/v1/workers` shows them to a non-admin unless `reveal_hosts`."""
        now = utcnow()
        with self.sessions() as session:
            counts = repository.job_counts(session)
            delays = repository.start_delays(session, started_after=now - START_DELAY_WINDOW)
            beats = repository.heartbeats(session)
            last_id = repository.last_metric_id(session)
        jobs = GaugeMetricFamily("dptrain_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily(
            "dptrain_queue_depth",
            "Jobs queued and not yet started.",
            value=counts.get(JobStatus.QUEUED.value, 0),
        )
        yield _start_delays([(s - c).total_seconds() for c, s in delays])
        ages = GaugeMetricFamily(
            "dptrain_worker_heartbeat_age_seconds",
            "Seconds since each worker's last heartbeat.",
            labels=["worker"],
        )
        for b in beats:
            name = (
                b.name
                if reveal_hosts
                else public_name(b.name, hostname=b.hostname, address=b.address, started_at=b.started_at)
            )
            ages.add_metric([name], max(0.0, (now - b.last_heartbeat).total_seconds()))
        yield ages
        yield GaugeMetricFamily(
            "dptrain_metric_points_ingested_per_second",
            "Metric points written per second over about the last minute (0 until two scrapes).",
            value=self._ingest_rate(last_id),
        )

    def _ingest_rate(self, last_id: int) -> float:
        # Points carry no write time; metric ids come from a sequence, one per point, so the growth
        # of the newest id between scrapes is the number of points written in between.
        t = time.monotonic()
        self.samples.append((t, last_id))
        while len(self.samples) > 2 and t - self.samples[1][0] >= INGEST_WINDOW_SECONDS:
            self.samples.popleft()
        t0, id0 = self.samples[0]
        return (last_id - id0) / (t - t0) if t > t0 else 0.0


class Scrape(Collector):
    """One scrape's answer: this process's registry (request latency) and the database's figures."""

    def __init__(
        self, registry: CollectorRegistry, database: DatabaseCollector, *, reveal_hosts: bool
    ) -> None:
        self.registry = registry
        self.database = database
        self.reveal_hosts = reveal_hosts

    def collect(self) -> Iterator[Metric]:
        """Every family of this scrape, as `generate_latest` reads them."""
        yield from self.registry.collect()
        yield from self.database.collect(reveal_hosts=self.reveal_hosts)


def _start_delays(delays: list[float]) -> GaugeHistogramMetricFamily:
    # A gauge histogram: it describes the jobs started in the last hour, so buckets may go down.
    buckets = [(str(le), float(sum(1 for d in delays if d <= le))) for le in START_DELAY_BUCKETS]
    buckets.append(("+Inf", float(len(delays))))
    return GaugeHistogramMetricFamily(
        "dptrain_job_start_delay_seconds",
        "Seconds from submit to start of the jobs started in the last hour.",
        buckets=buckets,
        gsum_value=sum(delays),
    )


def request_histogram(registry: CollectorRegistry) -> Histogram:
    """API request latency (to the response's headers) by route template, method and status."""
    return Histogram(
        "dptrain_http_request_duration_seconds",
        "API request latency until the response starts, by route template, method and status.",
        ["route", "method", "status"],
        registry=registry,
    )


class RequestLatency:
    """Pure ASGI middleware feeding `request_histogram`; an event stream counts until it starts."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The router put the matched route in the scope: label by its template, never by
                # the raw path, so job ids do not each make a series.
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                self.histogram.labels(route, scope["method"], str(message["status"])).observe(
                    time.perf_counter() - start
                )
            await send(message)

        await self.app(scope, receive, timed_send)
