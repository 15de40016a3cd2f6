"""The `lstm_lm` recipe: an LSTM language model on token sequences from a fixed random Markov chain.

The data-parallel LSTM of Caffe2's data_parallel_model test: the same model trained at
1, 2 or 4 ranks on the same global batches must end at the same parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from api_schemas.recipes import LstmLmParams
from workers.engine.data import TensorDataset, mix_seed
from workers.engine.recipes.plan import Plan

# Stream id for the dataset generator, distinct from mlp's (7) and from the sampler's streams (data.py).
_DATA_STREAM = 12


class LstmLm(nn.Module):
    """Embedding -> LSTM (batch_first) -> Linear head; maps tokens [B, T] to logits [B, T, vocab]."""

    def __init__(self, cfg: LstmLmParams) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.embed_size)
        self.lstm = nn.LSTM(cfg.embed_size, cfg.hidden_size, cfg.num_layers, batch_first=True)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.head(hidden)  # type: ignore[no-any-return]


def build_model(cfg: LstmLmParams) -> LstmLm:
    return LstmLm(cfg)


def build_dataset(cfg: LstmLmParams, seed: int) -> TensorDataset:
    """Sequences of a fixed random (peaked) Markov chain; a function of the seed alone.

    Each sample is `seq_len + 1` tokens; the input is the first `seq_len`, the target the last
    `seq_len` (the next token at every position).
    """
    # A private generator keeps the data independent of the global RNG (and so of model-init order).
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    n, t, v = cfg.dataset_size, cfg.seq_len, cfg.vocab_size
    # Peaked transition table (scaled logits) so the next token is learnably predictable.
    transition = torch.softmax(3.0 * torch.randn(v, v, generator=g, dtype=torch.float64), dim=1)
    tokens = torch.empty(n, t + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, v, (n,), generator=g)
    for pos in range(1, t + 1):
        tokens[:, pos] = torch.multinomial(transition[tokens[:, pos - 1]], 1, generator=g).squeeze(1)
    return TensorDataset(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every (batch, time) position of the local batch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def is_lstm(module: nn.Module) -> bool:
    """The recipe's activation-checkpointing policy: only the LSTM.

    The LSTM keeps gates and states for every time step; checkpointed, it keeps only its input. The
    embedding saves just the token ids and the head just its input, which a checkpoint would keep anyway,
    so recomputing those would cost time and free nothing.
    """
    return isinstance(module, nn.LSTM)


def build(params: Mapping[str, Any], seed: int) -> Plan:
    """Recipe builder; the caller seeds the global RNG (torch.manual_seed) before calling, for model init."""
    cfg = LstmLmParams.model_validate(params)
    return Plan(
        model=build_model(cfg), dataset=build_dataset(cfg, seed), loss_fn=lm_loss, checkpoint_modules=is_lstm
    )
