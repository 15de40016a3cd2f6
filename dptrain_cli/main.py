"""`dptrain`: talk to the service (submit, status, list, cancel, logs, stacks, watch, download) or run it.

Built on `dptrain.Client`. The client commands need only the light install (`pip install dptrain`);
the server commands (api, worker, migrate, up, users) are found by entry point (dptrain_server
registers them) and loaded only when one of them is asked for (dptrain_cli/lazy.py); they import
the server's modules when they run, and say which extra to install when those are missing.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

import httpx
import typer
from rich.filesize import decimal
from rich.table import Column, Table
from rich.text import Text

from api_schemas import Job, JobError, JobStatus
from dptrain.client import Client
from dptrain.errors import Unplaceable, WaitTimeout
from dptrain.left_out import Include
from dptrain.specfile import SpecFileError, init_from_arg, load_spec
from dptrain_cli.calls import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_SUCCEEDED,
    EXIT_TIMEOUT,
    EXIT_UNPLACEABLE,
    OUTPUT,
)
from dptrain_cli.calls import api as _api
from dptrain_cli.calls import fetch as _fetch
from dptrain_cli.follow import Progress, environment_text, watch_job
from dptrain_cli.junit import junit_report
from dptrain_cli.lazy import WithServerCommands
from dptrain_cli.output import Output, emit_json, inert, out, say, step_text
from dptrain_cli.stacks import show_stacks
from dptrain_cli.sweeps import app as sweeps_app
from dptrain_cli.upload import ship_code
from dptrain_cli.webhooks import app as webhooks_app

app = typer.Typer(
    cls=WithServerCommands, no_args_is_help=True, help="dptrain: data-parallel training jobs over HTTP."
)

app.add_typer(webhooks_app, name="webhooks")
app.add_typer(sweeps_app, name="sweep")


def _exit_for(job: Job) -> int:
    # A pruned trial was stopped on purpose, as a cancelled job is.
    ends = {
        JobStatus.SUCCEEDED: EXIT_SUCCEEDED,
        JobStatus.CANCELLED: EXIT_CANCELLED,
        JobStatus.PRUNED: EXIT_CANCELLED,
    }
    return ends.get(job.status, EXIT_FAILED)


def _report_end(job: Job) -> None:
    colour = "green" if job.status is JobStatus.SUCCEEDED else "red"
    # A Text, not markup: the id is the server's word, which the CLI does not parse either.
    out.print(
        Text.assemble("job ", inert(job.id), " ", (job.status.value, colour), f" at step {job.progress.step}")
    )
    if job.error is not None:
        _say_error(job.error, stderr=True)


def _say_error(error: JobError, *, stderr: bool = False, prefix: str = "") -> None:
    """A job's error as the ranks reported it: type, rank, message and traceback, whole and inert."""
    rank = f" on rank {error.rank}" if error.rank is not None else ""
    say(f"{prefix}{error.type}{rank}: {error.message}", stderr=stderr)
    if error.traceback:
        say(error.traceback, stderr=stderr)


@app.command()
def submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="Job spec, YAML or JSON."),
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        exists=True,
        file_okay=False,
        help="Upload this directory (minus .gitignore/.dptrainignore) as the job's code.",
    ),
    include: list[str] = typer.Option(
        [],
        "--include",
        help="With --workdir: upload files the ignore rules leave out that match PATTERN (.gitignore "
        "syntax, relative to the workdir, e.g. '*.bin' or 'data/'). Repeatable.",
    ),
    wait: bool = typer.Option(False, "--wait", help="Follow the job to its end with a progress bar."),
    timeout: float = typer.Option(0, "--timeout", help="With --wait: give up after S seconds (exit 2)."),
    unplaceable_timeout: float = typer.Option(
        60,
        "--unplaceable-timeout",
        min=0,
        help="With --wait: give up (exit 5) once no live node could hold the job for S seconds.",
    ),
    junit: Path | None = typer.Option(
        None, "--junit", dir_okay=False, help="With --wait: write a JUnit XML report here (also on timeout)."
    ),
    max_code_bytes: int | None = typer.Option(
        None, "--max-code-bytes", min=1, help="Refuse a --workdir archive over N bytes before uploading."
    ),
    start_from: str | None = typer.Option(
        None,
        "--from",
        metavar="ID[:STEP|:best]",
        help="Start from a checkpoint of job ID (its newest, step STEP, or its best): the spec's init_from.",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="With --from: continue its training state too (optimizer, ITER...)."
    ),
    output: Output = OUTPUT,
) -> None:
    """Submit a job; print its id (the job with --output json).

    Exit codes: 0 submitted (with --wait: succeeded); 1 failed; 2 timed out (the job keeps running);
    3 refused (by the API: the spec or the code upload; or by the CLI before uploading);
    4 cancelled; 5 no live node could hold it for --unplaceable-timeout (it stays queued).
    """
    if junit is not None and not wait:
        say("--junit needs --wait: the report is written when the job ends", stderr=True)
        raise typer.Exit(EXIT_REFUSED)
    try:
        spec = load_spec(file)
    except SpecFileError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if resume and start_from is None:
        raise typer.BadParameter("--resume needs --from: it says how to start from that checkpoint")
    if start_from is not None:
        try:
            spec["init_from"] = init_from_arg(start_from, resume=resume)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--from") from exc
    if include and workdir is None:
        raise typer.BadParameter("--include needs --workdir: it picks files of the uploaded tree")
    try:
        Include(include)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--include") from exc
    with _api() as client:
        if workdir is not None:
            spec["code"] = {"sha256": ship_code(client, workdir, max_bytes=max_code_bytes, include=include)}
        started = time.monotonic()
        job = client.submit(spec)
        emit_json(job) if output is Output.json else say(job.id)
        for warning in job.warnings:
            say(f"warning: {warning}", stderr=True)
        if not wait:
            return
        code = _wait(
            client,
            job,
            timeout=timeout,
            unplaceable_timeout=unplaceable_timeout,
            junit=junit,
            started=started,
        )
    raise typer.Exit(code)


