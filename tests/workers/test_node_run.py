"""The ranks' spec.json, written from the typed spec the worker validated, reads back as the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api_schemas import JobSpec
from rank_contract.layout import JobFiles
from workers.attempt.node_run import RunPaths
from workers.engine.config import configure

SHA = "a" * 64
JOB = "b" * 32  # the shape of a job id (uuid4().hex)
SPECS: dict[str, dict[str, Any]] = {
    "recipe with extras and evaluation": {
        "name": "r",
        "recipe": "mlp",
        "hyperparameters": {"global_batch_size": 12, "hidden_size": 8, "lr": 0.125},
        "resources": {"nodes": 2, "processes_per_node": 3},
        "evaluation": {"every_steps": 5},
        "checkpoint": {"keep_best": {"metric": "eval/loss", "mode": "min"}},
        "labels": {"team": "x"},
    },
    "entrypoint with code, env and free-form extras": {
        "name": "e",
        "entrypoint": "pkg.mod:build",
        "code": {"sha256": SHA},
        "env": {"MY_FLAG": "1"},
        "hyperparameters": {"nested": {"a": [1, 2.5, None, "x"]}},
        "data": {"train": {"kind": "token_file", "path": "t/train.bin", "block_size": 16}},
        "max_runtime_seconds": 60,
    },
    "command": {"name": "c", "command": ["python", "train.py"], "code": {"sha256": SHA}},
}


@pytest.mark.parametrize("given", SPECS.values(), ids=list(SPECS))
def test_the_engine_reads_back_the_spec_the_worker_validated(tmp_path: Path, given: dict[str, Any]) -> None:
    spec = JobSpec.model_validate(given)
    paths = RunPaths(JobFiles(tmp_path, JOB), attempt=1)
    paths.run.folder.mkdir(parents=True)
    paths.write_spec(spec)
    if spec.command is None:
        config = configure(paths.run.spec.read_bytes(), spec.world_size)
        read = config.spec
        assert config.local_batch_size == spec.local_batch_size(), config
    else:  # a command's ranks never run the engine: the file still validates as the same model
        read = JobSpec.model_validate_json(paths.run.spec.read_bytes())
    assert read == spec, f"expected the spec back unchanged:\n{read!r}\n!=\n{spec!r}"


def test_a_non_finite_number_is_never_written(tmp_path: Path) -> None:
    # Built past validation, as no stored spec can be: the writer still refuses rather than write `NaN`.
    spec = JobSpec.model_validate({"name": "n", "recipe": "mlp"})
    spec.hyperparameters.__dict__["lr"] = float("nan")
    paths = RunPaths(JobFiles(tmp_path, JOB), attempt=1)
    paths.run.folder.mkdir(parents=True)
    with pytest.raises(ValueError, match="not JSON compliant"):
        paths.write_spec(spec)
