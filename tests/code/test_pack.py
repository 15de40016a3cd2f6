"""The code archive: the same tree always gives the same bytes; ignore rules and symlinks as git would."""

from __future__ import annotations

import gzip
import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from dptrain import workdir
from dptrain.workdir import included_files, largest_paths, largest_top_level, pack

FILES = {
    "main.py": b"print('hi')\n",
    "pkg/__init__.py": b"",
    "pkg/mod.py": b"X = 1\n",
    "pkg/deep/data.bin": bytes(range(256)) * 4,
    "run.sh": b"#!/bin/sh\necho run\n",
}


def make_tree(root: Path, *, reverse: bool = False, mtime: int = 1_700_000_000, mode: int = 0o644) -> Path:
    """Write FILES under root in the given order, with the given mtime and mode (run.sh stays executable)."""
    for rel in sorted(FILES, reverse=reverse):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(FILES[rel])
        os.chmod(path, 0o755 if rel == "run.sh" else mode)
        os.utime(path, (mtime, mtime))
    (root / "empty").mkdir()
    return root


def members(archive: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(archive, "r:gz") as tar:
        return tar.getmembers()


def test_the_same_tree_packs_to_the_same_bytes_whatever_mtimes_modes_and_creation_order(
    tmp_path: Path,
) -> None:
    first = make_tree(tmp_path / "a")
    other = make_tree(tmp_path / "b", reverse=True, mtime=1_000, mode=0o600)
    os.chmod(other / "pkg", 0o700)
    one = pack(first, tmp_path / "1.tar.gz")
    again = pack(first, tmp_path / "2.tar.gz")
    copy = pack(other, tmp_path / "3.tar.gz")
    data = (tmp_path / "1.tar.gz").read_bytes()
    assert one.sha256 == again.sha256 == copy.sha256 == hashlib.sha256(data).hexdigest()
    assert data == (tmp_path / "2.tar.gz").read_bytes() == (tmp_path / "3.tar.gz").read_bytes()
    assert one.size_bytes == len(data)
    assert one.files == len(FILES)
    assert one.path == tmp_path / "1.tar.gz"
    assert one.skipped == []


def test_entries_are_sorted_with_fixed_metadata_and_the_gzip_header_names_no_time_or_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "code.tar.gz"
    pack(make_tree(tmp_path / "t", mode=0o600), out)
    found = members(out)
    assert [m.name for m in found] == [
        "empty", "main.py", "pkg", "pkg/__init__.py", "pkg/deep", "pkg/deep/data.bin", "pkg/mod.py", "run.sh"
    ]  # fmt: skip
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in found} == {(0, 0, 0, "", "")}
    modes = {m.name: m.mode for m in found}
    assert modes["main.py"] == modes["pkg/mod.py"] == 0o644
    assert modes["run.sh"] == modes["pkg"] == modes["empty"] == 0o755
    header = out.read_bytes()[:10]
    assert header[3] & 0x08 == 0, "no FNAME field in the gzip header"
    assert header[4:8] == b"\0\0\0\0", "gzip mtime is 0"
    with tarfile.open(out, "r:gz") as tar:
        extracted = tar.extractfile("pkg/deep/data.bin")
        assert extracted is not None and extracted.read() == FILES["pkg/deep/data.bin"]
    assert gzip.decompress(out.read_bytes())  # a plain, whole gzip stream


