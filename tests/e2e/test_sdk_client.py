"""`dptrain.Client` against a real server (API + worker on PostgreSQL), and the light client install.

Every SDK method on jobs that really run; the typed errors of 401, 404, 409 and 422; a fresh
virtual environment with `pip install .` (no extras, the declared lower bounds) submitting and
waiting; and `dptrain submit` loading none of the server's or the engine's libraries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import dptrain
from api_schemas import Job, JobStatus
from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import job_spec
from tests.e2e.helpers import ROOT
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

MLP = job_spec(
    name="sdk-mlp",
    hyperparameters={"global_batch_size": 8, "steps": 6, "hidden_size": 8},
    resources={"processes_per_node": 1, "device": "cpu"},
    checkpoint={"every_steps": 3, "keep_last": 5},
    labels={"suite": "sdk"},
)
# What the light client may not load: it is installed without them.
HEAVY = ("torch", "celery", "sqlalchemy", "fastapi", "pydantic_settings", "service", "workers.engine.trainer")


@pytest.fixture(scope="module")
def client(stack: Stack) -> dptrain.Client:
    """An admin's SDK client of the module's stack."""
    return dptrain.Client(str(stack.http.base_url), ADMIN_TOKEN)


def test_submit_wait_and_read_everything_back(client: dptrain.Client, tmp_path: Path) -> None:
    seen: list[Job] = []
    job = client.submit(MLP)
    assert isinstance(job, Job) and job.status is JobStatus.QUEUED and job.spec.name == "sdk-mlp"
    ended = client.wait(job.id, on_progress=seen.append, poll_interval=0.2, timeout=180)
    assert ended.status is JobStatus.SUCCEEDED, ended.error
    assert seen[0].id == job.id and seen[-1] == ended and ended.progress.step == 6
    steps = [j.progress.step for j in seen]
    assert steps == sorted(steps), f"progress is reported in order: {steps}"
    assert client.get(job.id) == ended

    assert [s for s, _ in client.metrics(job.id, names=["loss"]).series["loss"]] == [1, 2, 3, 4, 5, 6]
    lines = list(client.logs(job.id))
    assert lines and [ln.id for ln in lines] == sorted(ln.id for ln in lines)
    assert list(client.logs(job.id, follow=True)) == lines, "following an ended job reads the same lines"
    assert list(client.logs(job.id, after=lines[0].id)) == lines[1:]

    ckpts = client.checkpoints(job.id)
    assert [c.step for c in ckpts] == [3, 6]
    got = client.download(job.id, tmp_path / "model.pt", step=3)
    assert got == ckpts[0] and torch.load(tmp_path / "model.pt", weights_only=True)["iter"] == 3
    newest = client.download(job.id, tmp_path / "newest.pt")
    assert newest.step == 6 and (tmp_path / "newest.pt").stat().st_size == newest.size_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "newest.pt"], (
        "no temporary file is left"
    )


def test_list_iterates_every_page_and_cancel_stops_a_job(client: dptrain.Client) -> None:
    long = client.submit(job_spec(MLP, name="sdk-long", hyperparameters={"steps": 100_000}))
    others = [client.submit(job_spec(MLP, name=f"sdk-queued-{i}")).id for i in range(2)]
    listed = [j.id for j in client.list(page_size=1, labels={"suite": "sdk"})]
    assert {long.id, *others} <= set(listed) and len(listed) == len(set(listed)), listed
    assert listed.index(others[1]) < listed.index(others[0]) < listed.index(long.id), "newest first"
    # As listed: placement may start any of them a moment later, so they are not fetched again.
    assert all(j.status is JobStatus.QUEUED for j in client.list(status="queued"))

    cancelled = client.cancel(long.id)
    assert cancelled.cancel_requested or cancelled.status is JobStatus.CANCELLED
    assert client.wait(long.id, poll_interval=0.2, timeout=120).status is JobStatus.CANCELLED
    for i in others:
        client.cancel(i)


def test_a_wait_that_times_out_carries_the_job(client: dptrain.Client) -> None:
    job = client.submit(job_spec(MLP, name="sdk-timeout", hyperparameters={"steps": 100_000}))
    with pytest.raises(dptrain.WaitTimeout) as caught:
        client.wait(job.id, timeout=0.5, poll_interval=0.1)
    assert caught.value.job.id == job.id and not caught.value.job.status.is_terminal()
    client.cancel(job.id)


def test_submit_uploads_a_working_directory(client: dptrain.Client, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello from uploaded code')\n")
    spec = {"name": "sdk-code", "command": ["python", "train.py"], "resources": MLP["resources"]}
    code = client.upload_code(tmp_path)
    job = client.submit(spec, workdir=tmp_path)
    assert job.spec.code is not None and job.spec.code.sha256 == code.sha256
    assert client.upload_code(tmp_path).uploaded is False, "the server already holds the same tree"
    ended = client.wait(job.id, poll_interval=0.2, timeout=180)
    assert ended.status is JobStatus.SUCCEEDED, ended.error
    assert any("hello from uploaded code" in ln.line for ln in client.logs(job.id))


def test_refusals_are_typed(client: dptrain.Client, stack: Stack) -> None:
    with pytest.raises(dptrain.Unauthorized) as unauthorized:
        dptrain.Client(str(stack.http.base_url), "not-a-token").get("nope")
    assert unauthorized.value.status_code == 401
    with pytest.raises(dptrain.NotFound) as missing:
        client.get("0" * 32)
    assert missing.value.status_code == 404 and missing.value.error == "NotFound"
    with pytest.raises(dptrain.NotFound):
        client.download("0" * 32, "unused.pt")

    key = "sdk-idempotency-key"
    first = client.submit(job_spec(MLP, name="sdk-once"), idempotency_key=key)
    assert client.submit(job_spec(MLP, name="sdk-once"), idempotency_key=key).id == first.id
    with pytest.raises(dptrain.Conflict) as conflict:
        client.submit(job_spec(MLP, name="sdk-other"), idempotency_key=key)
    assert conflict.value.status_code == 409
    client.cancel(first.id)

    with pytest.raises(dptrain.Refused) as refused:
        client.submit(job_spec(MLP, hyperparameters={"lr": -1.0}))
    assert refused.value.status_code == 422
    assert [e.path for e in refused.value.errors] == ["hyperparameters.lr"], refused.value.errors
    assert isinstance(refused.value, dptrain.ApiError)


def _source_tree(dest: Path) -> Path:
    """What `pip install .` reads: the project file and the packages, without venvs or build output."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _client_env(stack: Stack, **extra: str) -> dict[str, str]:
    # Only what a CI runner has, plus server variables that must not matter to a client.
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "DPTRAIN_API_URL": str(stack.http.base_url),
        "DPTRAIN_TOKEN": ADMIN_TOKEN,
        "DPTRAIN_BOOTSTRAP_TOKEN": "short",
        "DPTRAIN_DATABASE_URL": "postgresql://nowhere/none",
        **extra,
    }


