"""The engine's configuration is the API's own JobSpec, read from spec.json: one definition of the spec."""

from __future__ import annotations

from api_schemas import JobSpec


def configure(spec_json: str | bytes, world_size: int) -> JobSpec:
    """Read a run's spec.json and check that it runs at `world_size` ranks; ValueError if not.

    The spec's rules (bounds, recipe extras, the batch split) run again here, the same models the
    API validated with at submit; only the world size torchrun actually gave is new.
    """
    spec = JobSpec.model_validate_json(spec_json)
    spec.local_batch_size(world_size)
    return spec
