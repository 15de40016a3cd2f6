"""Datasets a Plan can train from: token files, shard directories and streams, under the data root.

Files live under the operator's read-only DPTRAIN_DATA_ROOT on every worker; a spec names them
relative to it (`data.train`, `data.eval`), and the engine hands them, opened, to the builder as
`ctx.data["train"]` and `ctx.data["eval"]`. A builder may also open files itself with `data_path`::

    from dptrain import BuildContext, Plan
    from dptrain.data import Stream, TokenFile, data_path

    def build(hp, seed, ctx: BuildContext) -> Plan:
        train = ctx.data["train"]                            # spec: data.train {kind: token_file, ...}
        held_out = TokenFile(data_path("owt/val.bin"), block_size=hp["block_size"])
        ...

- `TokenFile`: a flat array of uint16/uint32 tokens (nanoGPT's `train.bin`), memory-mapped; sample i
  is the window of `block_size + 1` tokens at `i * stride`, as (inputs, targets) shifted by one.
- `Shards`: a directory of `.pt` / `.npy` files whose rows are the samples, memory-mapped, so the
  whole may be larger than memory.
- `Stream`: data that can only be read in order (a list of shards and a reader); the engine reads it
  in one global order whatever the world size, and checkpoints the position.

Map-style datasets (the first two, or any with `__len__` and `__getitem__`) are sampled by the
engine: each epoch a permutation of the samples drawn from (seed, epoch).

Users import these as `dptrain.data`; the engine reads them from here (rank_contract sits below both).
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from api_schemas.data import OutsideDataRoot, UnresolvableDataPath, resolve_in_root
from rank_contract.env import DATA_ROOT_ENV
from rank_contract.failures import Failure, named

__all__ = ["DataPathError", "Shards", "Stream", "TokenFile", "data_path"]

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_SUFFIXES = (".pt", ".npy")


@named(Failure.DATA_PATH_ERROR)
class DataPathError(PermissionError):
    """A data path that is not a file or directory inside the data root (or no data root at all)."""


def data_root() -> Path:
    """This worker's data root, resolved; DataPathError when the operator set none."""
    root = os.environ.get(DATA_ROOT_ENV, "")
    if not root:
        raise DataPathError(f"this worker has no data root: its operator has not set {DATA_ROOT_ENV}")
    return Path(root).resolve()


def data_path(relative: str | os.PathLike[str]) -> Path:
    """The file or directory `relative` names under the data root, which it may not leave.

    Resolved with its symlinks, so a link inside the root that points out of it is refused too.
    """
    root = data_root()
    rel = Path(relative)
    if rel.is_absolute():
        raise DataPathError(
            f"data path {os.fspath(relative)!r} is absolute: name it relative to the data root"
        )
    try:
        path = resolve_in_root(root, rel)
    except UnresolvableDataPath as exc:
        raise DataPathError(f"data path {os.fspath(relative)!r} cannot be resolved: {exc}") from exc
    except OutsideDataRoot as exc:
        raise DataPathError(f"data path {exc}") from exc
    if not path.exists():
        raise FileNotFoundError(
            f"data path {os.fspath(relative)!r}: no such file or directory in the data root"
        )
    return path


