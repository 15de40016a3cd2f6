"""A model that computes its own loss, as nanoGPT's does: `forward(idx, targets) -> (logits, loss)`.

Submit it with `entrypoint: "examples.own_loss:build"` (workers with
`DPTRAIN_ALLOWED_ENTRYPOINTS=examples`, or this file in your uploaded `code` tree). It shows the
conventions a model like this needs (docs/engine.md, "Calling conventions"):

- `compute_loss(model, batch)`: the model is called with both inputs and returns its own loss;
- `optimizer(model)`: the model's own `configure_optimizers` builds decay/no-decay groups;
- `build(hp, seed, ctx)`: the builder learns the device (fused AdamW on CUDA);
- `eval_dataset` and `eval_metrics`: a held-out split, reported as `eval/loss` and
  `eval/next_token_accuracy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from dptrain import BuildContext, Plan


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT's interface: logits and the mean loss with targets; the last position's logits without."""

    def __init__(self, vocab: int, block: int, width: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = self.ln(self.blocks(x))
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def configure_optimizers(self, weight_decay: float, lr: float, device_type: str) -> torch.optim.AdamW:
        """Decay on matrices and embeddings, none on biases and LayerNorms (nanoGPT's split)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused: one kernel per step on CUDA, and a non-finite step is skipped on the device.
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device_type == "cuda")


def _sequences(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    # Arithmetic progressions mod vocab: a pattern a small model learns in a few dozen steps.
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(length + 1)) % vocab


def build(hp: Mapping[str, Any], seed: int, ctx: BuildContext) -> Plan:
    """A two-block GPT on synthetic sequences, trained with its own loss and AdamW groups."""
    vocab, block = int(hp.get("vocab_size", 32)), int(hp.get("block_size", 16))
    model = TinyGPT(vocab, block)
    train = _sequences(int(hp.get("dataset_size", 1024)), block, vocab, seed)
    held_out = _sequences(int(hp.get("eval_size", 128)), block, vocab, seed + 1)

    def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        _, loss = model(idx, targets)
        return loss

    def eval_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        # With compute_loss the engine hands over the model (eval mode, no grad): predict the last token.
        idx, targets = batch
        logits, _ = model(idx)
        return {"next_token_accuracy": ((logits[:, -1].argmax(-1) == targets[:, -1]).sum(), len(idx))}

    return Plan(
        model=model,
        dataset=TensorDataset(train[:, :-1], train[:, 1:]),
        compute_loss=compute_loss,
        optimizer=lambda model: model.configure_optimizers(
            float(hp["weight_decay"]), float(hp["lr"]), ctx.device.type
        ),
        eval_dataset=TensorDataset(held_out[:, :-1], held_out[:, 1:]),
        eval_metrics=eval_metrics,
    )
