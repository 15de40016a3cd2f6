"""torchrun with warm ranks: import torch once in the agent, then fork the ranks from it.

    python -m workers.engine.agent --standalone --nproc-per-node N --start-method fork \
        --run-path /abs/workers/engine/main.py --job-id JOBID ...

Takes torchrun's own command line (`torch.distributed.run`). Under plain torchrun every rank is
a fresh interpreter that imports torch and, on building its first optimizer, torch._dynamo
(`Optimizer.__init__` calls functions wrapped in `torch._disable_dynamo`, whose first call
imports it): seconds of start-up, paid again by each rank on every start.
Here the agent pays them once before launching, and torchrun's `--start-method fork` with
`--run-path` starts each rank as a fork of this process, with both modules already loaded (pages
shared copy-on-write).

CPU jobs only (see workers.attempt.launch.torchrun_command): a CUDA context cannot cross a fork, and
the import of torch._dynamo may probe the driver, so CUDA ranks keep starting as fresh interpreters.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Import what every rank needs, then run torchrun's agent with `argv`."""
    import torch._dynamo  # noqa: F401 - the import is the point (see the module docstring)
    from torch.distributed.run import main as torchrun

    # Python's documented recipe for fork without exec: frozen objects are left out of the ranks'
    # collections, which would otherwise write to (and so copy) every inherited object's page on the
    # first full collection and walk all of torch's modules on every one after.
    gc.freeze()
    torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
