"""The Python stacks of a running attempt's ranks, as py-spy read them from outside the sandbox."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

# What made the worker read the stacks: a user's request, or the end of the attempt it explains.
StackReason = Literal["request", "stall", "collective timeout"]


class StackFrame(BaseModel):
    name: str = Field(description="The function, qualified as py-spy names it (`DataLoader.__next__`).")
    file: str
    line: int


class ThreadStack(BaseModel):
    thread_id: int = Field(description="The thread's id in the host's kernel (py-spy's os_thread_id).")
    name: str | None = None
    active: bool = Field(description="Running Python code rather than waiting (py-spy's guess).")
    frames: list[StackFrame] = Field(description="Innermost first.")


class ProcessStack(BaseModel):
    rank: int | None = Field(
        description="The process's RANK; null where neither its environment nor its name says."
    )
    pid: int = Field(description="The host's pid (the ranks' own namespace numbers them differently).")
    command: str = ""
    where: str | None = Field(
        None, description="The frame its main thread was in (docs/reliability.md says how it is chosen)."
    )
    threads: list[ThreadStack] = Field(default_factory=list)
    error: str | None = Field(None, description="Why this process's stack could not be read.")


class StackDump(BaseModel):
    node: str = Field(description="The worker node whose ranks these are.")
    attempt: int
    reason: StackReason
    taken_at: datetime
    processes: list[ProcessStack]
    note: str | None = Field(None, description="Why some or all stacks are missing (py-spy absent, refused).")


class JobStacks(BaseModel):
    job_id: str
    fresh: bool = Field(
        description="Whether the dumps answer this request (else they are the latest older ones)."
    )
    dumps: list[StackDump] = Field(description="The latest dump of each node of the attempt.")
