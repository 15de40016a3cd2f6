"""The equivalence job, launched at world 1, 2 and 4: shared by the equivalence and event tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.engine_fixtures import EngineRun, Launches

EQUIVALENCE_WORLDS = (1, 2, 4)


@pytest.fixture
def equivalence_spec(make_spec: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The job the equivalence runs train (momentum 0.9, weight decay 1e-4, global batch 32, 10 steps)."""
    return make_spec()


@pytest.fixture
def equivalence_runs(launched: Launches, equivalence_spec: dict[str, Any]) -> dict[int, EngineRun]:
    """The same job at world 1, 2 and 4 (launched once per session: other modules train it too)."""
    return {w: launched.torchrun(equivalence_spec, w) for w in EQUIVALENCE_WORLDS}
