"""dptrain's start-up hook in a rank's interpreter (workers/command/rank_hook/), on real interpreters.

Each test starts a bare Python (no torch) with the hook's folder first on PYTHONPATH, as
workers/sandbox/rank_env.py sets it for every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rank_contract.env import EXCEPTION_FILE_ENV
from workers.sandbox.rank_env import RANK_HOOK_DIR

pytestmark = pytest.mark.e2e


def _python(
    code: str, *, record: Path | None, path: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != EXCEPTION_FILE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (RANK_HOOK_DIR, *path))
    env["RANK"] = "1"
    if record is not None:
        env[EXCEPTION_FILE_ENV] = str(record)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_uncaught_exception_is_recorded_and_still_printed(tmp_path: Path) -> None:
    record = tmp_path / "rank1.json"
    code = "import os, sys\nprint(os.environ.get('DPTRAIN_EXCEPTION_FILE'))\nraise KeyError('lr')"
    r = _python(code, record=record)
    assert r.returncode == 1 and r.stdout == "None\n", "the program does not see the variable"
    assert r.stderr.endswith("KeyError: 'lr'\n") and "Traceback (most recent call last):" in r.stderr
    data = json.loads(record.read_text())
    assert (data["type"], data["message"], data["rank"]) == ("KeyError", "'lr'", "1")
    assert data["traceback"].endswith("KeyError: 'lr'\n")


def test_a_chained_hook_keeps_working_and_exit_codes_are_no_exceptions(tmp_path: Path) -> None:
    # As torch's init_process_group does: a hook that calls the one before it.
    record = tmp_path / "r.json"
    code = (
        "import sys\n"
        "before = sys.excepthook\n"
        "sys.excepthook = lambda *a: (print('[rank1]: theirs', file=sys.stderr), before(*a))\n"
        "assert 1 == 2"
    )
    r = _python(code, record=record)
    assert "[rank1]: theirs" in r.stderr and json.loads(record.read_text())["type"] == "AssertionError"
    record.unlink()
    assert _python("import sys; sys.exit(3)", record=record).returncode == 3
    assert not record.exists(), "sys.exit is not an exception that ended the program"


def test_only_the_first_python_records_not_its_subprocesses(tmp_path: Path) -> None:
    record = tmp_path / "r.json"
    inner = "raise ValueError('inner')"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])\nprint('done')"
    r = _python(code, record=record)
    assert r.returncode == 0 and "ValueError: inner" in r.stderr
    assert not record.exists(), "a handled failure of a helper is not the program's"


def test_an_unwritable_file_never_breaks_the_program(tmp_path: Path) -> None:
    r = _python("raise RuntimeError('boom')", record=tmp_path / "missing-dir" / "r.json")
    assert r.returncode == 1 and r.stderr.endswith("RuntimeError: boom\n"), r.stderr


def test_the_jobs_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.FROM_USER = 42\n")
    code = "import sitecustomize\nprint(FROM_USER, sitecustomize.__file__)\nraise TypeError('x')"
    record = tmp_path / "r.json"
    r = _python(code, record=record, path=(tmp_path,))
    assert r.stdout == f"42 {tmp_path / 'sitecustomize.py'}\n", r.stderr
    assert json.loads(record.read_text())["type"] == "TypeError", "and dptrain's hook too"