def write(root: Path, rel: str, data: str = "x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)


def test_ignore_files_nested_ignore_files_negation_and_what_is_always_left_out(tmp_path: Path) -> None:
    root = tmp_path / "t"
    for rel in [
        "main.py", "notes.txt", "keep.txt", "run.log", "build/out.o", "table.csv", "small.csv",
        "data/big.bin", "gen/root_gen.py", "docs/a.md",
        "sub/code.py", "sub/local.cfg", "sub/gen/x.py", "sub/docs/a.md", "sub/docs/b.rst", "sub/keep.txt",
        ".git/HEAD", "sub/.git", "__pycache__/m.cpython-311.pyc", "stray.pyc", "pkg/__pycache__/x.pyc",
        "myenv/pyvenv.cfg", "myenv/lib/site.py", ".venv/bin/python", "venv/x", ".tox/x", ".mypy_cache/x",
        ".pytest_cache/x", "node_modules/left/index.js",
    ]:  # fmt: skip
        write(root, rel)
    write(root, ".gitignore", "*.txt\n!keep.txt\n*.log\nbuild/\n*.csv\n# a comment\n")
    write(root, ".dptrainignore", "data/\n!small.csv\n")
    # Patterns are relative to the directory holding the ignore file.
    write(root, "sub/.gitignore", "local.cfg\n/gen\ndocs/*.md\n")
    write(root, "sub/.dptrainignore", "keep.txt\n")
    assert [rel for rel, _ in included_files(root)] == [
        ".dptrainignore", ".gitignore", "docs/a.md", "gen/root_gen.py", "keep.txt", "main.py", "small.csv",
        "sub/.dptrainignore", "sub/.gitignore", "sub/code.py", "sub/docs/b.rst",
    ]  # fmt: skip
    assert dict(included_files(root))["main.py"] == root / "main.py"


def test_ignored_directories_are_never_entered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "t"
    for rel in ["main.py", "data/a/b/c.bin", ".venv/lib/x.py", "node_modules/m/i.js", "env/pyvenv.cfg"]:
        write(root, rel)
    write(root, ".gitignore", "data/\n")
    entered: list[str] = []
    real_scandir = os.scandir

    def spying(path: Path) -> object:
        entered.append(Path(path).relative_to(root).as_posix())
        return real_scandir(path)

    monkeypatch.setattr(workdir.os, "scandir", spying)
    assert [rel for rel, _ in included_files(root)] == [".gitignore", "main.py"]
    assert entered == ["."]


def test_largest_paths_biggest_first_ties_by_name_and_ignored_files_not_counted(tmp_path: Path) -> None:
    root = tmp_path / "t"
    for rel, size in [("a.bin", 10), ("data/x.bin", 300), ("data/y.bin", 300), ("data/z/w.bin", 50),
                      ("model.pt", 200), ("small.py", 1), ("skip/huge.bin", 10_000)]:  # fmt: skip
        write(root, rel, "x" * size)
    write(root, ".dptrainignore", "skip/\n")
    expected = [("data/x.bin", 300), ("data/y.bin", 300), ("model.pt", 200)]
    assert largest_paths(root, n=3) == expected
    tops = [("data/", 650), ("model.pt", 200), ("a.bin", 10), (".dptrainignore", 6), ("small.py", 1)]
    assert largest_top_level(root) == tops
    packed = pack(root, tmp_path / "out.tar.gz")
    assert packed.largest[:3] == expected
    assert len(packed.largest) == 7 and packed.largest[-1] == ("small.py", 1)


def test_symlinks_inside_the_tree_are_kept_as_links_others_skipped_with_a_reason(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, "pkg/mod.py", "X = 1\n")
    write(tmp_path / "outside", "secret.py", "S = 1\n")
    os.symlink("pkg/mod.py", root / "alias.py")
    os.symlink("pkg", root / "pkglink")  # a symlinked directory: kept as a link, never followed
    os.symlink("../mod.py", root / "pkg" / "up.py")
    os.symlink("/etc/passwd", root / "passwd")
    os.symlink("../outside/secret.py", root / "secret.py")
    os.symlink("../..", root / "pkg" / "top")
    os.symlink(tmp_path / "outside", root / "outdir")
    os.mkfifo(root / "pipe")
    packed = pack(root, root / "code.tar.gz")  # the archive inside the tree is not packed into itself
    found = {m.name: m for m in members(packed.path)}
    assert sorted(found) == ["alias.py", "pkg", "pkg/mod.py", "pkg/up.py", "pkglink"]
    assert found["alias.py"].issym() and found["alias.py"].linkname == "pkg/mod.py"
    assert found["pkglink"].issym() and found["pkglink"].linkname == "pkg"
    reasons = dict(packed.skipped)
    assert sorted(reasons) == ["outdir", "passwd", "pipe", "pkg/top", "secret.py"]
    assert "absolute" in reasons["passwd"] and "/etc/passwd" in reasons["passwd"]
    assert "leaves the tree" in reasons["secret.py"] and "leaves the tree" in reasons["pkg/top"]
    assert "absolute" in reasons["outdir"]
    assert reasons["pipe"] == "fifo"


def test_a_link_that_resolves_out_through_another_link_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "t"
    write(root, "a.py")
    os.symlink(".", root / "here")
    os.symlink("here/../x", root / "sneaky")  # lexically "x", really outside
    packed = pack(root, tmp_path / "c.tar.gz")
    assert [name for name, _ in packed.skipped] == ["sneaky"]
    assert sorted(m.name for m in members(packed.path)) == ["a.py", "here"]
