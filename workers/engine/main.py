"""Engine entry point, one process per rank (see workers.attempt.launch.torchrun_command).

    python -m torch.distributed.run --standalone --nproc-per-node N -m workers.engine.main \
        --job-id JOBID --spec RUN_DIR/spec.json --run-dir RUN_DIR --checkpoint-dir CKPT_DIR

or the same arguments after `python -m workers.engine.agent ... --run-path .../main.py`, which
forks the ranks from a process with torch already imported.

Without torchrun's RANK/WORLD_SIZE it runs as a single rank with no process group (tests call it in-process).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rank_contract.env import INIT_CHECKPOINT_ENV, SUPERVISOR_ENV
from rank_contract.layout import RunFiles
from rank_contract.stacks import await_dump, collective_timed_out, name_this_rank
from workers.engine.events import EventWriter
from workers.engine.loader_faults import loader_failure
from workers.engine.process import default_signals, own_session, redirect_output, watch_supervisor


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the engine's command line."""
    p = argparse.ArgumentParser(prog="workers.engine.main", description=__doc__)
    p.add_argument("--job-id", required=True)
    p.add_argument(
        "--on-node", default="", help="the worker node launching this rank (to find its processes)"
    )
    p.add_argument("--spec", required=True, type=Path, help="JobSpec as JSON")
    p.add_argument("--run-dir", required=True, type=Path, help="events/ and logs/ go here")
    p.add_argument("--checkpoint-dir", required=True, type=Path)
    return p.parse_args(argv)


def run(args: argparse.Namespace, events: EventWriter) -> None:
    """Build everything from the spec and train; raises on any failure."""
    import torch

    from rank_contract.plan import BuildContext
    from workers.engine import distributed
    from workers.engine.checkpoint import CheckpointManager
    from workers.engine.config import configure
    from workers.engine.conventions import build_plan
    from workers.engine.faults import fault_from_env
    from workers.engine.recipes import builder_of, plan_params
    from workers.engine.spec_datasets import open_spec_data
    from workers.engine.trainer import Trainer

    env = distributed.DistEnv.from_environ()
    name_this_rank(env.rank)  # how the worker tells this forked rank's stack from the others'
    if threads := os.environ.get("OMP_NUM_THREADS"):
        # A rank forked from the warm agent inherits the OpenMP pool size read when the agent loaded
        # torch, before torchrun set OMP_NUM_THREADS=1 for ranks sharing a host; a fresh interpreter
        # would have read the variable itself, so apply it the same way here.
        torch.set_num_threads(int(threads))
    # Before the rendezvous-heavy work: a spec that cannot run at this world size fails at once.
    config = configure(args.spec.read_bytes(), env.world_size)
    spec = config.spec
    builder = builder_of(spec)
    fault = fault_from_env()
    if spec.world_size != env.world_size:
        # Not fatal: the math is world-size independent, and elastic resume will rely on exactly that.
        print(f"warning: spec asks for {spec.world_size} ranks, running {env.world_size}")
    device = distributed.setup_device(env, spec.resources.device)
    if spec.engine.compile:
        from workers.engine.compile import check_compile

        # Before the rendezvous too: a worker without the backend fails at once, naming what is missing.
        check_compile(
            backend=spec.engine.compile_backend,
            bucket_cap_mb=spec.engine.bucket_cap_mb,
            device=device,
            world_size=env.world_size,
        )
    backend = distributed.init(env, spec.resources.device, spec.engine.collective_timeout_seconds)
    try:
        print(
            f"job {args.job_id}: rank {env.rank}/{env.world_size} on {device} backend={backend} "
            f"threads={torch.get_num_threads()} pid={os.getpid()}"
        )
        seed = spec.hyperparameters.seed
        # Same seed on every rank; DDP then broadcasts rank 0's weights anyway, so this is belt and braces.
        torch.manual_seed(seed)
        ctx = BuildContext(
            device=device,
            world_size=env.world_size,
            rank=env.rank,
            local_batch_size=config.local_batch_size,
            data=open_spec_data(spec),
        )
        plan = build_plan(builder, plan_params(spec), seed, ctx)
        best = spec.checkpoint.keep_best
        checkpoints = CheckpointManager(
            args.checkpoint_dir,
            spec.checkpoint.keep_last,
            env.is_main,
            spec.checkpoint.every_steps,
            keep_best=best.mode if best is not None else None,
        )
        Trainer(
            spec,
            plan,
            env,
            device,
            events,
            checkpoints,
            local_batch_size=config.local_batch_size,
            fault=fault,
            backend=backend,
            init_checkpoint=Path(init) if (init := os.environ.get(INIT_CHECKPOINT_ENV)) else None,
        ).train()
        print(f"job {args.job_id}: rank {env.rank} done")
    finally:
        distributed.destroy()


def main(argv: Sequence[str] | None = None) -> None:
    """Run one rank: redirect its output, train, and turn any exception into an error event."""
    args = parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        default_signals()
        own_session()
    rank = int(os.environ["RANK"]) if launched else 0
    # First thing: everything this rank prints (Python, C++, NCCL) lands in its own log file.
    files = RunFiles(args.run_dir)
    restore = redirect_output(files.rank_log(rank))
    events = EventWriter(files.rank_events(rank), rank)
    # Die with the worker that launched us (see rank_contract.env.SUPERVISOR_ENV).
    watch_supervisor(os.environ.get(SUPERVISOR_ENV))
    try:
        run(args, events)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        # torch's SIGCHLD handler raises a dead loader process's error wherever the rank happens to
        # be (in a step, a checkpoint), not only where it waits for a batch: typed here as well.
        if (typed := loader_failure(exc, rank=rank)) is not None:
            typed.__cause__ = exc
            exc = typed.with_traceback(exc.__traceback__)
        event = events.error(exc)
        if not launched:
            raise exc
        if collective_timed_out(event.message):
            # Still alive, this rank keeps torchrun from tearing down the others until the worker
            # has read where they hang (rank_contract/stacks.py).
            await_dump(args.run_dir)
        exit_failed_rank(exc, events)
    finally:
        events.close()
        # In-process callers (tests) get their own stdout/stderr back.
        if not launched:
            restore()


def exit_failed_rank(exc: BaseException, events: EventWriter) -> NoReturn:
    """Print `exc` into the rank's log and end the process at once, exit code 1 (or SystemExit's).

    Not by raising: a forked rank would raise into torch's multiprocessing wrapper, which swallows
    the traceback, and the unwinding frees the DDP model. Freeing it after a Gloo collective timed
    out can deadlock: ProcessGroupGloo's destructor joins its worker thread while holding the GIL,
    and that thread waits for the GIL to drop the timed-out work (seen with py-spy). A failed rank
    has nothing left to finish: checkpoints are renamed into place only when complete.
    """
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    if not isinstance(exc, SystemExit):
        traceback.print_exception(exc)  # a loader failure typed above, with what torch raised as its cause
    events.close()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
