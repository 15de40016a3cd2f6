"""Peak memory with and without `engine.activation_checkpointing`, per recipe.

    python -m bench.memory [--smoke] [--json OUT] [--steps N] [--device cpu|cuda]

Each recipe trains a few real steps through the engine's `Trainer` (world 1, in this process, the same
`wrap()` that applies checkpointing in a job), once with checkpointing off and once on, and reports:

- saved for backward: bytes of the tensors the forward leaves stored for backward (parameters excluded),
  counted exactly with `torch.autograd.graph.saved_tensors_hooks`: unique storages per step, max over steps.
  Tensors saved inside a checkpointed part go to checkpoint's own (inner) hooks and are dropped, so they are
  not counted; what a checkpoint keeps, its inputs, is.
- peak memory: on CPU the rise of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over
  the RSS before the measured steps, with glibc told to mmap every allocation >= 64 KiB so that freed
  tensors really leave the RSS; on CUDA `torch.cuda.max_memory_allocated` over the allocated baseline.
  This one includes what backward's recompute holds for a moment, gradients and temporaries.

One warm-up step runs first (unmeasured) so that the optimizer's momentum buffers exist in both modes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from api_schemas import JobSpec
from bench.common import RecipeCase
from workers.engine import distributed
from workers.engine.memory import checkpointed_parts
from workers.engine.recipes import RECIPES
from workers.engine.trainer import Trainer

MiB = 1 << 20
SEED = 0


Case = RecipeCase


# Sizes where activations, not parameters, dominate: wide batches over deep or long models.
FULL = [
    Case("mlp 16x512, batch 2048", "mlp", {"input_size": 512, "hidden_size": 512, "num_layers": 16}, 2048),
    Case(
        "lstm_lm h256, seq 128, batch 128",
        "lstm_lm",
        {"vocab_size": 128, "embed_size": 64, "hidden_size": 256, "seq_len": 128},
        128,
    ),
    Case("cnn_bn 32x32, batch 256", "cnn_bn", {"image_size": 32}, 256),
]
SMOKE = [
    Case("mlp 8x64, batch 64", "mlp", {"input_size": 32, "hidden_size": 64, "num_layers": 8}, 64),
    Case(
        "lstm_lm h16, seq 8, batch 16",
        "lstm_lm",
        {"vocab_size": 16, "embed_size": 8, "hidden_size": 16, "seq_len": 8},
        16,
    ),
    Case("cnn_bn 8x8, batch 16", "cnn_bn", {"image_size": 8}, 16),
]


@dataclass
class Measurement:
    """One mode (checkpointing off or on) of one case."""

    saved_bytes: int
    peak_bytes: int
    step_s: float
    checkpointed: list[str] = field(default_factory=list)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def _tune_malloc() -> bool:
    """Make glibc hand freed tensors back to the OS at once, so RSS follows what is live."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # Setting the mmap threshold also turns off glibc's dynamic threshold, which would otherwise climb to
    # the size of the first freed tensors and serve the next ones from a heap that never shrinks.
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024)) and bool(libc.mallopt(m_trim_threshold, 64 * 1024))


