"""Datasets a Plan can train from: token files, shard directories and streams (see rank_contract/data.py).

The names users write (`from dptrain.data import Shards, Stream, TokenFile, data_path`); they are
defined once, in rank_contract.data, which the engine reads too. Importing this module imports torch.
"""

from rank_contract.data import DataPathError, Shards, Stream, TokenFile, data_path, data_root

__all__ = ["DataPathError", "Shards", "Stream", "TokenFile", "data_path", "data_root"]
