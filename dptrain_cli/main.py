"""`dptrain`: run the service, or talk to it (submit, status, list, cancel, logs)."""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from api_schemas import JobStatus
from dptrain_cli import server, users
from dptrain_cli.client import ApiError, Client
from dptrain_cli.junit import junit_report
from dptrain_cli.workdir import Packed, pack

app = typer.Typer(no_args_is_help=True, help="dptrain: data-parallel training jobs over HTTP.")
out = Console()
err = Console(stderr=True)

app.command()(server.api)
app.command()(server.worker)
app.command()(server.migrate)
app.command()(server.up)
app.add_typer(users.app, name="users")

EXIT_SUCCEEDED, EXIT_FAILED, EXIT_TIMEOUT, EXIT_REFUSED, EXIT_CANCELLED = 0, 1, 2, 3, 4


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading `1e-4` as the float YAML 1.2 says it is.

    PyYAML follows YAML 1.1, where a float needs a dot (`1.0e-4`); `lr: 1e-4` would reach the API
    as the string "1e-4", which the spec's strict types refuse.
    """


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _load_spec(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_SpecLoader)
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path} does not hold a job spec object")
    return data


def _refused(exc: ApiError) -> typer.Exit:
    if isinstance(exc.detail, list):
        for e in exc.detail:
            loc = ".".join(str(p) for p in e.get("loc", []) if p != "body")
            err.print(f"[red]{loc}[/red]: {e.get('msg')}")
    else:
        err.print(f"[red]refused ({exc.status_code})[/red]: {exc.detail}")
    return typer.Exit(EXIT_REFUSED)


def _exit_for(job: dict[str, Any]) -> int:
    return {JobStatus.SUCCEEDED: EXIT_SUCCEEDED, JobStatus.CANCELLED: EXIT_CANCELLED}.get(
        JobStatus(job["status"]), EXIT_FAILED
    )


def _report_end(job: dict[str, Any]) -> None:
    colour = "green" if JobStatus(job["status"]) is JobStatus.SUCCEEDED else "red"
    out.print(f"job {job['id']} [{colour}]{job['status']}[/{colour}] at step {job['progress']['step']}")
    if job.get("error"):
        e = job["error"]
        rank = f" on rank {e['rank']}" if e.get("rank") is not None else ""
        err.print(f"[red]{e['type']}{rank}: {e['message']}[/red]")
        if e.get("traceback"):
            err.print(e["traceback"], markup=False, highlight=False)


def _too_big(workdir: Path, packed: Packed, reason: str) -> typer.Exit:
    err.print(f"[red]code refused[/red]: {reason}")
    err.print("largest paths it would upload:")
    for path, size in packed.largest:
        err.print(f"  {decimal(size):>10}  {path}", markup=False, highlight=False)
    err.print(f"Leave out what the job does not need with a .dptrainignore in {workdir} (.gitignore syntax).")
    return typer.Exit(EXIT_REFUSED)


def _ship_code(client: Client, workdir: Path, *, max_bytes: int | None) -> str:
    """Pack `workdir`, upload it unless the server has it; its sha256."""
    with tempfile.TemporaryDirectory(prefix="dptrain-code-") as tmp:
        packed = pack(workdir, Path(tmp) / "code.tar.gz")
        # stderr: stdout holds only the job id, for `JOB=$(dptrain submit ...)`.
        err.print(f"code {packed.sha256[:12]} {decimal(packed.size_bytes)} ({packed.files} files)")
        for path, why in packed.skipped:
            err.print(f"[yellow]warning[/yellow]: skipped {path}: {why}", highlight=False)

        def refuse_over(limit: int | None, name: str) -> None:
            if limit is not None and packed.size_bytes > limit:
                over = f"the archive is {packed.size_bytes} bytes, over {name} {limit}"
                raise _too_big(workdir, packed, over)

        refuse_over(max_bytes, "--max-code-bytes")
        sha256 = packed.sha256
        try:
            held, server_max = client.code_status(sha256)
            if not held:
                refuse_over(server_max, "the server's DPTRAIN_CODE_MAX_BYTES")
            uploaded = not held and client.upload_code(sha256, packed.path)
        except ApiError as exc:
            if exc.status_code == 413:
                raise _too_big(workdir, packed, str(exc.detail)) from exc
            raise _refused(exc) from exc
    err.print("code uploaded" if uploaded else "code already on the server")
    return sha256


def _follow(client: Client, job: dict[str, Any], *, timeout: float) -> tuple[dict[str, Any], bool]:
    """Poll `job` with a progress bar until it ends or `timeout` seconds pass; (job, timed out)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(job["status"], total=job["progress"]["total_steps"])
        while not JobStatus(job["status"]).is_terminal():
            if deadline is not None and time.monotonic() > deadline:
                return job, True
            time.sleep(1.0)
            job = client.get(job["id"])
            loss = job["latest_metrics"].get("loss")
            desc = job["status"] + (f" loss={loss:.4g}" if loss is not None else "")
            bar.update(task, completed=job["progress"]["step"], description=desc)
    return job, False


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
    wait: bool = typer.Option(False, "--wait", help="Follow the job to its end with a progress bar."),
    timeout: float = typer.Option(0, "--timeout", help="With --wait: give up after S seconds (exit 2)."),
    junit: Path | None = typer.Option(
        None, "--junit", dir_okay=False, help="With --wait: write a JUnit XML report here (also on timeout)."
    ),
    max_code_bytes: int | None = typer.Option(
        None, "--max-code-bytes", min=1, help="Refuse a --workdir archive over N bytes before uploading."
    ),
) -> None:
    """Submit a job; print its id.

    Exit codes: 0 submitted (with --wait: succeeded); 1 failed; 2 timed out (the job keeps running);
    3 refused (by the API: the spec or the code upload; or by the CLI before uploading);
    4 cancelled.
    """
    if junit is not None and not wait:
        err.print("[red]--junit needs --wait[/red]: the report is written when the job ends")
        raise typer.Exit(EXIT_REFUSED)
    client = Client.from_env()
    spec = _load_spec(file)
    if workdir is not None:
        spec["code"] = {"sha256": _ship_code(client, workdir, max_bytes=max_code_bytes)}
    started = time.monotonic()
    try:
        job = client.submit(spec)
    except ApiError as exc:
        raise _refused(exc) from exc
    out.print(job["id"])
    if not wait:
        return
    job, timed_out = _follow(client, job, timeout=timeout)
    if junit is not None:
        junit.write_bytes(junit_report(job, elapsed=time.monotonic() - started, timed_out=timed_out))
    if timed_out:
        err.print(
            f"[yellow]timed out after {timeout:g} s; job {job['id']} is {job['status']} and keeps running"
            f" (dptrain cancel {job['id']} stops it)[/yellow]"
        )
        raise typer.Exit(EXIT_TIMEOUT)
    _report_end(job)
    raise typer.Exit(_exit_for(job))


