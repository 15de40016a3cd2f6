"""The Plan lives in the public `dptrain` package (user code imports it from there); the engine's
recipes import it here."""

from dptrain.plan import BatchDataset, BuildContext, EvalFigures, OptimizerFactory, Plan, SchedulerFactory

__all__ = ["BatchDataset", "BuildContext", "EvalFigures", "OptimizerFactory", "Plan", "SchedulerFactory"]
