"""The one place that says what is in a job's ranks' environment: an allow-list, never the worker's whole one.

The worker holds secrets (database URL, broker URL, bootstrap token, every other DPTRAIN_* setting)
that user code must never see, so nothing is inherited by default: only the variables below, what
dptrain itself sets for the ranks, and the job's own `env`. torchrun adds its own (RANK, WORLD_SIZE,
MASTER_ADDR, ...) when it starts each rank. The names dptrain's own variables carry are the
contract with the ranks, in rank_contract/env.py.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from api_schemas.env import env_name_allowed

# Passed through from the worker's environment: locale, time zone, terminal, and how the host's
# accelerators, collectives and thread pools are set up (operator settings, not secrets).
PASSED_THROUGH = (
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TERM",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "NCCL_*",
    "GLOO_*",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCH_NCCL_*",
    "TORCH_DISTRIBUTED_DEBUG",
    # Operator settings the engine reads itself: which pre-installed modules an entrypoint may name,
    # and the fault injection the reliability tests use. Neither grants anything to user code.
    "DPTRAIN_ALLOWED_ENTRYPOINTS",
    "DPTRAIN_FAULT_*",
)
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# dptrain's start-up hook, first on every rank's PYTHONPATH (a folder holding only sitecustomize.py):
# a command's Python program records the exception that ends it (workers/command/rank_hook/sitecustomize.py,
# rank side). It lies in the workers package's folder, which the sandbox shows read-only
# (bubblewrap.python_paths).
RANK_HOOK_DIR = Path(__file__).resolve().parents[1] / "command" / "rank_hook"


def _passed(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in PASSED_THROUGH)


def rank_environment(
    *,
    worker_env: Mapping[str, str],
    dptrain: Mapping[str, str],
    user: Mapping[str, str],
    home: Path,
    tmp: Path,
    code_dir: Path | None,
    shared_cores: bool = False,
    interface: str | None = None,
) -> dict[str, str]:
    """The ranks' environment: allow-listed worker variables, then the user's, then dptrain's own.

    `dptrain` (rank_contract.env.sdk_env: the SDK's and the engine's variables) wins over `user`,
    whose names the spec already keeps out of what steers the worker (api_schemas/env.py); any such
    name is dropped here too. PATH starts with the worker interpreter's directory, so `python` and
    `torchrun` are the worker's; PYTHONPATH is dptrain's start-up hook, then the job's code tree;
    HOME and TMPDIR (`tmp`: /tmp in the sandbox) are the attempt's own.
    `shared_cores`: the node has more rank slots than cores; `interface`: the network interface this
    node's peers of a multi-node attempt reach it on.
    """
    env = {k: v for k, v in worker_env.items() if _passed(k)}
    # The spec's rule again: a spec stored before a name was refused must not reach the ranks with it.
    env.update({k: v for k, v in user.items() if env_name_allowed(k)})
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{SYSTEM_PATH}",
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "PYTHONUNBUFFERED": "1",
        # Python caches bytecode beside the sources; the code tree is read-only and shared.
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (RANK_HOOK_DIR, code_dir) if p is not None)
    if shared_cores:
        # More rank slots than cores (`dptrain up`'s default, or an operator's --slots): ranks share
        # cores. torchrun gives each rank of a multi-rank job one OpenMP thread, but a single rank one
        # per core: beside another job's ranks, its threads then wait at every parallel region for
        # descheduled peers, and its steps take many times longer. One thread each, unless the
        # operator or the job set it.
        env.setdefault("OMP_NUM_THREADS", "1")
    if interface is not None:
        # Gloo and NCCL pick their interface from the host name, which may resolve to loopback (or to
        # another network): the one holding this node's address is the one its peers reach.
        env |= {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
    env.update(dptrain)
    return env
