"""Shared by the benchmarks: A/B timing, the machine, results.json and BENCHMARKS.md.

A speed claim here is a ratio measured in one run on one machine (interleaved A/B rounds, so both
sides see the same background load), never a timed assertion in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = ROOT / "bench" / "results.json"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
PG_ADMIN_URL = os.environ.get("DPTRAIN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("DPTRAIN_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
# Long enough to pass the API's 16-character rule; only ever used on a throwaway loopback stack.
BENCH_TOKEN = "bench-admin-token-0123456789"

Result = dict[str, Any]


# ---- timing ----------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of some figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(
    a: Callable[[], float], b: Callable[[], float], rounds: int, *, warmup: int = 1
) -> dict[str, Any]:
    """Alternate A and B (ABBA order) `rounds` times; each returns seconds. Ratio per round is A / B.

    Alternating (and flipping who goes first) puts slow drifts of the machine on both sides.
    """
    for _ in range(warmup):
        a()
        b()
    ta: list[float] = []
    tb: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    ratios = [x / y for x, y in zip(ta, tb, strict=True)]
    return {"ratios": ratios, "a_s": ta, "b_s": tb, **spread(ratios)}


def rotated(
    sides: Mapping[str, Callable[[], float]], rounds: int, *, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every side once a round, `rounds` times, each round starting one side further on; seconds by side.

    Rotating who goes first does for several sides what ABBA does for two: over a multiple of
    len(sides) rounds every side runs at every position equally often, so slow drifts of the
    machine land on all of them. Ratios are taken per round, from the lists' equal indices.
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            times[name].append(sides[name]())
    return times


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


# ---- the machine -----------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kb = int(f.readline().split()[1])
        return round(kb / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": _ram_gib(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        info["device"] = "cpu"
    return info


def machine_line(m: Mapping[str, Any]) -> str:
    """One-line description of a machine for the tables."""
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB, "
        f"torch {m.get('torch')}, {m.get('device')}"
    )


# ---- results ---------------------------------------------------------------------------------------


def ratio_of(m: Mapping[str, Any]) -> dict[str, float]:
    """`result()`'s ratio and spread from an `interleaved()` measurement: its median, min and max."""
    return {"ratio": m["median"], "low": m["min"], "high": m["max"]}


def result(
    *,
    benchmark: str,
    compared: str,
    unit: str,
    bar: float | None,
    higher_is_better: bool,
    ratio: float | None = None,
    value: float | None = None,
    low: float | None = None,
    high: float | None = None,
    smoke: bool = False,
    **detail: Any,
) -> Result:
    """One figure of results.json: `ratio` or `value`, its spread, the bar and whether it was met."""
    figure = ratio if ratio is not None else value
    met: bool | None = None
    if bar is not None and figure is not None:
        met = figure >= bar if higher_is_better else figure <= bar
    out: Result = {
        "benchmark": benchmark,
        "compared": compared,
        "unit": unit,
        "min": low if low is not None else figure,
        "max": high if high is not None else figure,
        "bar": bar,
        "bar_is": "at least" if higher_is_better else "at most",
        "met": met,
        "smoke": smoke,
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        **detail,
    }
    if ratio is not None:
        out["ratio"] = ratio
    if value is not None:
        out["value"] = value
    return out


def merge_results(path: Path, new: Mapping[str, Result]) -> dict[str, Result]:
    """Merge `new` into the JSON at `path` (keeping keys measured by other runs); returns the whole."""
    current: dict[str, Result] = {}
    if path.exists():
        try:
            current = json.loads(path.read_text())
        except json.JSONDecodeError:
            current = {}
    current.update(new)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    return current


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:  # NaN
            return "-"
        return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def render_markdown(results: Mapping[str, Result], *, intro: str = "") -> str:
    """BENCHMARKS.md: one table per benchmark, then its notes."""
    by_bench: dict[str, list[tuple[str, Result]]] = {}
    for key, r in sorted(results.items()):
        by_bench.setdefault(str(r.get("benchmark", key)), []).append((key, r))
    lines = ["# Benchmarks", ""]
    if intro:
        lines += [intro, ""]
    # Titles start with the number ("1. Engine overhead ..."): that is the order.
    for bench, items in sorted(by_bench.items(), key=lambda kv: (not kv[0][:1].isdigit(), kv[0])):
        lines += [f"## {bench}", ""]
        lines += [
            "| key | compared | median | min | max | unit | bar | met |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        # Each machine with when it measured: one section can mix runs (`--only` reruns one benchmark).
        machines: list[tuple[str, str]] = []
        for key, r in items:
            figure = r.get("ratio", r.get("value"))
            bar = f"{r['bar_is']} {_fmt(r['bar'])}" if r.get("bar") is not None else "-"
            met = {True: "yes", False: "**no**", None: "-"}[r.get("met")]
            lines.append(
                f"| `{key}` | {r.get('compared', '')} | {_fmt(figure)} | {_fmt(r.get('min'))} "
                f"| {_fmt(r.get('max'))} | {r.get('unit', '')} | {bar} | {met} |"
            )
            measured = (machine_line(r.get("machine", {})), str(r.get("measured_at", "?")))
            if measured not in machines:
                machines.append(measured)
        lines.append("")
        for m, at in machines:
            lines.append(f"Machine: {m}; measured {at}.")
        notes = [n for _, r in items for n in r.get("notes", [])]
        if any(r.get("smoke") for _, r in items):
            notes.insert(0, "SMOKE RUN: tiny sizes, the figures mean nothing.")
        if notes:
            lines.append("")
            lines += [f"- {n}" for n in notes]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class RecipeCase:
    """One built-in recipe at one size, as the engine benchmarks train it."""

    name: str
    recipe: str
    extras: dict[str, Any]
    batch: int


# ---- CLI shape shared by every benchmark -----------------------------------------------------------


def parse(prog: str, doc: str | None, argv: Sequence[str] | None) -> argparse.Namespace:
    """`python -m bench.NAME [--smoke] [--json OUT]`."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=(doc or "").split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds; figures mean nothing")
    p.add_argument("--json", type=Path, help="also write the results (a results.json fragment) here")
    return p.parse_args(argv)


def cli(
    prog: str, doc: str | None, run: Callable[[bool], dict[str, Result]], argv: Sequence[str] | None
) -> dict[str, Result]:
    """The entry point of a benchmark whose `run(smoke)` takes nothing else: parse, run, print, write."""
    args = parse(prog, doc, argv)
    results = run(args.smoke)
    finish(results, args.json)
    return results


def finish(results: Mapping[str, Result], json_path: Path | None, out: Callable[[str], None] = print) -> None:
    """Print a benchmark's results and write them if asked."""
    for key, r in results.items():
        figure = r.get("ratio", r.get("value"))
        spread_ = f"min {_fmt(r['min'])}, max {_fmt(r['max'])}"
        out(f"{key}: {_fmt(figure)} {r['unit']} ({spread_}; met: {r['met']})")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(dict(results), indent=2, sort_keys=True) + "\n")


# ---- a throwaway PostgreSQL database ---------------------------------------------------------------


@contextmanager
def scratch_database(prefix: str = "dptrain_bench") -> Iterator[str]:
    """A fresh database migrated to head on the local PostgreSQL, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from migrations import upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def bench_env(**extra: str) -> dict[str, str]:
    """This environment without DPTRAIN_* settings, with the repository importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTRAIN_")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DPTRAIN_FAULT_INJECT"):
        env.pop(var, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
