"""What packing leaves out is counted (dptrain/left_out.py), and include patterns take ignored files back."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from dptrain.left_out import DATA_MIN_BYTES, SHOWN, Include, Tally, looks_like_data, suggested_includes
from dptrain.workdir import pack


def write(root: Path, rel: str, size: int = 1) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def names(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return [m.name for m in tar.getmembers()]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "t"
    for rel, size in [
        ("train.py", 5), ("ckpt/model.pt", 300), ("notes.txt", 4), ("corpus.txt", DATA_MIN_BYTES + 1),
        ("out/deep/run.log", 7), ("out/deep/weights.safetensors", 50),
        ("stray.pyc", 2), ("pkg/__pycache__/m.pyc", 2), ("myenv/pyvenv.cfg", 1), (".git/HEAD", 1),
    ]:  # fmt: skip
        write(root, rel, size)
    (root / ".gitignore").write_text("*.txt\nckpt/\nout/\n")
    (root / "out" / ".gitignore").write_text("!run.log\n")  # in an ignored folder: no effect, as in git
    return root


def test_every_file_the_rules_drop_is_counted_in_ignored_folders_too(tree: Path, tmp_path: Path) -> None:
    packed = pack(tree, tmp_path / "a.tar.gz")
    assert names(packed.path) == [".gitignore", "pkg", "train.py"]
    data, other = packed.left_out.data, packed.left_out.other
    assert data.biggest == [("corpus.txt", DATA_MIN_BYTES + 1), ("ckpt/model.pt", 300),
                            ("out/deep/weights.safetensors", 50)]  # fmt: skip
    assert (data.count, data.bytes) == (3, DATA_MIN_BYTES + 351), "a big file is data, whatever its name"
    assert sorted(other.biggest) == [("notes.txt", 4), ("out/.gitignore", 9), ("out/deep/run.log", 7)]
    assert dict(packed.left_out.never) == {".git/": 1, "__pycache__/": 1, "myenv/": 1, "*.pyc": 1}
    assert packed.left_out.included.count == 0 and packed.left_out.unmatched == []


def test_include_takes_ignored_files_and_their_folders_but_never_what_is_always_left_out(
    tree: Path, tmp_path: Path
) -> None:
    include = ["out/", "!out/deep/run.log", "*.pt", "*.pyc", ".git/", "nothing/"]
    packed = pack(tree, tmp_path / "a.tar.gz", include=include)
    assert names(packed.path) == [
        ".gitignore", "ckpt", "ckpt/model.pt", "out", "out/.gitignore", "out/deep",
        "out/deep/weights.safetensors", "pkg", "train.py",
    ]  # fmt: skip
    assert packed.left_out.included.count == 3 and packed.left_out.included.bytes == 359
    assert packed.left_out.unmatched == ["*.pyc", ".git/", "nothing/"], "a negation is never reported"
    assert ("out/deep/run.log", 7) in packed.left_out.other.biggest, "the later negation wins"
    again = pack(tree, tmp_path / "b.tar.gz", include=include)
    assert again.sha256 == packed.sha256, "still reproducible"


def test_a_bad_include_pattern_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="bad --include pattern"):
        Include(["!"])


def test_a_tally_counts_everything_and_keeps_only_the_biggest() -> None:
    tally = Tally()
    for i in range(1000):
        tally.add(f"f{i:04d}", i % 97)
    assert (tally.count, tally.bytes) == (1000, sum(i % 97 for i in range(1000)))
    assert len(tally.biggest) == SHOWN and tally.biggest[0] == ("f0096", 96)
    assert [size for _, size in tally.biggest] == sorted((i % 97 for i in range(1000)), reverse=True)[:SHOWN]


@pytest.mark.parametrize(
    ("rel", "size", "data"),
    [("train.bin", 1, True), ("x/Model.PT", 1, True), ("a.tar.gz", 1, True), ("notes.md", 10, False),
     ("input.txt", DATA_MIN_BYTES + 1, True), ("input.txt", DATA_MIN_BYTES, False)],
)  # fmt: skip
def test_data_is_known_by_its_suffix_or_its_size(rel: str, size: int, data: bool) -> None:
    assert looks_like_data(rel, size) is data


def test_the_suggested_includes_are_the_data_suffixes_or_the_paths_big_by_size_alone() -> None:
    paths = ["d/train.bin", "d/val.bin", "d/meta.pkl", "d/input.txt", "Model.PT", "README"]
    assert suggested_includes(paths) == ["*.PT", "*.bin", "*.pkl", "README", "d/input.txt"]
