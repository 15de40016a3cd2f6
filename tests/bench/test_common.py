"""The benchmark helpers: ratios, merging and rendering (no timing is asserted anywhere)."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import cycle
from pathlib import Path

from bench.common import interleaved, merge_results, render_markdown, result, rotated


class TestInterleaved:
    def test_ratio_per_round_is_a_over_b_in_abba_order(self) -> None:
        calls: list[str] = []
        a_times, b_times = cycle([2.0, 4.0]), cycle([1.0])

        def a() -> float:
            calls.append("a")
            return next(a_times)

        def b() -> float:
            calls.append("b")
            return next(b_times)

        out = interleaved(a, b, 2, warmup=0)
        assert calls == ["a", "b", "b", "a"], f"expected ABBA order, got {calls}"
        assert out["ratios"] == [2.0, 4.0], f"expected per-round A/B ratios [2, 4], got {out['ratios']}"
        assert (out["median"], out["min"], out["max"]) == (3.0, 2.0, 4.0)


class TestRotated:
    def test_every_side_runs_once_a_round_each_round_starting_one_further_on(self) -> None:
        calls: list[str] = []

        def side(name: str, seconds: float) -> Callable[[], float]:
            def run() -> float:
                calls.append(name)
                return seconds

            return run

        out = rotated({"a": side("a", 3.0), "b": side("b", 2.0), "c": side("c", 1.0)}, 3, warmup=1)
        assert calls == list("abc" + "abc" + "bca" + "cab"), f"expected a warm-up, then rotations: {calls}"
        assert out == {"a": [3.0] * 3, "b": [2.0] * 3, "c": [1.0] * 3}, out


class TestResults:
    def test_bar_direction_decides_met(self) -> None:
        slow = result(benchmark="b", compared="c", unit="x", bar=1.02, higher_is_better=False, ratio=1.1)
        fast = result(benchmark="b", compared="c", unit="/s", bar=300, higher_is_better=True, value=400.0)
        assert slow["met"] is False and fast["met"] is True, (slow["met"], fast["met"])
        assert slow["ratio"] == 1.1 and fast["value"] == 400.0 and "machine" in slow

    def test_merge_keeps_keys_measured_by_other_runs(self, tmp_path: Path) -> None:
        path = tmp_path / "results.json"
        path.write_text(json.dumps({"old_key": {"value": 1, "unit": "ms"}}))
        merged = merge_results(path, {"new_key": {"value": 2, "unit": "ms"}})
        assert set(merged) == {"old_key", "new_key"}, f"expected both keys, got {sorted(merged)}"
        assert json.loads(path.read_text()) == merged

    def test_markdown_has_a_table_per_benchmark_and_flags_misses(self) -> None:
        results = {
            "k1": result(
                benchmark="2. Two", compared="a / b", unit="x", bar=1.0, higher_is_better=False, ratio=1.5
            ),
            "k2": result(
                benchmark="1. One", compared="c / d", unit="x", bar=1.0, higher_is_better=False, ratio=0.5
            ),
        }
        text = render_markdown(results)
        assert text.index("## 1. One") < text.index("## 2. Two"), "tables must follow the issue's numbering"
        assert "| `k1` | a / b | 1.5 |" in text and "**no**" in text and "| yes |" in text, text
        assert "Machine:" in text
