"""How a job's ranks load their data: DataLoader options and files under the operator's data root."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, StrictBool, ValidationError, WithJsonSchema

from api_schemas.base import Strict

# One path segment: starts with a letter, digit or '_' (so never '.', '..' or a hidden name), then
# a conservative set of characters that need no quoting in a shell or a URL.
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.+=@,\-]*"
DATA_PATH_PATTERN = rf"^{_SEGMENT}(/{_SEGMENT})*$"
MAX_DATA_PATH = 1024


def _data_path(value: str) -> str:
    # Each way out of the data root gets a message of its own; the pattern then checks the rest.
    if value.startswith("/"):
        raise ValueError("a data path is relative to the data root (DPTRAIN_DATA_ROOT), not absolute")
    if any(part in ("..", ".") for part in value.split("/")):
        raise ValueError("a data path may not contain '.' or '..' segments (it must stay in the data root)")
    if re.fullmatch(DATA_PATH_PATTERN[1:-1], value) is None:
        raise ValueError(
            "expected segments of letters, digits and _ . + = @ , - separated by '/', each starting with a "
            "letter, digit or '_'"
        )
    return value


class OutsideDataRoot(ValueError):
    """A data path that resolves, through its links, to a place outside the data root."""


class UnresolvableDataPath(ValueError):
    """A data path whose links cannot be followed (a loop, no access)."""


def resolve_in_root(root: Path, relative: str | os.PathLike[str]) -> Path:
    """`relative` under `root` (itself resolved) with every link followed; the one containment rule
    the API (at submit) and the ranks (dptrain.data.data_path) both apply.

    Raises OutsideDataRoot when the result leaves `root`, UnresolvableDataPath when it cannot be
    resolved (Python 3.11's resolve() raises RuntimeError on a link loop).
    """
    try:
        path = (root / relative).resolve()
    except (OSError, RuntimeError) as exc:
        raise UnresolvableDataPath(str(exc)) from exc
    if not path.is_relative_to(root):
        raise OutsideDataRoot(f"{os.fspath(relative)!r} leads out of the data root")
    return path


DataPath = Annotated[
    str,
    Field(min_length=1, max_length=MAX_DATA_PATH),
    AfterValidator(_data_path),
    WithJsonSchema({"type": "string", "maxLength": MAX_DATA_PATH, "pattern": DATA_PATH_PATTERN}),
]


class TokenFileSource(Strict):
    """A flat array of tokens (nanoGPT's `.bin`): samples are windows of `block_size + 1` tokens."""

    kind: Literal["token_file"]
    path: DataPath = Field(description="The file, relative to the workers' DPTRAIN_DATA_ROOT.")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="How each token is stored.")
    block_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Tokens per sample (inputs; targets are the same shifted by one). The `gpt` recipe "
        "uses its `seq_len`; an entrypoint's plan must name it.",
    )


class ShardsSource(Strict):
    """A directory of `.pt` or `.npy` shards whose rows are the samples, opened lazily (memory-mapped)."""

    kind: Literal["shards"]
    path: DataPath = Field(description="The directory, relative to the workers' DPTRAIN_DATA_ROOT.")


DataSource = Annotated[TokenFileSource | ShardsSource, Field(discriminator="kind")]


