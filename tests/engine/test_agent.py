"""CPU ranks are forked from a warm agent (workers.engine.agent) and must behave as fresh ranks do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine_fixtures import read_events
from workers.attempt.launch import ENGINE_MAIN, torchrun_command
from workers.sandbox.procs import rank_processes

REPO = Path(__file__).resolve().parents[2]


def test_cpu_ranks_fork_from_the_agent_and_cuda_ranks_start_fresh() -> None:
    common: dict[str, Any] = {
        "job_id": "j",
        "nproc": 2,
        "spec_path": "s",
        "run_dir": "r",
        "checkpoint_dir": "c",
    }
    cpu = torchrun_command(**common, device="cpu")
    assert cpu[1:3] == ["-m", "workers.engine.agent"], cpu
    assert "--start-method=fork" in cpu and cpu[cpu.index("--run-path") + 1] == ENGINE_MAIN, cpu
    assert Path(ENGINE_MAIN).is_file() and Path(ENGINE_MAIN).is_absolute(), ENGINE_MAIN
    cuda = torchrun_command(**common, device="cuda")
    assert cuda[1:3] == ["-m", "torch.distributed.run"], cuda
    assert "--start-method=fork" not in cuda and cuda[cuda.index("-m", 3) : cuda.index("-m", 3) + 2] == [
        "-m",
        "workers.engine.main",
    ], cuda
    # Both keep the job's arguments on the command line that procs.rank_processes reads.
    for cmd in (cpu, cuda):
        assert cmd[cmd.index("--job-id") + 1] == "j", cmd


def _launch(
    tmp_path: Path, make_spec: Any, *, steps: int, env: dict[str, str]
) -> tuple[subprocess.Popen[str], Path, str]:
    job_id = f"agenttest-{tmp_path.name[-12:]}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = make_spec(hyperparameters={"steps": steps}, engine={"log_every_steps": 1})
    spec["resources"]["processes_per_node"] = 2
    (run_dir / "spec.json").write_text(json.dumps(spec))
    cmd = torchrun_command(
        job_id=job_id,
        nproc=2,
        spec_path=run_dir / "spec.json",
        run_dir=run_dir,
        checkpoint_dir=run_dir / "checkpoints",
    )
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, run_dir, job_id


@pytest.mark.e2e
def test_forked_ranks_share_the_host_one_thread_each(tmp_path: Path, make_spec: Any) -> None:
    # No OMP_NUM_THREADS in the launcher's environment: torchrun sets 1 for ranks sharing a host
    # only after the warm agent loaded torch, so each forked rank must apply it itself.
    proc, run_dir, _ = _launch(tmp_path, make_spec, steps=2, env={})
    out, _ = proc.communicate(timeout=120)
    logs = [(run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert proc.returncode == 0, f"expected the job to succeed\n{out[-3000:]}\n{logs}"
    for rank, log in enumerate(logs):
        assert f"rank {rank}/2 on cpu backend=gloo threads=1" in log, f"rank {rank}'s log: {log!r}"
    assert any(e["type"] == "finished" for e in read_events(run_dir, 0)), read_events(run_dir, 0)


@pytest.mark.e2e
def test_sigterm_to_the_group_ends_forked_ranks_without_an_error(tmp_path: Path, make_spec: Any) -> None:
    # What a cancel does (procs.stop_group). Each forked rank leads a session of its own, as plain
    # torchrun's ranks do (a scheduling group of its own: process.own_session), so the group's SIGTERM
    # reaches the agent, which forwards it to each rank. The ranks inherit the agent's handler,
    # which would turn SIGTERM into an exception and an error event; a cancelled rank reports none.
    env = {"OMP_NUM_THREADS": "1", "DPTRAIN_FAULT_INJECT": "sleep:ms=200"}
    proc, run_dir, job_id = _launch(tmp_path, make_spec, steps=200, env=env)
    deadline = time.monotonic() + 60
    while not any(e["type"] == "metrics" for e in read_events(run_dir, 0)) and time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended early\n{proc.communicate()[0][-3000:]}"
        time.sleep(0.05)
    procs = rank_processes(job_id)
    assert len(procs) >= 3, "the agent and both forked ranks carry the job id"
    ranks = [p.pid for p in procs if p.ppid() == proc.pid]
    assert len(ranks) == 2, f"expected 2 ranks forked by the agent {proc.pid}, found {procs}"
    for pid in ranks:
        assert os.getsid(pid) == pid, f"rank {pid} is in session {os.getsid(pid)}, not one of its own"
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out[-3000:]
    for rank in (0, 1):
        errors = [e for e in read_events(run_dir, rank) if e["type"] == "error"]
        assert errors == [], f"rank {rank} reported {errors}"
    deadline = time.monotonic() + 10
    while rank_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes(job_id) == [], "no rank may outlive the signal"


@pytest.mark.e2e
def test_agent_takes_torchruns_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers.engine.agent", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--start-method" in out.stdout and "--run-path" in out.stdout, out.stderr
