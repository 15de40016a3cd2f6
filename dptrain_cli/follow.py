"""Following a job live: the progress bar of `submit --wait`, and the view of `dptrain watch`."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from types import TracebackType

from rich.console import Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from api_schemas import Job, JobStatus
from dptrain.client import Client
from dptrain_cli.output import clean, emit_json, err, out, step_text

SPARK = "▁▂▃▄▅▆▇█"
# Points of each curve `watch` fetches per refresh: as many as the sparkline shows, downsampled by
# the server, so a long job costs no more than a short one.
SPARK_POINTS = 48
CURVES = ("loss", "eval/loss")


def environment_text(job: Job, now: datetime | None = None) -> str | None:
    """`preparing environment (12 s)` while a running job's environment is had; how it was, once ready."""
    build = job.environment_build
    if build is None:
        return None
    if build.state == "preparing":
        if job.status is not JobStatus.RUNNING:
            return None
        since = build.started_at
        elapsed = f" ({((now or datetime.now(UTC)) - since).total_seconds():.0f} s)" if since else ""
        return f"preparing environment{elapsed}"
    how = "cache hit" if build.cache_hit else f"built in {build.build_seconds or 0:.1f} s"
    return f"environment {(build.key or '')[:16]}: {how}"


class Progress:
    """A transient progress bar on stderr for `submit --wait`, updated with each changed job."""

    def __init__(self, job: Job) -> None:
        # Without a total (a command that set no `hyperparameters.steps`) rich's bar pulses and the
        # count is the last reported step alone.
        count = TextColumn(
            "{task.completed}" + ("/{task.total}" if job.progress.total_steps is not None else "")
        )
        columns = (TextColumn("{task.description}"), BarColumn(), count)
        self.bar = RichProgress(*columns, TimeElapsedColumn(), console=err, transient=True)
        self.task = self.bar.add_task(job.status.value, total=job.progress.total_steps)

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.bar.__exit__(kind, exc, tb)

    def update(self, job: Job) -> None:
        """Show `job`'s status, step and loss."""
        loss = job.latest_metrics.get("loss")
        desc = job.status.value + (f" loss={loss:.4g}" if loss is not None else "")
        self.bar.update(self.task, completed=job.progress.step, description=desc)


def sparkline(values: list[float]) -> str:
    """`values` as one line of block characters, lowest to highest (non-finite values as spaces)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(
        SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] if math.isfinite(v) else " "
        for v in values
    )


def render(job: Job, curves: dict[str, list[float]]) -> RenderableType:
    """The watch view of `job`: a header, a progress bar, and each curve's latest value and shape."""
    p = job.progress
    name = clean(job.name)
    head = Text.assemble(
        (clean(job.id), "bold"), "  ", name, "  ", (job.status.value, "cyan"), f"  attempt {job.attempt}"
    )
    bar = Table.grid(padding=(0, 1))
    # total=None: rich draws a pulsing bar, no fraction of a total the job does not have.
    total = max(p.total_steps, 1) if p.total_steps is not None else None
    label = step_text(p.step, p.total_steps) if total is not None else f"step {p.step}"
    bar.add_row(ProgressBar(total=total, completed=p.step, width=40), label)
    rows = Table.grid(padding=(0, 2))
    for name in CURVES:
        values = curves.get(name) or []
        latest = job.latest_metrics.get(name, values[-1] if values else None)
        if latest is not None:
            rows.add_row(name, f"{latest:.6g}", sparkline(values))
    parts: list[RenderableType] = [head, bar, rows]
    if job.queued_reason and not job.status.is_terminal() and job.progress.step == 0:
        parts.append(Text(clean(job.queued_reason), style="dim"))
    if job.status is JobStatus.RUNNING and (env_line := environment_text(job)) is not None:
        parts.append(Text(clean(env_line), style="dim"))
    parts += [Text(f"warning: {clean(w)}", style="yellow") for w in job.warnings]
    return Group(*parts)


def watch_job(client: Client, job_id: str, *, interval: float, as_json: bool) -> Job:
    """Follow `job_id` to its end, showing each change (a JSON line each with `as_json`); the ended job."""
    if as_json:
        return client.wait(job_id, poll_interval=interval, on_progress=lambda j: emit_json(j, lines=True))
    with Live(console=out, auto_refresh=False, transient=False) as live:
        curves: dict[str, list[float]] = {}
        read_at: int | None = None  # the step the curves were read at

        def show(job: Job) -> None:
            nonlocal curves, read_at
            # The curves move only with the step: another change (a status, a reason) redraws alone.
            if read_at != job.progress.step:
                series = client.metrics(job.id, names=list(CURVES), max_points=SPARK_POINTS).series
                curves = {name: [v for _step, v in points] for name, points in series.items()}
                read_at = job.progress.step
            live.update(render(job, curves), refresh=True)

        return client.wait(job_id, poll_interval=interval, on_progress=show)