class DataSpec(Strict):
    """How each rank loads batches (torch's DataLoader), and the data files a recipe or plan reads."""

    num_workers: int = Field(
        0,
        ge=0,
        le=64,
        description="Loader processes per rank; 0 loads in the rank itself. Use some when each sample "
        "costs CPU time (decoding, augmentation).",
    )
    prefetch_factor: int | None = Field(
        None, ge=1, le=64, description="Batches each loader process prepares ahead (torch's default 2)."
    )
    pin_memory: StrictBool | None = Field(
        None,
        description="Load batches into pinned host memory, copied to the GPU without blocking; null: on "
        "for cuda jobs. CPU jobs have nothing to pin.",
    )
    persistent_workers: StrictBool = Field(
        False,
        description="Keep the evaluation loader's processes between evaluations (training uses one "
        "loader pass for the whole run anyway).",
    )
    # A bound on waiting, not a liveness signal: loader processes that die or cannot send a batch
    # already fail the rank within moments (workers/engine/loader_faults.py), so this only ends a
    # process alive but stuck. It counts from the rank asking for a batch, which its process started
    # earlier, so it misfires only on a single batch slower than this: generous by default, below
    # the stall timeout (whose error could not say it was the loader).
    loader_timeout_seconds: int = Field(
        600,
        ge=1,
        le=86_400,
        description="Fail the rank (LoaderTimeout) when its loader processes, though alive, send no batch "
        "for this long. Applies with num_workers > 0.",
    )
    train: DataSource | None = Field(
        None, description="Training data from the data root, for recipes and plans that read files."
    )
    eval: DataSource | None = Field(None, description="Evaluation data from the data root.")

    def pinned(self, device: str) -> bool:
        """Whether batches go through pinned memory on a `device` job."""
        return self.pin_memory if self.pin_memory is not None else device == "cuda"


# Which data files each built-in recipe can train from (the others make their own synthetic data).
RECIPE_DATA_KINDS: dict[str, tuple[str, ...]] = {"gpt": ("token_file",), "mlp": ("shards",)}


# refuse(field path, reason, value): how JobSpec's cross-field validator collects an error.
Refuse = Callable[[tuple[str | int, ...], str, Any], None]


def data_rules(
    data: DataSpec,
    *,
    device: str,
    recipe: str | None,
    recipe_params: Callable[[], BaseModel | None],
    has_command: bool,
    evaluating: bool,
    refuse: Refuse,
) -> None:
    """The spec's rules about `data`, across fields (JobSpec's validator calls this with its own fields).

    Given the fields it reads, not the JobSpec, so that this module stays below jobs.py.
    """
    # What torch's DataLoader would refuse at job start, refused here with the field's path.
    if data.num_workers == 0:
        for name in ("prefetch_factor", "persistent_workers"):
            if getattr(data, name) not in (None, False):
                refuse(("data", name), f"{name} needs data.num_workers > 0", getattr(data, name))
    if data.pin_memory and device == "cpu":
        refuse(("data", "pin_memory"), "pinned memory speeds copies to a GPU; a cpu job has none", True)
    if has_command:
        # Options that differ from the defaults, not fields given: the job stores its spec with every
        # default filled in, and that stored spec must validate again (placement, the job's page).
        if given := data.model_dump(exclude_defaults=True):
            reason = (
                "a command loads its own data (its files are under $DPTRAIN_DATA_ROOT); leave out "
                + ", ".join(f"data.{name}" for name in given)
            )
            refuse(("data",), reason, None)
        return
    if data.eval is not None and data.train is None:
        refuse(("data", "eval"), "data.eval needs data.train", None)
    for split in ("train", "eval"):
        source = getattr(data, split)
        if source is None:
            continue
        if recipe is not None:
            kinds = RECIPE_DATA_KINDS.get(recipe, ())
            if source.kind not in kinds:
                takes = f"reads {' or '.join(kinds)}" if kinds else "makes its own data and reads no files"
                refuse(("data", split, "kind"), f"recipe {recipe!r} {takes}", source.kind)
                continue
        if isinstance(source, TokenFileSource):
            _token_file_rules(recipe, recipe_params, split, source.block_size, refuse)
    if recipe is not None and data.train is not None and evaluating and data.eval is None:
        refuse(("data", "eval"), "evaluating a recipe that trains from files needs data.eval", None)


def _token_file_rules(
    recipe: str | None,
    recipe_params: Callable[[], BaseModel | None],
    split: str,
    block_size: int | None,
    refuse: Refuse,
) -> None:
    if recipe == "gpt":
        try:
            seq_len = getattr(recipe_params(), "seq_len", None)
        except ValidationError:  # refused on its own field already
            return
        if block_size is not None and block_size != seq_len:
            reason = f"recipe 'gpt' reads windows of its seq_len ({seq_len}) tokens; leave block_size out"
            refuse(("data", split, "block_size"), reason, block_size)
    elif block_size is None:
        refuse(
            ("data", split, "block_size"), "a plan's token_file needs block_size (tokens per sample)", None
        )
