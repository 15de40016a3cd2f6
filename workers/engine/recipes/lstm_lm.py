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
from rank_contract.plan import Plan
from workers.engine.batch_sampler import TensorDataset, mix_seed
from workers.engine.recipes.eval_split import argmax_accuracy, eval_generator

# Stream id for the dataset generator, distinct from mlp's (7) and the sampler's streams (batch_sampler.py).
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


def _walks(transition: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """`n` walks of `length` tokens on the chain, each from a uniform first token."""
    tokens = torch.empty(n, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, transition.shape[0], (n,), generator=g)
    for pos in range(1, length):
        tokens[:, pos] = torch.multinomial(transition[tokens[:, pos - 1]], 1, generator=g).squeeze(1)
    return tokens


def build_datasets(cfg: LstmLmParams, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, eval): sequences of one fixed random (peaked) Markov chain; a function of the seed alone.

    Each sample is `seq_len + 1` tokens; the input is the first `seq_len`, the target the last
    `seq_len` (the next token at every position). The eval walks come from a generator of their own,
    so the training data does not depend on `eval_size`.
    """
    # A private generator keeps the data independent of the global RNG (and so of model-init order).
    g = torch.Generator().manual_seed(mix_seed(seed, _DATA_STREAM))
    v = cfg.vocab_size
    # Peaked transition table (scaled logits) so the next token is learnably predictable.
    transition = torch.softmax(3.0 * torch.randn(v, v, generator=g, dtype=torch.float64), dim=1)
    train = _walks(transition, cfg.dataset_size, cfg.seq_len + 1, g)
    held_out = _walks(transition, cfg.eval_size, cfg.seq_len + 1, eval_generator(seed, _DATA_STREAM))

    def split(tokens: torch.Tensor) -> TensorDataset:
        return TensorDataset(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())

    return split(train), split(held_out)


def build_dataset(cfg: LstmLmParams, seed: int) -> TensorDataset:
    """The training split."""
    return build_datasets(cfg, seed)[0]


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
    train, held_out = build_datasets(cfg, seed)
    # eval/loss: every sample has seq_len tokens, so the engine's per-sample weighting of lm_loss gives
    # the mean over all eval tokens; eval/accuracy counts every token too (next token predicted right).
    return Plan(
        model=build_model(cfg),
        dataset=train,
        loss_fn=lm_loss,
        eval_dataset=held_out,
        eval_metrics=argmax_accuracy,
        checkpoint_modules=is_lstm,
    )
