"""`dptrain sweep`: submit a hyperparameter sweep from a file, watch its trials, cancel it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from dptrain.sweeps import Sweep, SweepTimeout, Trial, load_sweep_spec
from dptrain_cli.calls import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_SUCCEEDED,
    EXIT_TIMEOUT,
    OUTPUT,
    api,
    fetch,
)
from dptrain_cli.output import Output, emit_json, inert, out, say

app = typer.Typer(
    no_args_is_help=True, help="Hyperparameter sweeps: many trials of one job, searched and pruned."
)

# A sweep's end as `submit --wait` ends: like a job's (0 succeeded, 1 failed, 4 cancelled).
_EXIT = {"succeeded": EXIT_SUCCEEDED, "cancelled": EXIT_CANCELLED}


def sweep_exit(sweep: Sweep) -> int:
    """The exit code of an ended sweep."""
    return _EXIT.get(sweep.get("state", ""), EXIT_FAILED)


def ranked(sweep: Sweep) -> list[Trial]:
    """The trials best first by the objective's direction; trials without an objective last, by number."""
    maximize = sweep.get("spec", {}).get("objective", {}).get("direction") == "maximize"
    scored = [t for t in sweep.get("trials", []) if isinstance(t.get("objective"), int | float)]
    rest = [t for t in sweep.get("trials", []) if t not in scored]
    scored.sort(key=lambda t: (-1 if maximize else 1) * float(t["objective"] or 0.0))
    return scored + sorted(rest, key=lambda t: t.get("number", 0))


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _objective(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, int | float) else "-"


def sweep_table(sweep: Sweep) -> Table:
    """The trials as a table, best first; the best trial (the server's pick) marked with `*`."""
    paths = sorted({p for t in sweep.get("trials", []) for p in t.get("params", {})})
    metric = sweep.get("spec", {}).get("objective", {}).get("metric", "objective")
    best = (sweep.get("best") or {}).get("number")
    table = Table("", "trial", "job", "status", str(metric), *paths)
    for t in ranked(sweep):
        params = t.get("params", {})
        cells = [str(t.get("number", "")), str(t.get("job_id", "")), str(t.get("status", ""))]
        cells += [_objective(t.get("objective"))] + [_value(params[p]) if p in params else "" for p in paths]
        mark = Text("*", style="bold green") if best is not None and t.get("number") == best else Text("")
        table.add_row(mark, *map(inert, cells))
    return table


def show(sweep: Sweep) -> None:
    """A sweep's heading line, its trials and its best trial, for people."""
    trials = sweep.get("trials", [])
    say(f"sweep {sweep.get('id')} {sweep.get('name', '')}: {sweep.get('state')}, {len(trials)} trials")
    if trials:
        out.print(sweep_table(sweep))
    if best := sweep.get("best"):
        params = ", ".join(f"{k}={_value(v)}" for k, v in sorted(best.get("params", {}).items()))
        objective = _objective(best.get("objective"))
        say(f"best: trial {best.get('number')} (job {best.get('job_id')}) {objective} {params}")


@app.command("submit")
def submit(
    file: Path = typer.Argument(..., help="The sweep file (YAML): name, base, space, objective, ..."),
    wait: bool = typer.Option(False, "--wait", help="Follow the sweep until it ends."),
    timeout: float = typer.Option(0, "--timeout", help="With --wait: give up after S seconds (exit 2)."),
    output: Output = OUTPUT,
) -> None:
    """Submit a sweep. Exit codes like `submit --wait`: 0 submitted (with --wait: succeeded), 1 failed,
    2 timed out (the sweep goes on), 3 refused, 4 cancelled."""
    try:
        spec = load_sweep_spec(file)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        say(f"{file}: {exc}", stderr=True)
        raise typer.Exit(EXIT_REFUSED) from exc
    with api() as client:
        sweep = client.submit_sweep(spec)
        if not wait:
            emit_json(sweep) if output is Output.json else say(f"sweep {sweep.get('id')} submitted")
            return
        if output is Output.text:
            say(f"sweep {sweep.get('id')} submitted; waiting for it to end")
        try:
            sweep = client.wait_sweep(str(sweep.get("id")), timeout=timeout or None)
        except SweepTimeout as exc:
            emit_json(exc.sweep) if output is Output.json else show(exc.sweep)
            say(str(exc), stderr=True)
            raise typer.Exit(EXIT_TIMEOUT) from exc
    emit_json(sweep) if output is Output.json else show(sweep)
    raise typer.Exit(sweep_exit(sweep))


@app.command("status")
def status(sweep_id: str, output: Output = OUTPUT) -> None:
    """A sweep's state and its trials, best objective first (the best marked `*`)."""
    if (sweep := fetch(output, lambda c: c.sweep(sweep_id))) is not None:
        show(sweep)


@app.command("list")
def list_sweeps(limit: int = typer.Option(50, min=1, max=200), output: Output = OUTPUT) -> None:
    """Your newest sweeps."""
    if (page := fetch(output, lambda c: c.sweeps(limit=limit))) is None:
        return
    table = Table("id", "name", "state", "trials", "best", "created")
    for s in page.get("items", []):
        best = _objective((s.get("best") or {}).get("objective"))
        row = (s.get("id", ""), s.get("name", ""), s.get("state", ""), str(len(s.get("trials", []))), best)
        table.add_row(*map(inert, (*row, str(s.get("created_at", "")))))
    out.print(table)


@app.command("cancel")
def cancel(sweep_id: str, output: Output = OUTPUT) -> None:
    """Cancel a sweep: its queued and running trials are cancelled and no new one starts."""
    with api() as client:
        sweep = client.cancel_sweep(sweep_id)
    emit_json(sweep) if output is Output.json else say(f"sweep {sweep_id} {sweep.get('state', 'cancelled')}")
