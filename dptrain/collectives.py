"""Differentiable collectives for a Plan's forward (all_reduce, broadcast, all_gather).

The public name for the engine's own: user code imports `dptrain.collectives`, never `workers.*`.
See workers/engine/collectives.py for what each does in backward. They are looked up on first use,
so that importing the SDK never imports the worker's code: they only make sense inside a rank.
"""

from typing import Any

# Defined by __getattr__ below, which ruff cannot see.
__all__ = ["all_gather", "all_reduce", "broadcast"]  # noqa: F822


def __getattr__(name: str) -> Any:
    """`dptrain.collectives.all_reduce` (and the others) from workers.engine.collectives, on first use."""
    if name in __all__:
        from workers.engine import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'dptrain.collectives' has no attribute {name!r}")
