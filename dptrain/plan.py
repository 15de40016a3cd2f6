"""What your entrypoint returns: `Plan`, built with a `BuildContext` (see rank_contract/plan.py).

The names users write (`from dptrain import BuildContext, Plan`); they are defined once, in
rank_contract.plan, which the engine reads too. Importing this module imports torch.
"""

from rank_contract.plan import (
    BatchDataset,
    BuildContext,
    EvalFigures,
    OptimizerFactory,
    Plan,
    SchedulerFactory,
)

__all__ = ["BatchDataset", "BuildContext", "EvalFigures", "OptimizerFactory", "Plan", "SchedulerFactory"]
