"""Single-GPU bf16 training: the engine's `Trainer.train()` against a plain PyTorch loop, NCCL backend.

    python -m bench.gpu [--smoke] [--json OUT]

The same comparison as `bench.engine_overhead` (same recipe model, data, SGD and steps; the engine
with the job defaults, checkpoint writing left out), on `cuda:0` with `engine.precision: bf16`
(autocast; the plain loop autocasts the same forward and loss), the default process group
initialised with NCCL at world size 1 as torchrun would. Each round's figure is plain seconds /
engine seconds, i.e. engine steps per second / plain steps per second (bar: at least 0.98).

Without CUDA it records a skipped result ("no CUDA device") instead of a figure.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from bench.common import Result, cli, interleaved, ratio_of, result, timed
from bench.engine_overhead import Case, engine_side, plain_side
from bench.stack import free_port

BAR = 0.98
KEY = "gpu_bf16_vs_plain"
FULL = [
    Case(
        "mlp 8x2048, batch 1024", "mlp", {"input_size": 1024, "hidden_size": 2048, "num_layers": 8}, 1024, 300
    ),
    Case("cnn_bn 32x32, batch 256", "cnn_bn", {"image_size": 32}, 256, 300),
    # The transformer the GPU issue measures: SGD on both sides, as in the other cases.
    Case(
        "gpt 8x512, seq 256, batch 32",
        "gpt",
        {"vocab_size": 8192, "seq_len": 256, "d_model": 512, "n_heads": 8, "n_layers": 8, "optimizer": "sgd"},
        32,
        100,
    ),
]
SMOKE = [Case("mlp 2x64, batch 32", "mlp", {"input_size": 32, "hidden_size": 64, "num_layers": 2}, 32, 5)]


def _skipped(smoke: bool, why: str) -> dict[str, Result]:
    return {
        KEY: result(
            benchmark="7. GPU",
            compared="engine bf16 steps/s / plain PyTorch bf16 loop steps/s, NCCL, world 1",
            unit="x (throughput ratio)",
            bar=BAR,
            higher_is_better=True,
            smoke=smoke,
            skipped=why,
            notes=[f"skipped: {why}"],
        )
    }


def run(smoke: bool = False) -> dict[str, Result]:
    """Measure on cuda:0, or record why not."""
    if not torch.cuda.is_available():
        return _skipped(smoke, "no CUDA device on this machine")
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        rounds = 2 if smoke else 11
        per_case = {}
        for case in SMOKE if smoke else FULL:
            with tempfile.TemporaryDirectory(prefix="dptrain-bench-gpu-") as tmp:
                engine, trainer = engine_side(case, Path(tmp), device, "bf16", backend="nccl")
                plain = plain_side(case, device, "bf16")
                try:
                    m = interleaved(partial(timed, plain), partial(timed, engine), rounds)
                finally:
                    trainer.events.close()
            m["steps_per_s_engine"] = case.steps / min(m["b_s"])
            m["steps_per_s_plain"] = case.steps / min(m["a_s"])
            per_case[case.name] = m
    finally:
        dist.destroy_process_group()
    worst = min(per_case.values(), key=lambda m: m["median"])
    return {
        KEY: result(
            benchmark="7. GPU",
            compared="engine bf16 steps/s / plain PyTorch bf16 loop steps/s, NCCL, world 1; worst case",
            unit="x (throughput ratio)",
            **ratio_of(worst),
            bar=BAR,
            higher_is_better=True,
            smoke=smoke,
            device_name=torch.cuda.get_device_name(device),
            cases={n: {k: v for k, v in m.items() if k not in ("a_s", "b_s")} for n, m in per_case.items()},
            notes=[
                f"{torch.cuda.get_device_name(device)}: {n}: median {m['median']:.3f}; best "
                f"{m['steps_per_s_engine']:.0f} vs {m['steps_per_s_plain']:.0f} steps/s"
                for n, m in per_case.items()
            ],
        )
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    return cli("bench.gpu", __doc__, run, argv)


if __name__ == "__main__":
    main()
