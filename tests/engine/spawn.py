"""Spawn a small gloo group in-process for tests that drive engine pieces rank by rank."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 120


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    # One thread per rank: the ranks share two cores, and oversubscribed OpenMP pools crawl.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
        # Nobody tears the group down while another rank may still be talking to it: without this a
        # fast rank's destroy_process_group() can leave a slow one hanging in its last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13's Gloo teardown at interpreter exit now and then aborts the process ("terminate
    # called without an active exception"), after the rank's work and results are done and written:
    # leave without it, as the engine's failed ranks and the DDP baseline script do.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def spawn_gloo(fn: Callable[..., None], world: int, *args: Any, timeout: float = SPAWN_TIMEOUT_S) -> None:
    """Run `fn(rank, world, *args)` on `world` spawned ranks of a gloo group; raise if any fails or hangs."""
    from tests.conftest import free_port  # here, not at the top: the spawned ranks import this module

    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=False, start_method="spawn"
    )
    assert ctx is not None
    deadline = time.monotonic() + timeout
    # join() re-raises a rank's exception; a rank that never returns is killed rather than waited on.
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"a spawned gloo group of {world} ranks did not finish within {timeout} s")
