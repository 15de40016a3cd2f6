"""How a command rank's failure is typed: the hook's file, torchrun's error file, the log, the exit.

The logs in tests/fixtures/rank_logs are real rank logs (workers.command.main under torchrun, 2
ranks, gloo) of: an assert after init_process_group, a SyntaxError and an IndentationError in the
main file, a KeyError on rank 1 under @record; torchelastic_error.json is what @record wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rank_contract.layout import RunFiles
from workers.command.failure import (
    TORCHELASTIC_ERROR_FILE_ENV,
    Raised,
    error_event,
    failure,
    from_hook_file,
    from_log,
    from_torchelastic_file,
)

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "rank_logs"


def _log(name: str) -> list[str]:
    return (LOGS / name).read_text().splitlines()


@pytest.mark.parametrize(
    ("log", "error_type", "message", "last_frame"),
    [
        (
            "after_init_rank1.log",
            "AssertionError",
            "",
            '  File "/tmp/cap/after_init.py", line 5, in <module>',
        ),
        ("syntax_error_rank0.log", "SyntaxError", "expected ':'", '  File "/tmp/cap/syntax.py", line 3'),
        (
            "indentation_error_rank0.log",
            "IndentationError",
            "unexpected indent",
            '  File "/tmp/cap/indent.py", line 3',
        ),
        ("record_rank1.log", "KeyError", "'shard-7'", '  File "/tmp/cap/rank1.py", line 12, in main'),
    ],
)
def test_the_log_names_the_exception_behind_rank_prefixes_and_without_a_header(
    log: str, error_type: str, message: str, last_frame: str
) -> None:
    raised = from_log(_log(log))
    assert raised is not None and (raised.type, raised.message) == (error_type, message), raised
    assert raised.traceback is not None and "[rank" not in raised.traceback, "torch's prefixes are taken off"
    assert last_frame in raised.traceback.splitlines(), raised.traceback
    assert raised.traceback.splitlines()[-1].startswith(error_type)


def test_a_bare_assert_is_named_by_its_line() -> None:
    event = error_event(1, 1, raised=from_log(_log("after_init_rank1.log")), log=[])
    assert (event.rank, event.error_type) == (1, "AssertionError")
    assert event.message == "assert n_embd % n_head == 0 (after_init.py, line 5)"


def test_the_last_of_chained_exceptions_and_output_around_it() -> None:
    tail = [
        "step 3 loss 1.25",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "t.py", line 2, in <module>',
        "[rank0]: KeyError: 'lr'",
        "",
        "[rank0]: During handling of the above exception, another exception occurred:",
        "",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "t.py", line 4, in <module>',
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory",
    ]
    assert from_log(tail) == Raised(
        "OutOfMemoryError",
        "CUDA out of memory",
        'Traceback (most recent call last):\n  File "t.py", line 4, in <module>\n'
        "torch.OutOfMemoryError: CUDA out of memory",
    )


@pytest.mark.parametrize(
    "tail",
    [
        [],
        ["epoch 1 done", "giving up"],
        # A program's own words that look like an exception line, not after a frame.
        ["SyntaxError: in the config, line 3"],
        ["config:", "  lr: 0.1", "SyntaxError: bad config"],
    ],
)
def test_a_log_without_a_traceback_names_nothing(tail: list[str]) -> None:
    assert from_log(tail) is None


def test_torchruns_error_file_as_record_writes_it(tmp_path: Path) -> None:
    raised = from_torchelastic_file(str(LOGS / "torchelastic_error.json"))
    assert raised is not None and (raised.type, raised.message) == ("KeyError", "'shard-7'")
    assert raised.traceback and raised.traceback.rstrip().endswith("KeyError: 'shard-7'")
    newer = tmp_path / "new.json"
    newer.write_text(json.dumps({"message": "ValueError: bad shape"}))
    assert from_torchelastic_file(str(newer)) == Raised("ValueError", "bad shape", None)


@pytest.mark.parametrize(
    "content",
    ["", "{not json", "[]", '{"type": 3}', '{"type": "not a type name"}', '{"message": "no type"}'],
)
def test_a_damaged_or_foreign_file_names_nothing(tmp_path: Path, content: str) -> None:
    path = tmp_path / "f.json"
    path.write_text(content)
    assert from_hook_file(path) is None
    assert from_torchelastic_file(str(path)) is None
    assert from_hook_file(tmp_path / "missing.json") is None and from_torchelastic_file(None) is None
    os.mkfifo(tmp_path / "fifo.json")  # the program's own: opening it would wait for a writer forever
    assert from_hook_file(tmp_path / "fifo.json") is None


def _hook(run_dir: Path, rank: int, kind: str, message: str) -> None:
    path = RunFiles(run_dir).exception(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "type": kind,
        "message": message,
        "traceback": f"Traceback ...\n{kind}: {message}",
        "rank": rank,
    }
    path.write_text(json.dumps(record))


def test_the_hook_comes_first_then_torchruns_file_then_the_log_then_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "rank1.log"
    log.write_text((LOGS / "syntax_error_rank0.log").read_text())
    monkeypatch.setenv(TORCHELASTIC_ERROR_FILE_ENV, str(LOGS / "torchelastic_error.json"))
    _hook(tmp_path, 1, "ZeroDivisionError", "division by zero")

    def typed() -> tuple[str, str]:
        event = failure(1, 1, run_dir=tmp_path, log_path=log)
        assert event.rank == 1
        return event.error_type, event.message

    assert typed() == ("ZeroDivisionError", "division by zero")
    RunFiles(tmp_path).exception(1).unlink()
    assert typed() == ("KeyError", "'shard-7'")
    monkeypatch.delenv(TORCHELASTIC_ERROR_FILE_ENV)
    assert typed() == ("SyntaxError", "expected ':'")
    log.write_text("exiting\n")
    assert typed() == ("ProcessExited", "rank 1 exited with code 1")
    assert failure(1, -9, run_dir=tmp_path, log_path=log).message == "rank 1 was killed by SIGKILL"
    assert failure(1, -9, run_dir=tmp_path, log_path=log).traceback == "exiting", "the log's tail is kept"