def _wait(
    client: Client,
    job: Job,
    *,
    timeout: float,
    unplaceable_timeout: float,
    junit: Path | None,
    started: float,
) -> int:
    """Follow `job` with a progress bar to its end; the exit code, and the JUnit report if asked."""
    timed_out, code = False, None
    with Progress(job) as bar:
        try:
            job = client.wait(
                job.id,
                timeout=timeout or None,
                on_progress=bar.update,
                unplaceable_timeout=unplaceable_timeout,
            )
        except WaitTimeout as exc:
            job, timed_out = exc.job, True
        except Unplaceable as exc:
            job, timed_out, code = exc.job, True, EXIT_UNPLACEABLE
    if junit is not None:
        junit.write_bytes(
            junit_report(job.model_dump(mode="json"), elapsed=time.monotonic() - started, timed_out=timed_out)
        )
    if code == EXIT_UNPLACEABLE:
        say(
            f"no live node could hold job {job.id} for {unplaceable_timeout:g} s: "
            f"{job.queued_reason or 'no node of its kind is big enough'}. It stays queued "
            f"(dptrain cancel {job.id} removes it).",
            stderr=True,
        )
        return EXIT_UNPLACEABLE
    if timed_out:
        say(
            f"timed out after {timeout:g} s; job {job.id} is {job.status.value} and keeps running"
            f" (dptrain cancel {job.id} stops it)",
            stderr=True,
        )
        return EXIT_TIMEOUT
    _report_end(job)
    return _exit_for(job)


@app.command("continue")
def continue_(job_id: str, output: Output = OUTPUT) -> None:
    """Continue a job from its newest checkpoint: its spec again (same name), init_from {job, resume: true}.

    Prints the new job's id (the job with --output json); its steps count on from that checkpoint.
    """
    with _api() as client:
        job = client.continue_job(job_id)
    emit_json(job) if output is Output.json else say(job.id)


@app.command()
def status(job_id: str, output: Output = OUTPUT) -> None:
    """Show one job: its state, progress, latest metrics and error."""
    if (job := _fetch(output, lambda c: c.get(job_id))) is None:
        return
    p = job.progress
    step = step_text(p.step, p.total_steps)
    say(f"{job.id}  {job.name}  {job.status.value}  step {step}  attempt {job.attempt}")
    say(f"owner {job.owner}  created {job.created_at.isoformat()}")
    if job.status is JobStatus.QUEUED and (job.queued_reason or job.queue_position):
        kind = job.spec.resources.device
        place = f"#{job.queue_position} in the {kind} queue" if job.queue_position else ""
        say(f"queued: {'; '.join(s for s in (place, job.queued_reason) if s)}")
    if (env_line := environment_text(job)) is not None:
        say(env_line)
    for warning in job.warnings:
        say(f"warning: {warning}")
    for name, value in sorted(job.latest_metrics.items()):
        say(f"  {name} = {value:.6g}")
    if job.error is not None:
        # A queued job's error is its last attempt's, which it restarts after (a start clears it).
        _say_error(job.error, prefix="restarting after: " if job.status is JobStatus.QUEUED else "error: ")


@app.command("list")
def list_jobs(
    limit: int = typer.Option(20, min=1, help="How many jobs, newest first."),
    status: JobStatus | None = typer.Option(None, help="Only jobs in this state."),
    output: Output = OUTPUT,
) -> None:
    """List recent jobs."""
    if (
        jobs := _fetch(
            output, lambda c: list(islice(c.list(status=status, page_size=min(limit, 100)), limit))
        )
    ) is None:
        return
    # Whole ids, however narrow the terminal: they are what the other commands take.
    table = Table(Column("id", no_wrap=True, min_width=32), "name", "status", "step", "owner", "created")
    for j in jobs:
        p = j.progress
        # Text objects, not strings: a job's name is the user's, never markup.
        table.add_row(
            *map(inert, (j.id, j.name, j.status.value, step_text(p.step, p.total_steps), j.owner)),
            inert(j.created_at.isoformat()),
        )
    out.print(table)


