"""The spec's datasets (`data.train`, `data.eval`), opened under the data root: the builder's ctx.data."""

from __future__ import annotations

from typing import Any

from api_schemas import JobSpec
from api_schemas.data import TokenFileSource
from rank_contract.data import Shards, TokenFile, data_path


def open_spec_data(spec: JobSpec) -> dict[str, Any]:
    """{"train": dataset, "eval": dataset} for the sources the spec names (empty without any).

    A token_file without `block_size` takes the recipe's `seq_len` (the spec allows that for recipes
    only), and a recipe's `vocab_size` bounds its tokens, so a bad token names its sample.
    """
    params = spec.recipe_params()
    opened: dict[str, Any] = {}
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None:
            continue
        path = data_path(source.path)
        if isinstance(source, TokenFileSource):
            block_size = source.block_size or getattr(params, "seq_len", None)
            if block_size is None:  # the spec refuses this; a hand-written spec.json may not
                raise ValueError(f"data.{split}: a token_file needs block_size")
            opened[split] = TokenFile(
                path,
                block_size=block_size,
                dtype=source.dtype,
                vocab_size=getattr(params, "vocab_size", None),
            )
        else:
            opened[split] = Shards(path)
    return opened
