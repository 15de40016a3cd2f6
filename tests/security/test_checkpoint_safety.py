"""Checkpoints are data, never code: a pickle payload in a checkpoint is refused and runs nothing."""

from __future__ import annotations

import pathlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine.checkpoint import CheckpointManager, checkpoint_name, sha256_file


class Payload:
    """Unpickling this calls `Path.touch(marker)`: code that runs on load, as an attacker's would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def _plant(manager: CheckpointManager, step: int, marker: Path) -> Path:
    """A crafted checkpoint with a valid sidecar: whoever can write the file can write its checksum."""
    path = manager.path_for(step)
    torch.save({"model": {"w": torch.zeros(1)}, "iter": step, "evil": Payload(marker)}, path)
    digest, _ = sha256_file(path)
    manager.sidecar_for(path).write_text(f"{digest}  {path.name}\n")
    return path


def test_the_payload_is_real(tmp_path: Path) -> None:
    # Proves the crafted file would run code if loaded unsafely, so the tests below mean something.
    marker = tmp_path / "pwned"
    manager = CheckpointManager(tmp_path / "c", keep_last=3, is_main=True)
    path = _plant(manager, 5, marker)
    torch.load(shutil.copy(path, tmp_path / "copy.pt"), weights_only=False)
    assert marker.exists(), "expected the unsafe load to run the payload"


def test_a_crafted_latest_checkpoint_is_refused_and_the_loader_falls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    manager = CheckpointManager(tmp_path / "c", keep_last=3, is_main=True)
    manager.save(4, {"model": {"w": torch.ones(1)}, "iter": 4})
    _plant(manager, 8, marker)
    loaded = manager.load(latest=True)
    assert not marker.exists(), "loading a checkpoint must never run code from it"
    assert loaded is not None and loaded.step == 4, f"expected a fallback to step 4, got {loaded}"
    assert f"{checkpoint_name(8)} unusable" in capsys.readouterr().err, "the refusal is reported"


def test_a_crafted_only_checkpoint_fails_clearly(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    manager = CheckpointManager(tmp_path / "c", keep_last=3, is_main=True)
    _plant(manager, 8, marker)
    with pytest.raises(RuntimeError, match="no loadable checkpoint") as err:
        manager.load(latest=True)
    assert "weights_only" in str(err.value).lower() or "unsupported global" in str(err.value).lower(), (
        f"expected the weights-only refusal in the error, got {err.value}"
    )
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        manager.load(step=8)
    assert not marker.exists(), "neither load may run the payload"
