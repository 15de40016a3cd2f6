"""Built-in recipes: each one's hyperparameter extras, declared once (the API validates them, the
engine's recipe builds from the same model)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from api_schemas.base import Strict


class MlpParams(Strict):
    """Extras of the `mlp` recipe (a small MLP classifier on deterministic synthetic data)."""

    input_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(2, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(4096, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")


class CnnBnParams(Strict):
    """Extras of the `cnn_bn` recipe (a small conv net with BatchNorm on deterministic synthetic images)."""

    image_size: int = Field(8, ge=4, le=1024)
    channels: int = Field(3, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")


class LstmLmParams(Strict):
    """Extras of the `lstm_lm` recipe (an LSTM language model on a deterministic synthetic Markov chain)."""

    vocab_size: int = Field(64, ge=2, le=1_000_000)
    embed_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(1, ge=1, le=64)
    seq_len: int = Field(16, ge=1, le=65_536)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")


class PartialFcParams(Strict):
    """Extras of the `partial_fc` recipe (an MLP backbone and a classifier sharded across ranks)."""

    input_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    embedding_size: int = Field(16, ge=1, le=65_536)
    num_classes: int = Field(64, ge=2, le=100_000_000, description="Classifier rows, split across ranks.")
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of classes given logits per step: the batch's positives, then random negatives.",
    )
    dataset_size: int = Field(2048, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")


class SparseEmbeddingParams(Strict):
    """Extras of the `sparse_embedding` recipe (a sparse-gradient EmbeddingBag over Zipf-skewed ids)."""

    num_embeddings: int = Field(1000, ge=2, le=100_000_000)
    embed_size: int = Field(16, ge=1, le=65_536)
    bag_size: int = Field(8, ge=1, le=65_536)
    hidden_size: int = Field(32, ge=1, le=65_536)
    num_classes: int = Field(4, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")


class GptParams(Strict):
    """Extras of the `gpt` recipe (a decoder-only transformer on deterministic synthetic tokens)."""

    vocab_size: int = Field(256, ge=2, le=1_000_000)
    seq_len: int = Field(64, ge=1, le=65_536, description="Tokens per sample (the context length).")
    d_model: int = Field(64, ge=1, le=65_536, description="Width; must be divisible by n_heads.")
    n_heads: int = Field(4, ge=1, le=1024)
    n_layers: int = Field(2, ge=1, le=512)
    dropout: float = Field(0.0, ge=0, lt=1)
    optimizer: Literal["sgd", "adamw"] = Field(
        "adamw", description="`adamw` (decay on matrices only) or `sgd` (the spec's lr, momentum, decay)."
    )
    dataset_size: int = Field(2048, ge=1, le=100_000_000)
    eval_size: int = Field(256, ge=1, le=100_000_000, description="Samples in the held-out eval split.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GptParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        return self


# Recipe name -> model of its hyperparameter extras. The engine registers a builder under each name
# (a test keeps the two in step).
RECIPES: dict[str, type[BaseModel]] = {
    "mlp": MlpParams,
    "lstm_lm": LstmLmParams,
    "cnn_bn": CnnBnParams,
    "partial_fc": PartialFcParams,
    "sparse_embedding": SparseEmbeddingParams,
    "gpt": GptParams,
}

# What each recipe's evaluation reports (the spec checks `checkpoint.keep_best.metric` against it; a
# test checks the recipes report exactly these).
EVAL_METRICS: dict[str, tuple[str, ...]] = {
    "mlp": ("eval/loss", "eval/accuracy"),
    "lstm_lm": ("eval/loss", "eval/accuracy"),
    "cnn_bn": ("eval/loss", "eval/accuracy"),
    "partial_fc": ("eval/loss", "eval/accuracy"),
    "sparse_embedding": ("eval/loss", "eval/accuracy"),
    "gpt": ("eval/loss", "eval/accuracy"),
}
