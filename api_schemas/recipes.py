"""Built-in recipes: each one's hyperparameter extras, declared once (the API validates them, the
engine's recipe builds from the same model)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from api_schemas.base import Strict


class MlpParams(Strict):
    """Extras of the `mlp` recipe (a small MLP classifier on deterministic synthetic data)."""

    input_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(2, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(4096, ge=1, le=100_000_000)


class CnnBnParams(Strict):
    """Extras of the `cnn_bn` recipe (a small conv net with BatchNorm on deterministic synthetic images)."""

    image_size: int = Field(8, ge=4, le=1024)
    channels: int = Field(3, ge=1, le=64)
    num_classes: int = Field(10, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


class LstmLmParams(Strict):
    """Extras of the `lstm_lm` recipe (an LSTM language model on a deterministic synthetic Markov chain)."""

    vocab_size: int = Field(64, ge=2, le=1_000_000)
    embed_size: int = Field(32, ge=1, le=65_536)
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(1, ge=1, le=64)
    seq_len: int = Field(16, ge=1, le=65_536)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


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


class SparseEmbeddingParams(Strict):
    """Extras of the `sparse_embedding` recipe (a sparse-gradient EmbeddingBag over Zipf-skewed ids)."""

    num_embeddings: int = Field(1000, ge=2, le=100_000_000)
    embed_size: int = Field(16, ge=1, le=65_536)
    bag_size: int = Field(8, ge=1, le=65_536)
    hidden_size: int = Field(32, ge=1, le=65_536)
    num_classes: int = Field(4, ge=2, le=100_000)
    dataset_size: int = Field(1024, ge=1, le=100_000_000)


# Recipe name -> model of its hyperparameter extras. The engine registers a builder under each name
# (a test keeps the two in step).
RECIPES: dict[str, type[BaseModel]] = {
    "mlp": MlpParams,
    "lstm_lm": LstmLmParams,
    "cnn_bn": CnnBnParams,
    "partial_fc": PartialFcParams,
    "sparse_embedding": SparseEmbeddingParams,
}
