"""Differentiable collectives for a Plan's forward (all_reduce, broadcast, all_gather).

The public name for the engine's own: user code imports `dptrain.collectives`, never `workers.*`.
See workers/engine/collectives.py for what each does in backward.
"""

from workers.engine.collectives import all_gather, all_reduce, broadcast

__all__ = ["all_gather", "all_reduce", "broadcast"]