class TokenFile:
    """Windows of a flat token file (uint16 or uint32, no header), memory-mapped read-only.

    Sample i is tokens [i*stride, i*stride + block_size + 1): inputs are the first `block_size`,
    targets the last `block_size` (the next token at every position), both int64. `stride`
    defaults to `block_size`, so the windows tile the file; a smaller stride gives more, overlapping
    windows. With `vocab_size`, a token at or above it fails the batch naming the sample, instead
    of an embedding lookup failing far from the cause (or a device assert on CUDA).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        block_size: int,
        dtype: str = "uint16",
        stride: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype {dtype!r}: expected one of {', '.join(TOKEN_DTYPES)}")
        if block_size < 1 or (stride is not None and stride < 1):
            raise ValueError(f"block_size ({block_size}) and stride ({stride}) must be at least 1")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"token file {self.path.name}: not a file")
        self.dtype = dtype
        self.block_size = block_size
        self.stride = stride or block_size
        self.vocab_size = vocab_size
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise ValueError(f"{self.path.name}: {size} bytes is not a whole number of {dtype} tokens")
        self.tokens = size // itemsize
        if self.tokens < block_size + 1:
            raise ValueError(
                f"{self.path.name}: {self.tokens} tokens, fewer than one window of block_size + 1 = "
                f"{block_size + 1}"
            )
        self._windows = (self.tokens - block_size - 1) // self.stride + 1
        self._map: np.memmap[Any, Any] | None = None  # opened in the process that reads (a loader worker)

    def __len__(self) -> int:
        return self._windows

    def __getstate__(self) -> dict[str, Any]:
        # A loader started with spawn gets the dataset pickled: the path, never the mapped tokens.
        return {**self.__dict__, "_map": None}

    def _tokens(self) -> np.memmap[Any, Any]:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r")
        return self._map

    def windows(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The windows at `indices` as an int64 tensor [len(indices), block_size + 1]."""
        starts = np.asarray(indices, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() >= self._windows):
            raise IndexError(f"window index out of range [0, {self._windows})")
        # One fancy index over the map: only the pages of these windows are read.
        offsets = starts[:, None] * self.stride + np.arange(self.block_size + 1, dtype=np.int64)
        windows = torch.from_numpy(self._tokens()[offsets].astype(np.int64))
        if self.vocab_size is not None and windows.numel() and int(windows.max()) >= self.vocab_size:
            row = int((windows >= self.vocab_size).any(dim=1).nonzero()[0])
            bad = int(windows[row].max())
            raise ValueError(
                f"sample {int(starts[row])}: token {bad} of {self.path.name} is not below vocab_size "
                f"{self.vocab_size}"
            )
        return windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows([index])[0]
        return window[:-1], window[1:]

    def batch(self, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, targets) batch at `indices`, gathered in one read (the engine's fast path)."""
        windows = self.windows(indices)
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        return inputs.to(device), targets.to(device)


def _open_shard(path: Path) -> Any:
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r", allow_pickle=False)
    # mmap: only the rows read come off the disk; weights_only: a shard is data, never code.
    return torch.load(path, mmap=True, weights_only=True, map_location="cpu")


def _rows(data: Any, where: str) -> int:
    """The common first dimension of a shard's arrays (a tensor, an array, or tuples/dicts of them)."""
    leaves = list(_leaves(data))
    sizes = {int(x.shape[0]) for x in leaves if getattr(x, "ndim", 0) > 0}
    if not leaves or len(sizes) != 1:
        raise ValueError(
            f"shard {where}: expected a tensor or array, or a tuple or dict of them sharing their first "
            f"(sample) dimension; found sizes {sorted(sizes) or 'none'}"
        )
    return sizes.pop()


def _leaves(data: Any) -> Iterable[Any]:
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield data
    elif isinstance(data, Mapping):
        for v in data.values():
            yield from _leaves(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from _leaves(v)


def _row(data: Any, i: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[i].clone()  # off the memory map: a sample must outlive the shard's cache entry
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.array(data[i]))
    if isinstance(data, Mapping):
        return {k: _row(v, i) for k, v in data.items()}
    if isinstance(data, tuple):
        return tuple(_row(v, i) for v in data)
    if isinstance(data, list):
        return [_row(v, i) for v in data]
    raise TypeError(f"shard value of type {type(data).__name__}")


class Shards:
    """The rows of every `.pt` / `.npy` file of a directory, in file-name order, opened lazily.

    A `.npy` shard is one array; a `.pt` shard (saved by `torch.save`) a tensor, or a tuple or dict of
    tensors sharing their first dimension, e.g. `{"inputs": x, "targets": y}`. Both are memory-mapped,
    so only the rows read are loaded and the directory may be larger than memory; at most
    `open_shards` stay mapped per process.
    """

    def __init__(self, path: str | os.PathLike[str], *, open_shards: int = 8) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise NotADirectoryError(f"shards: {self.path.name} is not a directory")
        self.files = sorted(p for p in self.path.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
        if not self.files:
            raise ValueError(f"shards: {self.path.name} holds no .pt or .npy file")
        self.open_shards = max(1, open_shards)
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self.starts = [0]
        for k, f in enumerate(self.files):
            self.starts.append(self.starts[-1] + _rows(self._shard(k), f.name))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}  # pickled without its mapped shards

    def _shard(self, k: int) -> Any:
        data = self._cache.get(k)
        if data is None:
            data = _open_shard(self.files[k])
            self._cache[k] = data
            if len(self._cache) > self.open_shards:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(k)
        return data

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        k = bisect.bisect_right(self.starts, index) - 1
        return _row(self._shard(k), index - self.starts[k])


@dataclass(frozen=True)
class Stream:
    """Data read in order only: `read(shard)` yields the samples of each of `shards`.

    The engine reads the shards one after another (each epoch in an order drawn from the seed when
    `shuffle`) and cuts the samples into global batches, so 1, 2 or 4 ranks see the same batches.
    Every rank reads the whole stream and keeps its own part, so put per-sample work (decoding,
    tokenising, augmenting) in `transform`: it runs only on the samples a rank keeps, in the loader's
    processes. A checkpoint records the position (epoch, shard, sample), and a resume reads on from
    the exact sample. `read` must give the same samples in the same order every time it is called.
    """

    shards: Sequence[Any]
    read: Callable[[Any], Iterable[Any]]
    transform: Callable[[Any], Any] | None = None
    shuffle: bool = True

    def __post_init__(self) -> None:
        if len(self.shards) == 0:
            raise ValueError("a Stream needs at least one shard")
