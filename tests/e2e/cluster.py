"""Several worker nodes on one machine, each in a network namespace of its own where the kernel allows.

Each node is a separate `dptrain worker` process with its own node name and address. With `ip netns`
(root, iproute2) every node gets a namespace joined to a bridge by a veth pair, so the c10d
rendezvous and Gloo's traffic cross a real network interface; PostgreSQL and Redis (private ones)
listen on the bridge too. Without it, nodes fall back to loopback addresses (127.0.0.11, ...) in the
test's own namespace, and the rendezvous ports still differ per job.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.api_fixtures import ADMIN_TOKEN
from tests.conftest import free_port
from tests.e2e.helpers import Procs, service_env, wait_healthy
from tests.e2e.services import PrivatePostgres, PrivateRedis


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def netns_possible() -> bool:
    """Whether this process may create network namespaces (root with iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"dptp{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError):
        return False
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return True


@dataclass
class Network:
    """A bridge in the test's namespace and one namespace per node behind it (10.213.N.0/24)."""

    tag: str
    subnet: int
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"dptb{self.tag}"

    @property
    def gateway(self) -> str:
        """The bridge's own address: where the nodes reach PostgreSQL, Redis and the API."""
        return f"10.213.{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{11 + i}"

    def create(self, nodes: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(nodes):
            ns, veth = f"dptn{self.tag}{i}", f"dptv{self.tag}{i}"
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its veth end, and so the pair
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)


@dataclass
class Cluster:
    """API in the test's namespace, N worker nodes; `http` is the admin's client of the API."""

    http: httpx.Client
    procs: Procs
    env: dict[str, str]
    nodes: list[str]
    network: Network | None
    log_dir: Path

    @property
    def isolated(self) -> bool:
        """Whether each node has a network namespace of its own."""
        return self.network is not None


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    choices = [n for n in range(1, 255) if f"10.213.{n}." not in used]
    return random.choice(choices)


@contextmanager
def running_cluster(tmp: Path, *, slots: list[int], **extra_env: str) -> Iterator[Cluster]:
    """A stack with `len(slots)` worker nodes named n0, n1, ... with those slots each."""
    network = Network(uuid.uuid4().hex[:4], _free_subnet()) if netns_possible() else None
    pg: PrivatePostgres | None = None
    redis_server: PrivateRedis | None = None
    procs = Procs(tmp)
    http: httpx.Client | None = None
    try:
        listen: tuple[str, ...] = ("127.0.0.1",)
        if network is not None:
            network.create(len(slots))
            listen = ("127.0.0.1", network.gateway)
        pg = PrivatePostgres(listen=listen, trust=f"10.213.{network.subnet}.0/24" if network else None)
        pg.start()
        db_url = pg.create_database("dptrain_cluster")
        redis_server = PrivateRedis(tmp, bind=listen)
        redis_server.start()
        env = service_env(
            tmp,
            db_url=db_url,
            broker_url=redis_server.url,
            queue="dptrain-cluster",
            DPTRAIN_RECONCILE_INTERVAL_SECONDS="0.5",
            DPTRAIN_WORKER_HEARTBEAT_SECONDS="0.5",
            DPTRAIN_WORKER_LEASE_SECONDS="4",
            DPTRAIN_RENDEZVOUS_TIMEOUT_SECONDS="60",
            **extra_env,
        )
        port = free_port()
        procs.start("api", ["api", "--port", str(port)], env)
        names = []
        for i, n in enumerate(slots):
            name = f"n{i}"
            node_env = dict(env)
            prefix: list[str] = []
            if network is not None:
                ns = network.namespaces[i]
                prefix = ["ip", "netns", "exec", ns]
                address = network.address(i)
                node_env["DPTRAIN_DATABASE_URL"] = db_url.replace("127.0.0.1", network.gateway)
                node_env["DPTRAIN_BROKER_URL"] = redis_server.url.replace("127.0.0.1", network.gateway)
            else:
                address = f"127.0.0.{11 + i}"
            args = ["worker", "--device", "cpu", "--node-name", name, "--address", address, "--slots", str(n)]
            procs.start(name, args, node_env, prefix=prefix)
            names.append(name)
        base = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        wait_healthy(base, procs)
        yield Cluster(http=http, procs=procs, env=env, nodes=names, network=network, log_dir=tmp)
    finally:
        if http is not None:
            http.close()
        procs.stop()
        if redis_server is not None:
            redis_server.stop()
        if pg is not None:
            pg.destroy()
        if network is not None:
            network.destroy()