class PeakMemory:
    """Peak bytes above the starting point, over the `with` block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self.base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _status_bytes("VmHWM") - self.base


class SavedForBackward:
    """Counts the unique storages autograd saves for backward in each step, parameters excluded."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.step: dict[int, int] = {}
        self.max_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack: note the storage, keep the tensor as autograd would."""
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            # Storage, not view size: a saved view keeps its whole storage alive.
            self.step[s.data_ptr()] = s.nbytes()
        return t

    def end_step(self) -> None:
        """Close a step (everything saved in its forward is alive together until its backward)."""
        self.max_bytes = max(self.max_bytes, sum(self.step.values()))
        self.step = {}


def _trainer(case: Case, checkpointing: bool, steps: int, device: torch.device) -> Trainer:
    extras = {**case.extras, "dataset_size": case.batch * (steps + 1)}
    spec = {
        "name": "memory-bench",
        "recipe": case.recipe,
        "hyperparameters": {"global_batch_size": case.batch, "momentum": 0.9, "seed": SEED, **extras},
        "resources": {"device": device.type},
        "engine": {"activation_checkpointing": checkpointing},
    }
    torch.manual_seed(SEED)
    plan = RECIPES[case.recipe](extras, SEED)
    # Events and checkpoints are never touched: only wrap() and the training step run here.
    cfg, env = JobSpec.model_validate(spec), distributed.DistEnv()
    local = cfg.local_batch_size(env.world_size)
    return Trainer(cfg, plan, env, device, cast(Any, None), cast(Any, None), local_batch_size=local)


def measure(case: Case, checkpointing: bool, steps: int, device: torch.device) -> Measurement:
    """Train `steps` measured steps (after one warm-up) and return what they kept and peaked at."""
    trainer = _trainer(case, checkpointing, steps, device)
    # wrap() applies activation checkpointing exactly as in a job; its announcement goes in the table instead.
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.wrap()
    trainer._step(0)  # warm-up: momentum buffers, allocator pools
    saved = SavedForBackward(list(trainer.model.parameters()))
    with PeakMemory(device) as peak, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        start = time.perf_counter()
        for it in range(1, steps + 1):
            trainer._step(it)
            saved.end_step()
        elapsed = time.perf_counter() - start
    return Measurement(saved.max_bytes, peak.peak, elapsed / steps, checkpointed_parts(trainer.model))


def _ratio(off: int, on: int) -> float:
    return off / on if on > 0 else float("inf")


def run(cases: Sequence[Case], steps: int, device: torch.device) -> list[dict[str, Any]]:
    """Measure every case off and on; one result dict per case."""
    results = []
    for case in cases:
        off, on = (measure(case, flag, steps, device) for flag in (False, True))
        results.append(
            {
                "case": case.name,
                "recipe": case.recipe,
                "extras": case.extras,
                "batch": case.batch,
                "off": asdict(off),
                "on": asdict(on),
                "saved_ratio": _ratio(off.saved_bytes, on.saved_bytes),
                "peak_ratio": _ratio(off.peak_bytes, on.peak_bytes),
            }
        )
    return results


def _pair(off: int, on: int) -> str:
    unit, div = ("MiB", MiB) if max(off, on) >= MiB else ("KiB", 1024)
    return f"{off / div:.1f} → {on / div:.1f} {unit}"


def table(results: Sequence[dict[str, Any]], device: torch.device) -> str:
    """Markdown table of the results (pasted into docs/engine.md)."""
    peak = "peak CUDA allocation" if device.type == "cuda" else "peak RSS rise"
    lines = [
        f"| case | saved for backward, off → on | ratio | {peak}, off → on | ratio "
        "| step time, off → on | checkpointed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        off, on = r["off"], r["on"]
        lines.append(
            f"| {r['case']} | {_pair(off['saved_bytes'], on['saved_bytes'])} | {r['saved_ratio']:.2f}x "
            f"| {_pair(off['peak_bytes'], on['peak_bytes'])} | {r['peak_ratio']:.2f}x "
            f"| {off['step_s']:.3f} → {on['step_s']:.3f} s | {', '.join(on['checkpointed']) or '-'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the benchmark, print the table, write JSON if asked; returns the results."""
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--steps", type=int, default=None, help="measured steps per mode (default 2, smoke 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not sys.platform.startswith("linux"):
        p.error("CPU peak memory is read from /proc: Linux only")
    tuned = device.type == "cpu" and _tune_malloc()
    steps = args.steps if args.steps is not None else (1 if args.smoke else 2)
    results = run(SMOKE if args.smoke else FULL, steps, device)
    out(table(results, device))
    if device.type == "cpu" and not tuned:
        out("warning: could not tune glibc malloc; the peak RSS rise may undercount")
    if args.json is not None:
        doc = {
            "torch": torch.__version__,
            "device": device.type,
            "threads": torch.get_num_threads(),
            "smoke": args.smoke,
            "steps": steps,
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
