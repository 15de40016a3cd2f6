"""Engine at world size 2 (Gloo): 2 torchrun ranks of the engine against a hand-written torchrun + DDP script.

    python -m bench.engine_world2 [--smoke] [--json OUT]

Both sides are launched the same way (`python -m torch.distributed.run --standalone
--nproc-per-node 2`, one OpenMP thread per rank) and train the same MLP shape on the same amount of
data with the same SGD for the same steps. Only the training loop is timed, not process start-up:
the engine's from its `started` event (emitted after DDP is built and ITER broadcast) to the `time`
of its last `metrics` event (when the last step ended); the baseline's (`bench/baselines/ddp_mlp.py`)
from a barrier before the first step to the end of the last. The engine runs with the job defaults
(a `metrics` event for every step, with the global mean loss: reported per window, one loss
allreduce and one write per window, see docs/engine.md); only checkpoints are pushed past the last
step (benchmark 6 measures them).
Launches alternate (ABBA); each ratio is engine loop seconds / baseline loop seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import ROOT, Result, bench_env, cli, interleaved, ratio_of, result
from workers.attempt.launch import torchrun_command

BAR = 1.00
BASELINE = ROOT / "bench" / "baselines" / "ddp_mlp.py"
TIMEOUT_S = 300


def _engine_spec(size: dict[str, int], steps: int) -> dict[str, Any]:
    return {
        "name": "bench-world2",
        "recipe": "mlp",
        "hyperparameters": {
            "global_batch_size": size["batch"],
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 1e-4,
            "steps": steps,
            "seed": 0,
            "input_size": size["input_size"],
            "hidden_size": size["hidden_size"],
            "num_layers": size["num_layers"],
        },
        "resources": {"nodes": 1, "processes_per_node": 2, "device": "cpu"},
        "checkpoint": {"every_steps": steps + 1, "keep_last": 1},
    }


def run_engine(base: Path, size: dict[str, int], steps: int) -> float:
    """Launch 2 engine ranks; the seconds from `started` to the last `metrics` event."""
    job_id = f"bench-{uuid.uuid4().hex[:10]}"
    run_dir = base / job_id
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(_engine_spec(size, steps)))
    cmd = torchrun_command(
        job_id=job_id, nproc=2, spec_path=spec_path, run_dir=run_dir, checkpoint_dir=run_dir / "ckpt"
    )
    proc = subprocess.run(
        cmd, cwd=ROOT, env=bench_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    events_file = run_dir / "events" / "rank0.jsonl"
    events = [json.loads(x) for x in events_file.read_text().splitlines()] if events_file.exists() else []
    if proc.returncode != 0:
        log = run_dir / "logs" / "rank0.log"
        logs = log.read_text() if log.exists() else ""
        raise RuntimeError(f"engine run failed ({proc.returncode}): {proc.stdout[-2000:]}\n{logs[-2000:]}")
    started = next(e["time"] for e in events if e["type"] == "started")
    last = [e for e in events if e["type"] == "metrics"][-1]
    if last["step"] != steps:
        raise RuntimeError(f"engine stopped at step {last['step']}, expected {steps}")
    return float(last["time"] - started)


def run_baseline(base: Path, size: dict[str, int], steps: int) -> float:
    """Launch the hand-written DDP script on 2 ranks; its loop seconds."""
    out = base / f"baseline-{uuid.uuid4().hex[:10]}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(BASELINE),
        f"--input-size={size['input_size']}",
        f"--hidden-size={size['hidden_size']}",
        f"--num-layers={size['num_layers']}",
        f"--batch={size['batch']}",
        f"--steps={steps}",
        f"--out={out}",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=bench_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if proc.returncode != 0:
        raise RuntimeError(f"baseline failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return float(json.loads(out.read_text())["loop_s"])


def run(smoke: bool = False) -> dict[str, Result]:
    """Interleaved launches of both sides."""
    if smoke:
        size, steps, rounds = {"input_size": 8, "hidden_size": 16, "num_layers": 1, "batch": 8}, 3, 1
    else:
        size, steps, rounds = {"input_size": 128, "hidden_size": 256, "num_layers": 4, "batch": 128}, 600, 6
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-w2-") as tmp:
        base = Path(tmp)
        m = interleaved(
            lambda: run_engine(base, size, steps), lambda: run_baseline(base, size, steps), rounds, warmup=0
        )
    name = (
        f"mlp {size['num_layers']}x{size['hidden_size']} (input {size['input_size']}), "
        f"global batch {size['batch']}"
    )
    return {
        "engine_world2_vs_ddp": result(
            benchmark="2. Engine at world size 2 (Gloo)",
            compared=f"engine training loop / hand-written torchrun + DDP loop, {name}, {steps} steps",
            unit="x (time ratio)",
            **ratio_of(m),
            bar=BAR,
            higher_is_better=False,
            smoke=smoke,
            rounds=rounds,
            ratios=m["ratios"],
            engine_loop_s=m["a_s"],
            baseline_loop_s=m["b_s"],
            notes=[
                f"{name}, {steps} steps, {rounds} launches of each; best "
                f"{steps / min(m['a_s']):.0f} (engine) vs {steps / min(m['b_s']):.0f} (DDP script) steps/s"
            ],
        )
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.engine_world2", __doc__, run, argv)


if __name__ == "__main__":
    main()
