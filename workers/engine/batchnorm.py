"""Cross-rank BatchNorm (MXNet's SyncBN): torch's SyncBatchNorm on CUDA, our own on CPU/gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from workers.engine import collectives


class CpuSyncBatchNorm(_BatchNorm):
    """SyncBatchNorm for CPU/gloo: torch's refuses non-GPU input (its kernels are CUDA-only)."""

    # Not an nn.SyncBatchNorm subclass: DDP refuses any of those in a CPU module.

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """BatchNorm over the whole global batch: sums, count and squared deviations are all-reduced."""
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)  # eval, or nothing to sync: torch's plain batch_norm path
        # fp32 statistics whatever the input dtype (autocast runs torch's batch_norm in fp32 as well).
        x = input.float()
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = torch.tensor([x.numel() // x.size(1)], dtype=x.dtype, device=x.device)
        # The differentiable all_reduce sends the backward's sums across ranks too, so each rank's input
        # gradient is that of the sum over ranks of the per-rank losses, as torch's SyncBatchNorm does.
        sums = collectives.all_reduce(torch.cat([x.sum(dims), local]), "sum")
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centred = x - mean.view(shape)
        # Two passes (mean, then squared deviations) rather than E[x^2]-E[x]^2: no cancellation.
        var = collectives.all_reduce((centred * centred).sum(dims), "sum") / count
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None and self.bias is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                assert self.num_batches_tracked is not None
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / int(self.num_batches_tracked)
                # Running variance is the unbiased estimate over the global batch, like F.batch_norm's.
                self.running_mean.lerp_(mean.detach(), factor)
                self.running_var.lerp_(var.detach() * count / (count - 1), factor)
        return out


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm*d of `model` as a SyncBatchNorm (same parameters, buffers and state_dict keys)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if device.type == "cpu":
        # Only forward differs, so swapping the class keeps the very Parameter objects the optimizer holds
        # (torch's conversion already moved them, and the buffers, over from the BatchNorm*d modules).
        for m in model.modules():
            if isinstance(m, nn.SyncBatchNorm):
                bn: nn.Module = m
                bn.__class__ = CpuSyncBatchNorm
    return model


def average_buffers(buffers: list[torch.Tensor], world_size: int) -> None:
    """Replace every rank's `buffers` by their mean over ranks (engine.buffers "average": one allreduce)."""
    if not buffers:
        return  # no BatchNorm: no extra collective on the hot path
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()
