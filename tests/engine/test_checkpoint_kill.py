"""SIGKILL at random moments while checkpoints are written: the last complete one always loads."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.engine.checkpoint import CheckpointManager, sha256_file, temp_files

# A child that writes checkpoints of a few MiB in a loop (so a kill often lands mid-write) and
# prints each step once its save returned.
WRITER = """
import sys, torch
from workers.engine.checkpoint import CheckpointManager
directory, start = sys.argv[1], int(sys.argv[2])
m = CheckpointManager(directory, keep_last=2, is_main=True)
weights = torch.randn(1 << 20)
step = start
while True:
    step += 1
    m.save(step, {"model": {"w": weights + step}, "iter": step})
    print(step, flush=True)
"""
ROUNDS = 10


@pytest.mark.e2e
def test_a_kill_during_checkpoint_writes_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    rng = random.Random(5)
    directory = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    last_complete = 0
    for round_ in range(ROUNDS):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory), str(last_complete)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        first = child.stdout.readline()  # torch is imported and one save is done: writes are under way
        assert first.strip(), f"round {round_}: the writer printed nothing"
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read()
        child.wait(timeout=30)
        done = [int(x) for x in (first + rest).split()]
        last_complete = done[-1]

        manager = CheckpointManager(directory, keep_last=2, is_main=False)
        loaded = manager.load()
        assert loaded is not None, f"round {round_}: no checkpoint loads"
        # The save of last_complete returned; the next one may or may not have reached os.replace.
        assert loaded.step in (last_complete, last_complete + 1), (
            f"round {round_}: expected step {last_complete} (or the one in flight), got {loaded.step}"
        )
        assert loaded.state["iter"] == loaded.step
        digest, _ = sha256_file(loaded.path)
        assert manager.sidecar_for(loaded.path).read_text().split()[0] == digest
        assert all(
            not p.name.startswith(".") for p in manager.directory.iterdir() if p.name.endswith(".pt")
        ), "a temp file must never look like a checkpoint"
        # Listing: every visible checkpoint has its sidecar.
        for step in manager.steps():
            assert manager.sidecar_for(manager.path_for(step)).exists(), f"ckpt {step} without a sidecar"
        last_complete = loaded.step
    # A new writer sweeps the temp files the killed ones left.
    CheckpointManager(directory, keep_last=2, is_main=True)
    assert temp_files(directory) == [], f"left behind: {temp_files(directory)}"


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path, damage: str) -> None:
    import torch

    m = CheckpointManager(tmp_path, keep_last=3, is_main=True)
    for step in (1, 2):
        m.save(step, {"model": {"w": torch.full((4,), float(step))}, "iter": step})
    newest = m.path_for(2)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    loaded = m.load()
    assert loaded is not None and loaded.step == 1, (
        "a corrupt newest checkpoint is skipped for the one before"
    )
