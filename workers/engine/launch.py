"""Build the torchrun command line for an engine run (importable without importing torch)."""

from __future__ import annotations

import os
import sys


def torchrun_command(
    *,
    job_id: str,
    nproc: int,
    spec_path: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
) -> list[str]:
    """The argv that launches `nproc` engine ranks on this host for one job."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "workers.engine.main",
        "--job-id",
        job_id,
        "--spec",
        os.fspath(spec_path),
        "--run-dir",
        os.fspath(run_dir),
        "--checkpoint-dir",
        os.fspath(checkpoint_dir),
    ]
