"""Recipe registry: name -> builder(params, seed) -> Plan, for each name api_schemas.recipes declares."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from api_schemas import JobSpec, entrypoint_allowed
from rank_contract.env import ALLOWED_ENTRYPOINTS_ENV, CODE_DIR_ENV
from rank_contract.plan import Plan
from workers.engine.recipes import cnn_bn, gpt, lstm_lm, mlp, partial_fc, sparse_embedding

RecipeBuilder = Callable[[Mapping[str, Any], int], Plan]

RECIPES: dict[str, RecipeBuilder] = {
    "mlp": mlp.build,
    "lstm_lm": lstm_lm.build,
    "cnn_bn": cnn_bn.build,
    "partial_fc": partial_fc.build,
    "sparse_embedding": sparse_embedding.build,
    "gpt": gpt.build,
}

# Spec hyperparameters a recipe reads besides its extras: gpt's AdamW takes the spec's lr and weight
# decay, the knobs the default SGD reads, rather than a second lr among its extras.
SPEC_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {"gpt": gpt.SPEC_HYPERPARAMETERS}

__all__ = ["RECIPES", "Plan", "RecipeBuilder", "builder_of", "load_entrypoint", "plan_params"]


def load_entrypoint(
    entrypoint: str, allowed: str | None = None, code_dir: str | None = None
) -> RecipeBuilder:
    """Import `package.module:function` from the job's uploaded code tree or an allowed prefix.

    With uploaded code (DPTRAIN_CODE_DIR, the unpacked tree on the ranks' PYTHONPATH) the module must
    be a file of that tree, not a module of the worker's that happens to share its name. Without,
    it must lie under DPTRAIN_ALLOWED_ENTRYPOINTS: the API refuses such a spec already; the worker
    checks again with its own setting, because it is the worker that runs the code. Only a public
    function defined in that module is called: not a class, and not a name the module merely
    imported (`os:system` under an allowed `os` prefix).
    """
    tree = code_dir if code_dir is not None else os.environ.get(CODE_DIR_ENV, "")
    module_name, _, func_name = entrypoint.partition(":")
    if tree:
        # The ranks start in the attempt's writable copy of the tree, which `python -m` puts first on
        # sys.path: import from the tree itself, as uploaded (it is on PYTHONPATH, but after that).
        sys.path[:] = [tree, *(p for p in sys.path if p != tree)]
        module = importlib.import_module(module_name)
        where = getattr(module, "__file__", None)
        if where is None or not Path(where).resolve().is_relative_to(Path(tree).resolve()):
            raise PermissionError(
                f"entrypoint {entrypoint!r}: module {module_name} is not a file of the uploaded code "
                f"({where or 'built in'})"
            )
    else:
        setting = allowed if allowed is not None else os.environ.get(ALLOWED_ENTRYPOINTS_ENV, "")
        prefixes = [p.strip() for p in setting.split(",") if p.strip()]
        if not entrypoint_allowed(entrypoint, prefixes):
            shown = ", ".join(prefixes) or "none"
            raise PermissionError(
                f"entrypoint {entrypoint!r} is not under an allowed prefix "
                f"({ALLOWED_ENTRYPOINTS_ENV}: {shown})"
            )
        module = importlib.import_module(module_name)
    builder = getattr(module, func_name, None)
    if func_name.startswith("_") or not inspect.isfunction(builder) or builder.__module__ != module_name:
        raise ValueError(f"entrypoint {entrypoint!r}: {module_name} defines no public function {func_name!r}")
    return builder  # type: ignore[no-any-return]


def builder_of(spec: JobSpec) -> RecipeBuilder:
    """The builder of the spec's built-in recipe or of its entrypoint."""
    if spec.entrypoint is not None:
        return load_entrypoint(spec.entrypoint)
    # The spec validated: its recipe is one of api_schemas.recipes.RECIPES, each registered above.
    return RECIPES[spec.recipe or ""]


def plan_params(spec: JobSpec) -> dict[str, Any]:
    """What the builder gets: a recipe its extras and SPEC_HYPERPARAMETERS, user code all hyperparameters."""
    params = spec.recipe_params()
    if params is None:
        # User code may want lr or steps for its own optimizer or schedule, so it gets them all.
        return spec.hyperparameters.model_dump()
    shared = SPEC_HYPERPARAMETERS.get(spec.recipe or "", ())
    return {**params.model_dump(), **{k: getattr(spec.hyperparameters, k) for k in shared}}
