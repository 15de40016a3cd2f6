"""Process-group plumbing: rank discovery from torchrun's env, init/teardown, small collectives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # True when torchrun set RANK/WORLD_SIZE (a process group is wanted)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad rank {self.rank} for world size {self.world_size}")

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read RANK/WORLD_SIZE/LOCAL_RANK; without them, a single in-process rank."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return cls()
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            launched=True,
        )

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints and progress events."""
        return self.rank == 0


def backend_for(device: str) -> str:
    """gloo for CPU tensors, nccl for CUDA."""
    return "nccl" if device == "cuda" else "gloo"


def setup_device(env: DistEnv, device: str) -> torch.device:
    """Pick this rank's device (and bind CUDA ranks to their local GPU before any collective)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("resources.device is 'cuda' but CUDA is not available on this host")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init(env: DistEnv, device: str, timeout_seconds: int) -> str | None:
    """Initialise the default process group when launched by torchrun; returns the backend or None."""
    if not env.launched:
        return None
    backend = backend_for(device)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_seconds))
    return backend


def destroy() -> None:
    """Tear down the process group if one exists (safe to call always)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active(env: DistEnv) -> bool:
    """Whether collectives are needed at all (a group exists and there is more than one rank)."""
    return env.world_size > 1 and dist.is_initialized()


def broadcast_int(env: DistEnv, value: int, device: torch.device, src: int = 0) -> int:
    """Every rank gets rank `src`'s `value`."""
    if not active(env):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=src)
    return int(t.item())


def barrier(env: DistEnv) -> None:
    """Wait for all ranks (no-op for a single rank)."""
    if active(env):
        dist.barrier()
