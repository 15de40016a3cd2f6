"""The engine's configuration is the API's own JobSpec, read from spec.json: one definition of the spec."""

from __future__ import annotations

from dataclasses import dataclass

from api_schemas import JobSpec


@dataclass(frozen=True)
class RankConfig:
    """A rank's spec and what it derives from it at the world size torchrun gave."""

    spec: JobSpec
    # Samples per rank and optimizer step: derived here once (JobSpec.local_batch_size, which
    # refuses an uneven split) and handed to the data pipeline, the plan and the trainer.
    local_batch_size: int


def configure(spec_json: str | bytes, world_size: int) -> RankConfig:
    """Read a run's spec.json and check that it runs at `world_size` ranks; ValueError if not.

    The spec's rules (bounds, recipe extras, the batch split) run again here, the same models the
    API validated with at submit; only the world size torchrun actually gave is new.
    """
    spec = JobSpec.model_validate_json(spec_json)
    return RankConfig(spec=spec, local_batch_size=spec.local_batch_size(world_size))
