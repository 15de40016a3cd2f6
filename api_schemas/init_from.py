"""`init_from`: the checkpoint of another job (or of an earlier run of this spec) that a job starts from."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, model_validator

from api_schemas.base import Strict

# A job's id as the API gives it (uuid4 hex); anything else names no job.
SourceJobId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class InitFrom(Strict):
    """Which checkpoint a job starts from: `step`, the `best`, or (neither given) the newest."""

    job: SourceJobId = Field(description="The job whose checkpoint this one starts from (one you may read).")
    step: int | None = Field(None, ge=0, le=10**9 - 1, description="That job's checkpoint of this step.")
    best: bool = Field(False, description="That job's best checkpoint (checkpoint.keep_best).")
    resume: bool = Field(
        False,
        description="A continuation: recipes and plans also take the optimizer, LR schedule, data "
        "position, RNG and ITER from it, so the spec's `steps` count on from its step. Without it only "
        "the model's weights are taken (a fine-tune: fresh optimizer, ITER from 0).",
    )

    @model_validator(mode="after")
    def _one_choice(self) -> InitFrom:
        if self.best and self.step is not None:
            raise ValueError("give 'step' or 'best', not both (neither: the newest checkpoint)")
        return self


class InitCheckpoint(BaseModel):
    """The checkpoint a job's `init_from` resolved to at submit, pinned for it (shown on the job)."""

    job: str = Field(description="The source job.")
    step: int = Field(description="The source's checkpoint's step (`init_from` without one: its newest).")
    sha256: str = Field(description="What its attempts verify the pinned file against before the first step.")
