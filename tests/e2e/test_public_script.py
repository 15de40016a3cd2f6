"""An unmodified public-style DDP script, from upload to downloaded outputs, on `dptrain up` with the CLI.

The script (tests/fixtures/public_ddp, in the style of pytorch/examples' multigpu_torchrun.py) knows
nothing of dptrain: its data comes as a file its repository's .gitignore keeps out of git, its
snapshot path as an argument, and it ends with a bare destroy_process_group(). This is the walk
through docs/code.md ("From a repository to downloaded outputs"), step by step, as a user types it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import free_port
from tests.e2e.helpers import ROOT, Procs, clean_env, wait_healthy

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "fixtures" / "public_ddp"
ROWS = 64  # 4 batches of 8 per rank and epoch at 2 ranks


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`dptrain up` on a fresh home; yields the CLI's environment (its URL, the home with the token)."""
    tmp = tmp_path_factory.mktemp("up")
    home = tmp / "home"
    env = clean_env(DPTRAIN_HOME=str(home), DPTRAIN_REPORT_INTERVAL_SECONDS="0.2")
    procs = Procs(tmp)
    port = free_port()
    procs.start("up", ["up", "--port", str(port)], env, cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs, timeout=90)
        yield {**clean_env(DPTRAIN_HOME=str(home)), "DPTRAIN_API_URL": base}
    finally:
        procs.stop()


def _repository(tmp: Path) -> Path:
    """The script's repository as a user has it checked out: code, .gitignore, and its data file."""
    repo = tmp / "repo"
    shutil.copytree(SCRIPT, repo)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 20), dtype=np.float32)
    y = x @ rng.standard_normal((20, 1), dtype=np.float32)
    (repo / "data").mkdir()
    np.concatenate([x, y], axis=1).astype(np.float32).tofile(repo / "data" / "train.bin")
    return repo


def _dptrain(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dptrain_cli.main", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_a_public_ddp_script_runs_from_upload_to_downloaded_outputs(
    up: dict[str, str], tmp_path: Path
) -> None:
    repo = _repository(tmp_path)

    junit = tmp_path / "report.xml"
    r = _dptrain(
        up,
        "submit",
        "job.yaml",
        "--workdir",
        ".",
        "--include",
        "*.bin",
        "--wait",
        "--junit",
        str(junit),
        cwd=repo,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # The upload took the data file the .gitignore would have dropped, and said so.
    assert "taken by --include: 1 file" in r.stderr, r.stderr
    job_id = r.stdout.strip().splitlines()[0].split()[0]
    suite = ET.parse(junit).getroot()
    assert suite.find(".//failure") is None and suite.find(".//error") is None, junit.read_text()

    r = _dptrain(up, "artifacts", job_id, cwd=repo)
    assert r.returncode == 0 and "snapshot.pt" in r.stdout, r.stdout + r.stderr

    out = tmp_path / "snapshot.pt"
    r = _dptrain(up, "download", job_id, "--artifact", "snapshot.pt", "-o", str(out), cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    snapshot = torch.load(out, weights_only=True)
    # 4 epochs, a snapshot every 2: the last one says all 4 ran, with a trained layer in it.
    assert snapshot["EPOCHS_RUN"] == 4
    assert set(snapshot["MODEL_STATE"]) == {"weight", "bias"}
