"""The sweep routes of `dptrain.Client`: submit a hyperparameter sweep, read it, cancel it, wait for it.

A mixin of `Client` (which sends the requests). A sweep travels as plain JSON dicts (`Sweep` below
is a TypedDict of the fields read here): the client needs no model of its own to submit a spec the
server validates, and an older client still reads a sweep with fields it does not know.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

import yaml

SWEEP_TERMINAL = frozenset({"succeeded", "cancelled", "failed"})


class Trial(TypedDict, total=False):
    """One trial of a sweep: an ordinary job labelled `sweep=<id>`."""

    number: int
    job_id: str
    params: dict[str, Any]
    status: str
    objective: float | None


class Sweep(TypedDict, total=False):
    """A sweep as `GET /v1/sweeps/{id}` answers it."""

    id: str
    name: str
    owner: str
    state: str
    spec: dict[str, Any]
    trials: list[Trial]
    best: Trial | None
    created_at: str
    finished_at: str | None


class SweepTimeout(TimeoutError):
    """`wait_sweep` gave up after `timeout` seconds; the sweep itself goes on."""

    def __init__(self, sweep: Sweep, timeout: float) -> None:
        super().__init__(f"sweep {sweep.get('id')} still {sweep.get('state')} after {timeout:g} s")
        self.sweep = sweep
        self.timeout = timeout


def load_sweep_spec(path: str | Path) -> dict[str, Any]:
    """A sweep file (YAML or JSON) as the dict `POST /v1/sweeps` takes; the server validates it."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a sweep file is a mapping (name, base, space, objective, ...)")
    return data


class SweepRoutes:
    """`/v1/sweeps`: many trials of one base spec, searched and pruned by the service."""

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        raise NotImplementedError  # Client's own, which sends and retries

    def submit_sweep(self, spec: Mapping[str, Any]) -> Sweep:
        """Create a sweep from `spec` ({name, base, space, objective, sampler, ...}); the new sweep."""
        sweep: Sweep = self._json("POST", "/v1/sweeps", json=dict(spec))
        return sweep

    def sweep(self, sweep_id: str) -> Sweep:
        """One sweep with its trials and its best trial so far."""
        sweep: Sweep = self._json("GET", f"/v1/sweeps/{sweep_id}")
        return sweep

    def sweeps(self, *, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        """One page of the caller's sweeps: {items, next_cursor}."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        page: dict[str, Any] = self._json("GET", "/v1/sweeps", params=params)
        return page

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Cancel a sweep: its queued and running trials are cancelled, no new one starts."""
        sweep: Sweep = self._json("POST", f"/v1/sweeps/{sweep_id}/cancel")
        return sweep

    def wait_sweep(
        self,
        sweep_id: str,
        *,
        timeout: float | None = None,
        poll_interval: float = 2.0,
        on_progress: Callable[[Sweep], None] | None = None,
    ) -> Sweep:
        """Poll until the sweep ends; the ended sweep. Raises SweepTimeout after `timeout` seconds."""
        start = time.monotonic()
        while True:
            sweep = self.sweep(sweep_id)
            if on_progress is not None:
                on_progress(sweep)
            if sweep.get("state") in SWEEP_TERMINAL:
                return sweep
            if timeout is not None and time.monotonic() - start >= timeout:
                raise SweepTimeout(sweep, timeout)
            time.sleep(poll_interval)


__all__ = ["SWEEP_TERMINAL", "Sweep", "SweepRoutes", "SweepTimeout", "Trial", "load_sweep_spec"]