@app.command()
def status(job_id: str) -> None:
    """Show one job as JSON."""
    try:
        out.print_json(data=Client.from_env().get(job_id))
    except ApiError as exc:
        raise _refused(exc) from exc


@app.command("list")
def list_jobs(
    limit: int = typer.Option(20, help="How many jobs."), status: str | None = typer.Option(None)
) -> None:
    """List recent jobs."""
    try:
        page = Client.from_env().list(limit=limit, status=status)
    except ApiError as exc:
        raise _refused(exc) from exc
    table = Table("id", "name", "status", "step", "owner", "created")
    for j in page["items"]:
        p = j["progress"]
        table.add_row(
            j["id"], j["name"], j["status"], f"{p['step']}/{p['total_steps']}", j["owner"], j["created_at"]
        )
    out.print(table)


@app.command()
def cancel(job_id: str) -> None:
    """Cancel a job."""
    try:
        job = Client.from_env().cancel(job_id)
    except ApiError as exc:
        raise _refused(exc) from exc
    out.print(f"job {job_id}: {job['status']}" + (" (stop requested)" if job.get("cancel_requested") else ""))


@app.command()
def logs(
    job_id: str,
    rank: int | None = typer.Option(None, help="Only this rank."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep reading until the job ends."),
) -> None:
    """Print a job's per-rank output."""
    client = Client.from_env()
    cursor: int | None = None
    try:
        while True:
            page = client.logs(job_id, after=cursor, rank=rank)
            for line in page["items"]:
                who = "launcher" if line["rank"] is None else f"rank{line['rank']}"
                out.print(f"[dim]{who}[/dim] {line['line']}", markup=True, highlight=False)
            cursor = page["next_cursor"]
            if not follow:
                if page["items"]:
                    continue
                return
            if not page["items"]:
                if JobStatus(client.get(job_id)["status"]).is_terminal():
                    return
                time.sleep(1.0)
    except ApiError as exc:
        raise _refused(exc) from exc


if __name__ == "__main__":
    app()
