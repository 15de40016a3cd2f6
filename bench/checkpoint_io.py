"""Checkpoint save and load bandwidth of the engine's `CheckpointManager` against `dd` on the same disk.

    python -m bench.checkpoint_io [--smoke] [--json OUT] [--dir DIR] [--mib N]

Write: `CheckpointManager.save()` of a training state of N MiB (default 1024: a model state_dict of
float32 tensors plus `iter`), which is the engine's whole save (torch.save to a temp file, sha256ed
and XXH3-hashed as it is written, fsync, sidecars, rename, directory fsync, pruning; the pruned
file's blocks are freed in the background, untimed like dd's unlink of its previous file), against
`dd if=/dev/zero of=F bs=4M count=N/4 conv=fsync` in the same directory.

Read: `CheckpointManager.read()` (XXH3-128 of the file against its `.xxh128` sidecar, then
`torch.load(weights_only=True, mmap=True)`) against `dd if=F of=/dev/null bs=4M`. Both reads start
COLD: the file's pages are dropped from the page cache first (`posix_fadvise(DONTNEED)` after an
fsync, which evicts clean pages of that one file, no root needed). Bandwidth = N MiB / seconds; the
ratios are dptrain bandwidth / dd bandwidth per round (higher is better), rounds interleaved.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.common import Result, finish, interleaved, ratio_of, result
from workers.engine.checkpoint import CheckpointManager

BAR = 0.7
MiB = 1 << 20
TENSORS = 8  # the state is split like a model's layers, not one giant tensor


def state_of(mib: int) -> dict[str, object]:
    """A training-state-shaped dict of about `mib` MiB of float32."""
    per = mib * MiB // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(TENSORS)}
    return {"format": 1, "model": model, "optimizer": {"state": {}, "param_groups": []}, "iter": 1}


def drop_cache(path: Path) -> None:
    """Evict one file's pages from the page cache (written back first, so they are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dd(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - start


def run(smoke: bool = False, directory: Path | None = None, mib: int | None = None) -> dict[str, Result]:
    """Interleaved save/dd-write and read/dd-read rounds."""
    mib = mib or (16 if smoke else 1024)
    rounds = 1 if smoke else 5
    state = state_of(mib)
    with tempfile.TemporaryDirectory(prefix="dptrain-bench-ckpt-", dir=directory) as tmp:
        base = Path(tmp)
        manager = CheckpointManager(base / "ckpt", keep_last=1, is_main=True)
        dd_file = base / "dd.bin"
        step = [0]

        def save() -> float:
            step[0] += 1
            start = time.perf_counter()
            saved = manager.save(step[0], state, last=True)
            elapsed = time.perf_counter() - start
            assert saved is not None
            # The pruned file's blocks are freed in the background (as dd_write's unlink, untimed):
            # let that finish here so it never lands in the next round's timing, of either side.
            manager.wait_pruned()
            return elapsed

        def dd_write() -> float:
            dd_file.unlink(missing_ok=True)
            return _dd("if=/dev/zero", f"of={dd_file}", "bs=4M", f"count={mib // 4 or 1}", "conv=fsync")

        def read() -> float:
            drop_cache(manager.path_for(step[0]))
            start = time.perf_counter()
            loaded = manager.read(step[0])
            elapsed = time.perf_counter() - start
            assert loaded.state["iter"] == 1
            return elapsed

        def dd_read() -> float:
            drop_cache(dd_file)
            return _dd(f"if={dd_file}", "of=/dev/null", "bs=4M")

        # Ratio of bandwidths = dd seconds / dptrain seconds: interleaved() gives A/B, so put dd first.
        w = interleaved(dd_write, save, rounds, warmup=0 if smoke else 1)
        r = interleaved(dd_read, read, rounds, warmup=0 if smoke else 1)
        size_mib = manager.path_for(step[0]).stat().st_size / MiB
    out: dict[str, Result] = {}
    for key, what, m in (
        ("checkpoint_write_vs_dd", "`CheckpointManager.save()` / `dd conv=fsync` write bandwidth", w),
        ("checkpoint_read_vs_dd", "`CheckpointManager.read()` / `dd` read bandwidth, both cold", r),
    ):
        mine = [size_mib / s for s in m["b_s"]]
        dd = [mib / s for s in m["a_s"]]
        out[key] = result(
            benchmark="6. Checkpoint I/O",
            compared=what,
            unit="x (bandwidth ratio)",
            **ratio_of(m),
            bar=BAR,
            higher_is_better=True,
            smoke=smoke,
            size_mib=size_mib,
            dptrain_mib_per_s=mine,
            dd_mib_per_s=dd,
            notes=[
                f"{key}: {size_mib:.0f} MiB file; dptrain median {sorted(mine)[len(mine) // 2]:.0f} MiB/s, "
                f"dd median {sorted(dd)[len(dd) // 2]:.0f} MiB/s ({rounds} rounds)"
            ],
        )
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Result]:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_io", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="16 MiB, one round; figures mean nothing")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp directory)")
    p.add_argument("--mib", type=int, default=None, help="state size (default 1024, smoke 16)")
    args = p.parse_args(argv)
    results = run(args.smoke, args.dir, args.mib)
    finish(results, args.json)
    return results


if __name__ == "__main__":
    main()
