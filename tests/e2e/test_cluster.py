"""Multi-node jobs on three worker nodes: placement, c10d rendezvous across nodes, node loss.

One cluster for the module (n0 and n1 with 2 slots, n2 with 4); the node-loss test kills a node, so
it runs last. Each node has a network namespace of its own where the machine allows it.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dptrain.workdir import pack
from service.config import Settings
from tests.conftest import job_spec
from tests.e2e.cluster import Cluster, running_cluster
from tests.e2e.helpers import wait_for_terminal

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-6


def _spec(name: str, *, nodes: int, ppn: int, steps: int = 8, **extra: Any) -> dict[str, Any]:
    spec = job_spec(
        name=name,
        hyperparameters={
            "global_batch_size": 16,
            "steps": steps,
            "lr": 0.1,
            "momentum": 0.9,
            "hidden_size": 16,
        },
        resources={"nodes": nodes, "processes_per_node": ppn, "device": "cpu"},
        checkpoint={"every_steps": 4, "keep_last": 3},
    )
    spec.update(extra)  # a section given here replaces the whole section
    return spec


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Each step sleeps 50 ms, so a run lasts long enough to be seen running and to lose a node.
    with running_cluster(
        tmp_path_factory.mktemp("cluster"), slots=[2, 2, 4], DPTRAIN_FAULT_INJECT="sleep:ms=50"
    ) as c:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            items = c.http.get("/v1/workers").json()["items"]
            if sorted(w["name"] for w in items if w["status"] == "alive") == c.nodes:
                break
            c.procs.check_alive()
            time.sleep(0.3)
        else:
            raise AssertionError(f"the nodes did not all register:\n{c.procs.logs()}")
        yield c


def _submit(c: Cluster, spec: dict[str, Any]) -> str:
    r = c.http.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _succeeded(c: Cluster, job_id: str) -> dict[str, Any]:
    job = wait_for_terminal(c.http, job_id, procs=c.procs, timeout=240)
    assert job["status"] == "succeeded", f"{job['status']}: {job['error']}\n{c.procs.logs()}"
    return job


def _final_params(c: Cluster, job_id: str) -> dict[str, torch.Tensor]:
    ckpts = c.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    last = max(ckpts, key=lambda k: k["step"])
    raw = c.http.get(f"/v1/jobs/{job_id}/checkpoints/{last['id']}/download").content
    state = torch.load(io.BytesIO(raw), weights_only=True)
    return dict(state["model"])


def _placed_on(c: Cluster, job_id: str) -> str:
    reasons = [t["reason"] or "" for t in c.http.get(f"/v1/jobs/{job_id}/timeline").json()["items"]]
    placed = [r for r in reasons if r.startswith("placed on")]
    assert placed, f"no placement in the timeline: {reasons}"
    return placed[-1]


def test_every_node_registers_its_address_device_and_slots(cluster: Cluster) -> None:
    items = {w["name"]: w for w in cluster.http.get("/v1/workers").json()["items"]}
    assert [items[n]["slots"] for n in cluster.nodes] == [2, 2, 4]
    for i, name in enumerate(cluster.nodes):
        w = items[name]
        assert (w["device"], w["status"], w["free_slots"]) == ("cpu", "alive", w["slots"]), w
        want = cluster.network.address(i) if cluster.network else f"127.0.0.{11 + i}"
        assert w["address"] == want, w


# Evaluation every 4 steps, the best checkpoint kept: its figures go through the API like the loss.
EVALUATED = {
    "evaluation": {"every_steps": 4, "batch_size": 24},
    "checkpoint": {"every_steps": 4, "keep_last": 3, "keep_best": {"metric": "eval/loss", "mode": "min"}},
}


def _eval_loss(c: Cluster, job_id: str) -> list[tuple[int, float]]:
    series = c.http.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    return [(int(step), float(value)) for step, value in series["eval/loss"]]


def test_two_nodes_of_two_ranks_end_with_the_parameters_of_one_node_of_four(cluster: Cluster) -> None:
    spread = _submit(cluster, _spec("two-by-two", nodes=2, ppn=2, **EVALUATED))
    single = _submit(cluster, _spec("one-by-four", nodes=1, ppn=4, **EVALUATED))
    _succeeded(cluster, spread)
    _succeeded(cluster, single)
    assert _placed_on(cluster, spread) == "placed on n0, n1", "best fit: the two 2-slot nodes"
    assert _placed_on(cluster, single) == "placed on n2"
    a, b = _final_params(cluster, spread), _final_params(cluster, single)
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: 2x2 vs 1x4 differ by {diff:.3g}"
    # Evaluation: the same figures at 2x2 and 1x4, and the best checkpoint marked in the API.
    evals = {job: _eval_loss(cluster, job) for job in (spread, single)}
    assert [s for s, _ in evals[spread]] == [4, 8], evals
    for (_, x), (_, y) in zip(evals[spread], evals[single], strict=True):
        assert abs(x - y) <= TOLERANCE, evals
    best_step = min(evals[spread], key=lambda sv: sv[1])[0]
    ckpts = cluster.http.get(f"/v1/jobs/{spread}/checkpoints").json()["items"]
    assert [k["step"] for k in ckpts if k["best"]] == [best_step], ckpts
    logs = cluster.http.get(f"/v1/jobs/{spread}/logs", params={"limit": 10_000}).json()["items"]
    assert {line["rank"] for line in logs} >= {0, 1, 2, 3}, "the ranks of both nodes report their logs"


def test_a_command_job_spans_two_nodes_and_trains_as_on_one(cluster: Cluster, tmp_path: Path) -> None:
    # The user's own DDP script, unmodified, under dptrain's torchrun on n0 and n1 (c10d rendezvous
    # across nodes), against the same script's 2 ranks on one node: same final parameters.
    packed = pack(Path(__file__).resolve().parents[1] / "fixtures" / "ddp_script", tmp_path / "code.tar.gz")
    put = cluster.http.put(f"/v1/code/{packed.sha256}", content=packed.path.read_bytes())
    assert put.status_code in (200, 201), put.text
    jobs = {}
    for nodes, ppn in ((2, 1), (1, 2)):
        spec = {
            "name": f"script-{nodes}x{ppn}",
            "command": ["python", "train.py", "--steps", "6"],
            "code": {"sha256": packed.sha256},
            "resources": {"nodes": nodes, "processes_per_node": ppn, "device": "cpu"},
            "hyperparameters": {"steps": 6},
        }
        jobs[nodes] = _submit(cluster, spec)
    digests = {}
    for nodes, job_id in jobs.items():
        _succeeded(cluster, job_id)
        logs = cluster.http.get(f"/v1/jobs/{job_id}/logs", params={"limit": 10_000}).json()["items"]
        lines = [line["line"] for line in logs]
        assert {"rank 0 of 2: training", "rank 1 of 2: training"} <= set(lines), lines
        digests[nodes] = [line for line in lines if line.startswith("params sha256")]
    placed = _placed_on(cluster, jobs[2]).removeprefix("placed on ").split(", ")
    assert len(placed) == 2, f"placed on two nodes, got {placed}"
    # Root workers, sandboxed: both nodes' ranks run as the one uid placement gave the attempt, of
    # the cluster's range (never nobody's).
    logs = cluster.http.get(f"/v1/jobs/{jobs[2]}/logs", params={"limit": 10_000}).json()["items"]
    said = {line["line"] for line in logs if " runs as uid " in line["line"]}
    low, high = Settings().cluster_rank_uids
    uids = {int(line.split()[5]) for line in said}
    assert len(said) == 2 and len(uids) == 1 and low <= min(uids) <= high, f"one uid of {low}-{high}: {said}"
    assert digests[2] and digests[2] == digests[1], f"2 nodes x 1 rank vs 1 node x 2 ranks: {digests}"


def test_two_competing_two_node_jobs_on_three_nodes_both_finish(cluster: Cluster) -> None:
    first = _submit(cluster, _spec("compete-a", nodes=2, ppn=2, steps=40))
    second = _submit(cluster, _spec("compete-b", nodes=2, ppn=2, steps=8))
    reasons: set[str] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = {j: cluster.http.get(f"/v1/jobs/{j}").json() for j in (first, second)}
        if jobs[second]["status"] == "queued" and jobs[second]["queued_reason"]:
            reasons.add(jobs[second]["queued_reason"])
        if jobs[first]["status"] != "queued" and jobs[second]["status"] != "queued":
            break
        time.sleep(0.2)
    _succeeded(cluster, first)
    _succeeded(cluster, second)
    assert "waiting for 2 nodes with 2 free cpu slots: 1 such now" in reasons, (
        f"the second job must wait whole, saying why; saw {reasons}"
    )


def test_a_job_asking_for_more_nodes_than_exist_waits_and_says_why(cluster: Cluster) -> None:
    big = _submit(cluster, _spec("too-big", nodes=4, ppn=1))
    deadline = time.monotonic() + 30
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = cluster.http.get(f"/v1/jobs/{big}").json()
        if job["queued_reason"]:
            break
        time.sleep(0.2)
    assert (job["status"], job["unplaceable"]) == ("queued", True), job
    assert job["queued_reason"] == (
        "no live node can hold this job: it needs 4 nodes with 1 free cpu slot; "
        "3 live cpu nodes, 3 of them with 1 slot"
    )
    assert job["warnings"] == [job["queued_reason"]], job
    # It blocks nobody: a job submitted after it runs.
    _succeeded(cluster, _submit(cluster, _spec("after-too-big", nodes=1, ppn=1)))
    assert cluster.http.get(f"/v1/jobs/{big}").json()["status"] == "queued"
    assert cluster.http.post(f"/v1/jobs/{big}/cancel").status_code == 200


def test_losing_a_node_restarts_the_job_from_its_checkpoint_on_the_others(cluster: Cluster) -> None:
    job_id = _submit(cluster, _spec("lose-a-node", nodes=2, ppn=1, steps=60, max_restarts=3))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = cluster.http.get(f"/v1/jobs/{job_id}").json()
        ckpts = cluster.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
        if job["status"] == "running" and ckpts and job["progress"]["step"] >= 10:
            break
        cluster.procs.check_alive()
        time.sleep(0.2)
    else:
        raise AssertionError(f"the job never got going:\n{cluster.procs.logs()}")
    victim = _placed_on(cluster, job_id).removeprefix("placed on ").split(", ")[1]
    cluster.procs.kill(victim)
    job = _succeeded(cluster, job_id)
    assert job["attempt"] >= 2, "the job was restarted"
    assert victim not in _placed_on(cluster, job_id), "the restart avoids the lost node"
    reasons = " ".join(
        t["reason"] or "" for t in cluster.http.get(f"/v1/jobs/{job_id}/timeline").json()["items"]
    )
    assert "restarting after attempt 1" in reasons, reasons
    logs = cluster.http.get(f"/v1/jobs/{job_id}/logs", params={"limit": 10_000}).json()["items"]
    assert any("resumed from" in line["line"] for line in logs), "the restart resumed from a checkpoint"
    lost = {w["name"]: w for w in cluster.http.get("/v1/workers").json()["items"]}[victim]
    assert lost["status"] == "lost", lost
