"""A loader process that fails other than in a sample's read fails its rank promptly, saying how.

Raised (outside a sample's read, or sending its batch): the rank fails with the loader's own exception
type and message. Killed: LoaderProcessDied, naming the pid and the signal. Alive but silent:
LoaderTimeout after data.loader_timeout_seconds. Never a wait for a batch that cannot come.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from api_schemas import JobError
from api_schemas.data import DataSpec
from tests.engine_fixtures import EngineRun, assert_no_process_left
from tests.fixtures.loader_plan.loader_faults import Samples
from workers.attempt.end import is_retryable
from workers.engine.batch_loader import (
    Batches,
    fixed_batch_sampler,
    loader_options,
    map_loader,
    shutdown_workers,
)
from workers.engine.events import describe
from workers.engine.loader_faults import (
    LoaderProcessDied,
    LoaderProcessError,
    LoaderTimeout,
    LoaderWatch,
    end_processes,
    loader_failure,
)

CPU = torch.device("cpu")
ALLOWED = {"DPTRAIN_ALLOWED_ENTRYPOINTS": "tests.fixtures"}
ENTRYPOINT = "tests.fixtures.loader_plan.loader_faults:build"
# Far above how long any of these loaders takes to fail: a failure must not wait for the timeout.
PROMPT_S = 20.0


def _options(**data: Any) -> dict[str, Any]:
    return loader_options(DataSpec(num_workers=2, **data), CPU, seed=1)


def _batches(dataset: Any, options: dict[str, Any], collate: Any = None, n: int = 8) -> Batches:
    indices = fixed_batch_sampler([torch.arange(i * 4, i * 4 + 4) for i in range(n)])
    return Batches(map_loader(dataset, collate, indices, options), device=CPU, rank=3, first=0)


def _failure(batches: Batches, n: int = 8) -> tuple[BaseException, float]:
    """What taking every batch raised, as the rank reports it, and how long that took."""
    start = time.monotonic()
    try:
        for _ in range(n):
            batches.take()
    except Exception as exc:
        # What main.py does with any error of a rank: torch's SIGCHLD handler may raise a loader
        # process's death between two takes, outside Batches, and main types it then.
        watch = batches.loader.worker_init_fn
        watch = watch if isinstance(watch, LoaderWatch) else getattr(watch, "watch", None)
        return loader_failure(exc, rank=3, watch=watch) or exc, time.monotonic() - start
    finally:
        batches.close()
    raise AssertionError(f"expected the loader to fail, but all {n} batches came")


class _RaisingInit:
    """A worker_init_fn that raises an exception type of its own after the engine's hook."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def __call__(self, worker_id: int) -> NoReturn:
        self.watch(worker_id)
        raise ShardIndexCorrupt(f"shard index of loader process {worker_id} is corrupt", 7)