def test_the_light_client_installs_alone_and_runs_a_job(stack: Stack, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    constraints = ROOT / "tests" / "fixtures" / "client-min-constraints.txt"
    installed = subprocess.run(
        [*pip, "-c", str(constraints), str(_source_tree(tmp_path / "src"))], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    listed = subprocess.run([*pip[:3], "list", "--format=json"], capture_output=True, text=True, check=True)
    versions = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    pins = [ln.split("==") for ln in constraints.read_text().splitlines() if "==" in ln]
    assert all(versions[name] == version for name, version in pins), versions
    assert not {"torch", "celery", "sqlalchemy", "fastapi"} & set(versions), sorted(versions)

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job_spec(MLP, name="light-client")))
    cli = str(venv / "bin" / "dptrain")
    run = subprocess.run(
        [cli, "submit", str(spec), "--wait", "--timeout", "180"],
        capture_output=True,
        text=True,
        env=_client_env(stack),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    job_id = run.stdout.splitlines()[0]
    shown = subprocess.run(
        [cli, "status", job_id, "--output", "json"], capture_output=True, text=True, env=_client_env(stack)
    )
    assert json.loads(shown.stdout)["status"] == "succeeded", shown.stdout + shown.stderr
    server = subprocess.run([cli, "migrate"], capture_output=True, text=True, env=_client_env(stack))
    assert server.returncode != 0 and "dptrain[server]" in server.stdout + server.stderr, server


def test_submit_loads_nothing_of_the_server_or_the_engine(stack: Stack, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job_spec(MLP, name="import-check")))
    report = tmp_path / "modules.json"
    script = textwrap.dedent(
        f"""
        import atexit, json, sys
        atexit.register(lambda: open({str(report)!r}, "w").write(json.dumps(sorted(sys.modules))))
        import dptrain
        dptrain.Client
        from dptrain_cli.main import app
        sys.argv = ["dptrain", "submit", {str(spec)!r}]
        app()
        """
    )
    env = _client_env(stack, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout + run.stderr
    loaded: list[str] = json.loads(report.read_text())
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], f"the client loaded {heavy}"
    job: dict[str, Any] = stack.http.get(f"/v1/jobs/{run.stdout.strip()}").json()
    assert job["name"] == "import-check"
    stack.http.post(f"/v1/jobs/{job['id']}/cancel")