@app.command()
def cancel(job_id: str, output: Output = OUTPUT) -> None:
    """Cancel a job."""
    if (job := _fetch(output, lambda c: c.cancel(job_id))) is None:
        return
    say(f"job {job_id}: {job.status.value}" + (" (stop requested)" if job.cancel_requested else ""))


@app.command()
def logs(
    job_id: str,
    rank: int | None = typer.Option(None, help="Only this rank."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep reading until the job ends."),
    output: Output = OUTPUT,
) -> None:
    """Print a job's per-rank output, each line whole (JSON lines with --output json)."""
    with _api() as client:
        for line in client.logs(job_id, rank=rank, follow=follow):
            if output is Output.json:
                emit_json(line, lines=True)
            else:
                who = "launcher" if line.rank is None else f"rank{line.rank}"
                say(f"{who} {line.line}")


@app.command()
def stacks(
    job_id: str,
    wait: float = typer.Option(10.0, min=0, max=30, help="Seconds to wait for the workers' fresh dump."),
    output: Output = OUTPUT,
) -> None:
    """Print where every thread of every rank of a running job is (py-spy, read by its workers)."""
    if (found := _fetch(output, lambda c: c.stacks(job_id, wait=wait))) is not None:
        show_stacks(found)


@app.command()
def checkpoints(job_id: str, output: Output = OUTPUT) -> None:
    """List a job's checkpoints, oldest first."""
    if (items := _fetch(output, lambda c: c.checkpoints(job_id))) is None:
        return
    table = Table("id", "step", "size", "created", "best", "sha256")
    for c in items:
        # Text objects: a sha256 is what a rank reported (a command's own script writes it), never markup.
        best = "*" if c.best else ""
        row = (str(c.id), str(c.step), decimal(c.size_bytes), c.created_at.isoformat(), best, c.sha256[:12])
        table.add_row(*map(inert, row))
    out.print(table)


@app.command()
def artifacts(job_id: str, output: Output = OUTPUT) -> None:
    """List a job's artifacts: the files its DPTRAIN_OUTPUT_DIR held when its last attempt ended."""
    if (items := _fetch(output, lambda c: c.artifacts(job_id))) is None:
        return
    table = Table("path", "size", "sha256")
    for a in items:
        # A path is what the job's own script named: shown, never markup.
        table.add_row(*map(inert, (a.path, decimal(a.size_bytes), a.sha256[:12])))
    out.print(table)


@app.command()
def download(
    job_id: str,
    step: int | None = typer.Option(
        None, "--step", help="The checkpoint of this step (default: the newest)."
    ),
    best: bool = typer.Option(False, "--best", help="The job's best checkpoint (checkpoint.keep_best)."),
    artifact: str | None = typer.Option(
        None, "--artifact", help="This artifact (a path `dptrain artifacts` lists) instead of a checkpoint."
    ),
    dest: Path | None = typer.Option(
        None, "-o", "--out", dir_okay=False, help="Where to write the file (an artifact: its name here)."
    ),
    output: Output = OUTPUT,
) -> None:
    """Download a checkpoint (or an --artifact), checked against its sha256."""
    if artifact is not None:
        dest = dest or Path(Path(artifact).name)
        with _api() as client:
            info = client.download_artifact(job_id, artifact, dest)
        if output is Output.json:
            emit_json({"path": str(dest), "artifact": info.model_dump(mode="json")})
        else:
            say(f"{dest}: {info.path}, {decimal(info.size_bytes)}, sha256 {info.sha256[:12]}")
        return
    if dest is None:
        raise typer.BadParameter("a checkpoint needs -o/--out", param_hint="'-o' / '--out'")
    with _api() as client:
        ckpt = client.download(job_id, dest, step=step, best=best)
    if output is Output.json:
        emit_json({"path": str(dest), "checkpoint": ckpt.model_dump(mode="json")})
        return
    say(f"{dest}: step {ckpt.step}, {decimal(ckpt.size_bytes)}, sha256 {ckpt.sha256[:12]}")


@app.command()
def watch(
    job_id: str,
    interval: float = typer.Option(2.0, min=0.2, help="Seconds between refreshes."),
    output: Output = OUTPUT,
) -> None:
    """Watch a job live: status, progress, loss and eval loss, until it ends; exits like submit --wait."""
    with _api() as client:
        try:
            job = watch_job(client, job_id, interval=interval, as_json=output is Output.json)
        except httpx.HTTPError as exc:
            say(f"lost the API: {exc}", stderr=True)
            raise typer.Exit(EXIT_FAILED) from exc
    if output is Output.text:
        _report_end(job)
    raise typer.Exit(_exit_for(job))


if __name__ == "__main__":
    app()
