"""`dptrain submit --workdir`: the tree is packed, uploaded when the server lacks it, refused when too big."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.cli.conftest import dptrain, flat


def tree(root: Path) -> Path:
    """A working directory with a script and one big data file."""
    root.mkdir()
    (root / "train.py").write_text("print('hello')\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(bytes(range(256)) * 400)
    return root


Served = Callable[[dict[str, httpx.Response]], list[str]]


def test_a_413_refuses_listing_the_largest_paths(
    served: Served, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    too_big = {"error": "too_large", "detail": "over DPTRAIN_CODE_MAX_BYTES (1024)"}
    calls = served({"HEAD": httpx.Response(404), "PUT": httpx.Response(413, json=too_big)})
    work = tree(tmp_path / "work")
    r = dptrain("submit", spec_file(recipe=None, command=["python", "train.py"]), "--workdir", work)
    assert r.exit_code == 3, r.output
    said = flat(r.stderr)
    assert "over DPTRAIN_CODE_MAX_BYTES (1024)" in said and ".dptrainignore" in said, r.stderr
    assert said.index("data/big.bin") < said.index("train.py"), "the largest path comes first"
    assert calls == ["HEAD", "PUT"], f"no job is submitted after a refused upload: {calls}"
    assert r.stdout == ""


def test_max_code_bytes_refuses_before_anything_is_sent(
    served: Served, spec_file: Callable[..., Path], tmp_path: Path
) -> None:
    calls = served({})
    work = tree(tmp_path / "work")
    spec = spec_file(recipe=None, command=["python", "train.py"])
    r = dptrain("submit", spec, "--workdir", work, "--max-code-bytes", "100")
    assert r.exit_code == 3 and calls == [], r.output
    said = flat(r.stderr)
    assert "over --max-code-bytes 100" in said and "data/big.bin" in said, r.stderr