class ShardIndexCorrupt(Exception):
    """A user's exception type, with a constructor torch's re-raise cannot call with one string."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Stuck(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(3600)  # a read that never returns (a hung network mount)
        return torch.zeros(1)


class _Slow(Dataset[torch.Tensor]):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index % 4 == 0:
            time.sleep(self.seconds)
        return torch.full((1,), float(index))


@pytest.mark.e2e
class TestInTheRank:
    def test_a_loader_process_raising_outside_a_read_fails_the_rank_with_its_type_and_message(self) -> None:
        options = _options()
        options["worker_init_fn"] = _RaisingInit(options["worker_init_fn"])
        error, took = _failure(_batches(torch.utils.data.TensorDataset(torch.arange(64.0)), options))
        assert isinstance(error, LoaderProcessError), repr(error)
        error_type, message = describe(error)
        assert error_type == "ShardIndexCorrupt", (error_type, message)
        assert (
            message.startswith("shard index of loader process ")
            and "is corrupt (in rank 3's loader" in message
        )
        assert "waiting for the batch of step 0" in message and took < PROMPT_S, (message, took)

    def test_a_batch_that_cannot_be_sent_fails_the_rank_with_the_loaders_error_at_once(self) -> None:
        # Each sample holds a handle whose pickling raises: before, the loader process printed that
        # and dropped the batch, and the rank waited for it forever.
        from tests.fixtures.loader_plan.loader_faults import collate

        dataset = Samples(64, seed=1, handles=True, kill_at=None)
        error, took = _failure(_batches(dataset, _options(), collate))
        error_type, message = describe(error)
        assert error_type == "SampleNotPortable", (error_type, message)
        assert "a sample's handle cannot leave process" in message and "sending a batch" in message, message
        assert took < PROMPT_S, f"the rank learned of the lost batch after {took:.1f} s"

    def test_a_killed_loader_process_fails_the_rank_naming_its_pid_and_signal(self) -> None:
        from tests.fixtures.loader_plan.loader_faults import collate

        dataset = Samples(64, seed=1, handles=False, kill_at=9)  # in the third batch
        error, took = _failure(_batches(dataset, _options(), collate))
        assert isinstance(error, LoaderProcessDied), repr(error)
        assert describe(error)[0] == "LoaderProcessDied"
        assert "rank 3's loader process (pid " in str(error) and "killed by SIGKILL" in str(error), error
        assert took < PROMPT_S, took

    def test_a_stuck_loader_process_fails_the_rank_after_the_loader_timeout(self) -> None:
        error, took = _failure(_batches(_Stuck(), _options(loader_timeout_seconds=2)))
        assert isinstance(error, LoaderTimeout), repr(error)
        assert "in 2 s (data.loader_timeout_seconds), waiting for the batch of step 0" in str(error), error
        assert 2 <= took < PROMPT_S, took

    def test_processes_ended_after_a_failure_are_no_error_when_they_die(self) -> None:
        # A loader process still starting has no SIGTERM handler of torch's yet, so the terminate
        # after a failure kills it by the signal, and torch's SIGCHLD handler would raise that
        # death from wherever the rank is then (its iterator's shutdown, say).
        iterator: Any = iter(DataLoader(_Stuck(), num_workers=2))
        end_processes(iterator, iterator._workers)
        for p in iterator._workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        torch.utils.data._utils.signal_handling._error_if_any_worker_fails()
        shutdown_workers(iterator)

    def test_the_timeout_bounds_one_batch_not_a_whole_pass(self) -> None:
        # Every batch takes 1 s and 8 of them take 4 s or more on 2 processes: longer than the
        # 3 s timeout altogether, yet no single wait is.
        got = _batches(_Slow(1.0), _options(loader_timeout_seconds=3))
        start = time.monotonic()
        values = [float(got.take()[0]) for _ in range(8)]
        got.close()
        assert values == [float(i * 4) for i in range(8)] and time.monotonic() - start >= 3


class TestTorchsReportsTyped:
    def test_an_exception_torch_wraps_is_reported_under_its_own_type_and_message(self) -> None:
        from torch._utils import ExceptionWrapper

        try:
            raise ShardIndexCorrupt("index 7 of 3 shards\nsecond line", 7)
        except ShardIndexCorrupt:
            wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
        with pytest.raises(RuntimeError) as raised:  # torch cannot rebuild it: a RuntimeError of text
            wrapped.reraise()
        typed = loader_failure(raised.value, rank=0, during="waiting for the batch of step 5")
        assert typed is not None and describe(typed) == (
            "ShardIndexCorrupt",
            "index 7 of 3 shards\nsecond line "
            "(in rank 0's loader process 1; waiting for the batch of step 5)",
        ), describe(typed) if typed else None

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (
                "DataLoader worker (pid 4242) is killed by signal: Killed. ",
                "(pid 4242) was killed by SIGKILL",
            ),
            ("DataLoader worker (pid 77) is killed by signal: Segmentation fault. ", "was killed by SIGSEGV"),
            (
                "DataLoader worker (pid 77) exited unexpectedly with exit code 3. Details are lost due to "
                "multiprocessing. Rerunning with num_workers=0 may give better error trace.",
                "(pid 77) exited with code 3",
            ),
            ("DataLoader worker (pid(s) 12, 13) exited unexpectedly", "(pid 12, 13) exited"),
        ],
    )
    def test_a_dead_loader_process_is_loader_process_died(self, text: str, expected: str) -> None:
        # The loader's own watch, which nothing reported to: without one, the reports of every
        # watch of this process count, and an earlier test's loader may not be collected yet.
        typed = loader_failure(RuntimeError(text), rank=1, watch=LoaderWatch())
        assert isinstance(typed, LoaderProcessDied) and expected in str(typed), typed

    def test_torchs_timeout_is_loader_timeout_naming_the_setting(self) -> None:
        typed = loader_failure(
            RuntimeError("DataLoader timed out after 600.0 seconds"), rank=0, watch=LoaderWatch()
        )
        assert isinstance(typed, LoaderTimeout), typed
        assert "in 600 s (data.loader_timeout_seconds)" in str(typed), typed

    def test_other_errors_and_typed_ones_are_left_alone(self) -> None:
        assert loader_failure(RuntimeError("Timed out waiting for peers"), rank=0) is None
        assert loader_failure(ValueError("bad"), rank=0) is None
        typed = LoaderTimeout("already typed")
        assert loader_failure(typed, rank=0) is None

    def test_a_loader_process_error_survives_pickling_with_its_reported_type(self) -> None:
        import pickle

        error = pickle.loads(pickle.dumps(LoaderProcessError("OSError", "AF_UNIX path too long")))
        assert describe(error) == ("OSError", "AF_UNIX path too long")


class TestRestarts:
    @pytest.mark.parametrize(
        ("error_type", "retried"),
        [
            # A batch pickle refuses is refused again by the same code on a restart.
            ("PicklingError", False),
            ("TypeError", False),
            # A storage or socket failure, an OOM kill, a read stuck on network storage: maybe not again.
            ("OSError", True),
            ("LoaderProcessDied", True),
            ("LoaderTimeout", True),
        ],
    )
    def test_a_restart_is_tried_only_where_it_may_not_repeat_the_failure(
        self, error_type: str, retried: bool
    ) -> None:
        assert is_retryable(JobError(type=error_type, message="m")) is retried


class TestOptions:
    def test_loader_processes_get_the_watch_and_the_timeout(self) -> None:
        with_processes = _options(loader_timeout_seconds=42)
        assert isinstance(with_processes["worker_init_fn"], LoaderWatch) and with_processes["timeout"] == 42
        without = loader_options(DataSpec(), CPU, seed=1)
        assert "worker_init_fn" not in without and "timeout" not in without
        assert DataSpec().loader_timeout_seconds == 600

    def test_a_plain_data_loader_without_processes_is_untouched(self) -> None:
        loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)), batch_size=2)
        got = Batches(loader, device=CPU, rank=0, first=0)
        assert got.take()[0].tolist() == [0.0, 1.0]


# ---- under torchrun: the rank's error event -----------------------------------------------------


def _error(run: EngineRun, rank: int) -> dict[str, Any]:
    errors = [e for e in run.events(rank) if e["type"] == "error"]
    assert len(errors) == 1, f"expected one error event on rank {rank}\n{run.describe()}"
    return errors[0]


@pytest.mark.e2e
def test_a_tmpdir_too_deep_for_a_socket_fails_every_rank_with_the_os_error_not_a_stall(
    engine_runner: Any, make_spec: Any, tmp_path: Path
) -> None:
    # The finding: an attempt's TMPDIR so deep that the socket multiprocessing opens there to pass a
    # batch's tensors exceeds AF_UNIX's 108 bytes; the batch was lost and the ranks waited forever.
    deep = tmp_path / ("t" * 60) / ("u" * 60)
    deep.mkdir(parents=True)
    spec = copy.deepcopy(make_spec(hyperparameters={"steps": 4}))
    spec["data"] = {"num_workers": 2}
    start = time.monotonic()
    run = engine_runner(spec, 2, extra_env={"TMPDIR": str(deep)})
    took = time.monotonic() - start
    assert run.returncode != 0, run.describe()
    failed = [r for r in range(2) if any(e["type"] == "error" for e in run.events(r))]
    assert failed, f"expected a rank's error event\n{run.describe()}"
    for rank in failed:
        error = _error(run, rank)
        assert error["error_type"] == "OSError", error
        assert error["message"].startswith("AF_UNIX path too long (in rank "), error
    assert "could not send a batch to its rank" in "".join(run.log(r) for r in range(2)), run.describe()
    assert took < 90, f"the job took {took:.0f} s to fail"
    assert_no_process_left(run.job_id)


@pytest.mark.e2e
def test_a_loader_process_killed_mid_run_fails_its_rank_with_loader_process_died(
    engine_runner: Any, make_spec: Any
) -> None:
    spec = make_spec(
        hyperparameters={"steps": 6, "global_batch_size": 8, "loader_fault": "sigkill", "kill_at": 20}
    )
    spec.update(recipe=None, entrypoint=ENTRYPOINT)
    spec["data"] = {"num_workers": 2}
    run = engine_runner(spec, 2, extra_env=ALLOWED)
    assert run.returncode != 0, run.describe()
    errors = [_error(run, r) for r in range(2) if any(e["type"] == "error" for e in run.events(r))]
    assert errors, run.describe()
    first = min(errors, key=lambda e: e["time"])
    assert first["error_type"] == "LoaderProcessDied", first
    assert "loader process (pid " in first["message"] and "killed by SIGKILL" in first["message"], first
    assert_no_process_left(run.job_id)
