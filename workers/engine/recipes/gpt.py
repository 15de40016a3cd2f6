"""The `gpt` recipe: a decoder-only transformer on deterministic synthetic tokens (the GPU benchmarks' model).

The model is written here, GPT-2 style: token + learned position embeddings, pre-LayerNorm blocks
(LN -> causal self-attention through `scaled_dot_product_attention(is_causal=True)`, LN -> 4x GELU MLP),
a final LayerNorm and an lm head tied to the token embedding. Sizes come from `GptParams`.

Optimisation. `optimizer: adamw` (the default) builds `torch.optim.AdamW` with betas (0.9, 0.95) from the
spec's own `hyperparameters.lr` and `hyperparameters.weight_decay`, the same two knobs the default SGD
reads, so a user tunes one lr whichever optimizer runs (not a second lr among the extras).
`plan_params` hands this recipe those two besides its extras. The decay is AdamW's decoupled one, on
parameters with two or more dimensions only (matrices and embeddings), never on biases or LayerNorm
gains. `momentum` does not apply to AdamW. `optimizer: sgd` leaves the engine's default SGD (lr,
momentum, weight decay on every parameter), under which 1, 2 and 4 ranks agree to ~1e-6.

Data. Each sample repeats a random pattern: a period p in [1, max_period] and p tokens walked from a
fixed, peaked random Markov chain, tiled to seq_len + 1 tokens (input = the first seq_len, target =
the last seq_len). The first period is only partly predictable (the chain); from then on the next
token is the one p positions back, which attention can learn to copy. The process (its transition
table) is a function of the seed; train and eval samples are drawn from it by generators of their
own, so the train split does not change with `eval_size`. With `data.train: {kind: token_file}` the
recipe trains from that file instead (windows of seq_len + 1 tokens; `data.eval` for evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from api_schemas.jobs import Hyperparameters
from api_schemas.recipes import GptParams
from rank_contract.plan import BuildContext, EvalFigures, OptimizerFactory, Plan
from workers.engine.batch_sampler import TensorDataset, mix_seed

# Stream ids of this recipe's generators: distinct from the other recipes' (7, 11-13, 15, 16, 1<<40)
# and the sampler's (1<<32 + epoch), so no two ever draw the same sequence.
_PROCESS_STREAM = 24
_TRAIN_STREAM = 25
_EVAL_STREAM = 26
MAX_PERIOD = 16
# Spec hyperparameters the builder reads besides its extras (recipes.plan_params adds them).
SPEC_HYPERPARAMETERS = ("lr", "weight_decay")
ADAMW_BETAS = (0.9, 0.95)
INIT_STD = 0.02  # GPT-2's init: with torch's default N(0, 1) embedding the tied head's logits start huge


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused qkv projection, SDPA, an output projection."""

    def __init__(self, cfg: GptParams) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2)
        )
        # SDPA picks a flash / memory-efficient kernel where it can (bf16 included) and draws its
        # dropout mask from the global RNG, which the engine seeds and checkpoint recompute replays.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); the unit of checkpointing."""

    def __init__(self, cfg: GptParams) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class Gpt(nn.Module):
    """Tokens [B, T] (T <= seq_len) -> next-token logits [B, T, vocab]."""

    def __init__(self, cfg: GptParams) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self._init_weights(cfg.n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # Residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2): the residual stream's
                # variance then does not grow with depth.
                out = name.endswith(("attn.proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, 0.0, INIT_STD / math.sqrt(2 * n_layers) if out else INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        # The head is the token embedding itself (tied): no second vocab x d_model matrix, and one
        # state_dict key for it, so nothing downstream sees two names for one tensor.
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def build_model(cfg: GptParams) -> Gpt:
    """The recipe's model (initialised from the global RNG, which the engine seeds)."""
    return Gpt(cfg)


def transition_table(cfg: GptParams, seed: int) -> torch.Tensor:
    """The process's Markov chain: row i is the distribution of the token after token i."""
    g = torch.Generator().manual_seed(mix_seed(seed, _PROCESS_STREAM))
    v = cfg.vocab_size
    # Scaled logits: peaked rows, so a pattern's first period is partly predictable too.
    return torch.softmax(3.0 * torch.randn(v, v, generator=g, dtype=torch.float64), dim=1)


def sample_tokens(cfg: GptParams, transition: torch.Tensor, n: int, stream_seed: int) -> TensorDataset:
    """`n` samples of the repeating-pattern process: inputs [n, seq_len], targets shifted by one token."""
    g = torch.Generator().manual_seed(stream_seed)
    t, v = cfg.seq_len + 1, cfg.vocab_size
    max_period = max(1, min(MAX_PERIOD, t // 2))
    period = torch.randint(1, max_period + 1, (n, 1), generator=g)
    pattern = torch.empty(n, max_period, dtype=torch.long)
    pattern[:, 0] = torch.randint(0, v, (n,), generator=g)
    for pos in range(1, max_period):
        pattern[:, pos] = torch.multinomial(transition[pattern[:, pos - 1]], 1, generator=g).squeeze(1)
    tokens = pattern.gather(1, torch.arange(t).unsqueeze(0) % period)
    return TensorDataset(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())


def build_datasets(cfg: GptParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): `dataset_size` and `eval_size` samples of one process, from separate generators."""
    transition = transition_table(cfg, seed)
    train = sample_tokens(cfg, transition, cfg.dataset_size, mix_seed(seed, _TRAIN_STREAM))
    held_out = sample_tokens(cfg, transition, cfg.eval_size, mix_seed(seed, _EVAL_STREAM))
    return train, held_out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every (batch, position) of the local batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def next_token_accuracy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> EvalFigures:
    """eval/accuracy: correct argmax next tokens over all positions (sums stay on the device)."""
    targets = batch[1]
    correct = (logits.argmax(dim=-1) == targets).sum()
    # new_full is a fill on the device, not a host-to-device copy.
    return {"accuracy": (correct, targets.new_full((), targets.numel()))}


def is_block(module: nn.Module) -> bool:
    """Activation checkpointing per transformer block: each keeps only its input for backward."""
    return isinstance(module, Block)


def adamw_factory(lr: float, weight_decay: float, device: torch.device | None = None) -> OptimizerFactory:
    """`optimizer(params)` -> AdamW with a decay group (dim >= 2) and a no-decay group (biases, LayerNorm).

    It takes the parameters, not the model: a parameter's shape alone decides its group, so the
    engine's `optimizer(model.parameters())` form suffices. Fused (one kernel, and the engine's
    non-finite step skipped on the device without a host sync) on CUDA: `device` (the builder's
    context) or, without one, where the parameters are (the engine moves the model first).
    """

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        on_cuda = device.type == "cuda" if device is not None else all(p.is_cuda for p in params)
        fused = bool(params) and on_cuda
        return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, fused=fused or None)

    return make


def build(params: Mapping[str, Any], seed: int, ctx: BuildContext | None = None) -> Plan:
    """Recipe builder; the caller seeds the global RNG (torch.manual_seed) before calling, for model init.

    `params` are the extras plus the spec's lr and weight_decay (absent: the spec's defaults). `ctx`,
    where the engine passes one, tells AdamW whether to be fused and holds the spec's token files.
    """
    cfg = GptParams.model_validate({k: v for k, v in params.items() if k not in SPEC_HYPERPARAMETERS})
    defaults = Hyperparameters()
    lr, weight_decay = (float(params.get(k, getattr(defaults, k))) for k in SPEC_HYPERPARAMETERS)
    optimizer = (
        adamw_factory(lr, weight_decay, ctx.device if ctx else None) if cfg.optimizer == "adamw" else None
    )
    files = ctx.data if ctx is not None else {}
    # From the spec's token files where it names them (data.train; data.eval, if it evaluates).
    train, held_out = (files["train"], files.get("eval")) if "train" in files else build_datasets(cfg, seed)
    return Plan(
        model=build_model(cfg),
        dataset=train,
        loss_fn=lm_loss,
        optimizer=optimizer,
        eval_dataset=held_out,
        eval_metrics=next_token_accuracy,
        checkpoint_modules=is_block,
    )
