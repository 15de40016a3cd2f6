"""The worker's code cache: verified once, unpacked once, read-only; hostile archives never write a byte."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import threading
from functools import partial
from pathlib import Path

import pytest

from dptrain.workdir import pack
from workers.sandbox import code_cache
from workers.sandbox.code_cache import (
    CodeArchiveError,
    CodeCorrupt,
    CodeMissing,
    UnsafeArchive,
    remove_cached,
    safe_extract,
    sha256_of,
    unpack_cached,
)

LIMIT = 1 << 20


Member = tuple[tarfile.TarInfo, bytes]


def member(name: str, data: bytes = b"", *, kind: bytes = tarfile.REGTYPE, link: str = "") -> Member:
    """A hand-built tar header (and its data) for a member, hostile or not."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def build(path: Path, members: list[Member]) -> Path:
    """Write members as a tar.gz, trusting whatever their headers say."""
    with gzip.open(path, "wb") as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Everything under root (file contents, link targets, directories), except the cache's lock files."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if "/.locks" in f"/{rel}":
                continue
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            else:
                found[rel] = path.read_bytes() if path.is_file() else "dir"
    return found


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """tmp_path holding a sentinel directory beside where the cache will be."""
    (tmp_path / "sentinel").mkdir()
    (tmp_path / "sentinel" / "keep").write_text("untouched")
    return tmp_path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def good_tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "run.sh", 0o755)
    os.symlink("pkg/mod.py", root / "alias.py")
    return root


def test_a_good_archive_unpacks_once_read_only_and_is_served_without_the_archive(site: Path) -> None:
    packed = pack(good_tree(site / "src"), site / "code.tar.gz")
    cache = site / "cache"
    tree = unpack_cached(archive=packed.path, sha256=packed.sha256, cache_dir=cache, max_unpacked_bytes=LIMIT)
    assert tree == cache / packed.sha256
    assert (tree / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert os.readlink(tree / "alias.py") == "pkg/mod.py" and (tree / "alias.py").read_text() == "X = 1\n"
    assert (mode(cache), mode(tree), mode(tree / "pkg")) == (0o711, 0o555, 0o555)
    assert (mode(tree / "pkg" / "mod.py"), mode(tree / "run.sh")) == (0o444, 0o555)
    assert sorted(p.name for p in cache.iterdir()) == [".locks", packed.sha256]
    packed.path.unlink()  # a second call must not read the archive at all
    again = unpack_cached(
        archive=packed.path, sha256=packed.sha256, cache_dir=cache, max_unpacked_bytes=LIMIT
    )
    assert again == tree


def test_concurrent_callers_extract_once(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = pack(good_tree(site / "src"), site / "code.tar.gz")
    calls: list[Path] = []
    real = code_cache.safe_extract

    def counting(archive: Path, dest: Path, **kwargs: int) -> None:
        calls.append(dest)
        real(archive, dest, **kwargs)

    monkeypatch.setattr(code_cache, "safe_extract", counting)
    start = threading.Barrier(8)
    results: list[Path] = []

    def worker() -> None:
        start.wait()
        results.append(
            unpack_cached(
                archive=packed.path, sha256=packed.sha256, cache_dir=site / "cache", max_unpacked_bytes=LIMIT
            )
        )

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [site / "cache" / packed.sha256] * 8


def test_a_sha_mismatch_is_corrupt_and_a_missing_archive_is_missing(site: Path) -> None:
    packed = pack(good_tree(site / "src"), site / "code.tar.gz")
    cache = site / "cache"
    wrong = "0" * 64
    with pytest.raises(CodeCorrupt, match=f"{packed.sha256}.*{wrong}"):
        unpack_cached(archive=packed.path, sha256=wrong, cache_dir=cache, max_unpacked_bytes=LIMIT)
    assert [p.name for p in cache.iterdir()] == [".locks"]
    with pytest.raises(CodeMissing, match="nothing.tar.gz"):
        unpack_cached(
            archive=site / "nothing.tar.gz", sha256=wrong, cache_dir=cache, max_unpacked_bytes=LIMIT
        )
    with pytest.raises(ValueError, match="not a sha256"):
        unpack_cached(archive=packed.path, sha256="../escape", cache_dir=cache, max_unpacked_bytes=LIMIT)
    assert [p.name for p in cache.iterdir()] == [".locks"]


def test_not_a_tar_gz_is_refused_by_name(site: Path) -> None:
    junk = site / "junk.tar.gz"
    junk.write_bytes(b"not gzip at all")
    with pytest.raises(CodeArchiveError, match="junk.tar.gz is not a readable tar.gz"):
        unpack_cached(
            archive=junk, sha256=sha256_of(junk), cache_dir=site / "cache", max_unpacked_bytes=LIMIT
        )
    assert [p.name for p in (site / "cache").iterdir()] == [".locks"]


def test_a_cached_tree_is_removable_and_comes_back(site: Path) -> None:
    packed = pack(good_tree(site / "src"), site / "code.tar.gz")
    unpack = partial(unpack_cached, archive=packed.path, sha256=packed.sha256, cache_dir=site / "cache")
    tree = unpack(max_unpacked_bytes=LIMIT)
    assert remove_cached(site / "cache", packed.sha256) is True
    assert not tree.exists() and [p.name for p in (site / "cache").iterdir()] == [".locks"]
    assert remove_cached(site / "cache", packed.sha256) is False
    assert unpack(max_unpacked_bytes=LIMIT) == tree
    assert (tree / "pkg" / "mod.py").read_text() == "X = 1\n"


SENTINEL_FILE = "../../sentinel/evil"  # from the cache's temporary directory, into the sentinel
HOSTILE = {
    "absolute path": ([member("/tmp/dptrain-evil-absolute", b"x")], "absolute path"),
    "dot-dot": ([member("../escape", b"x")], "'..' in the path"),
    "dot-dot into the sentinel": ([member(SENTINEL_FILE, b"x")], "'..' in the path"),
    "dot-dot inside": ([member("a/../../escape", b"x")], "'..' in the path"),
    "symlink to /etc/passwd": ([member("passwd", kind=tarfile.SYMTYPE, link="/etc/passwd")], "absolute"),
    "symlink up": ([member("up", kind=tarfile.SYMTYPE, link="../..")], "leaves the tree"),
    "symlink out through another link": (
        [
            member("here", kind=tarfile.SYMTYPE, link="."),
            member("sneaky", kind=tarfile.SYMTYPE, link="here/../x"),
        ],
        "'sneaky': symlink to 'here/../x' leaves the tree",
    ),
    "symlink loop": (
        [member("a", kind=tarfile.SYMTYPE, link="b/x"), member("b", kind=tarfile.SYMTYPE, link="a/y")],
        "symlink loop",
    ),
    "hard link outside": ([member("hl", kind=tarfile.LNKTYPE, link="../../sentinel/keep")], "hard link"),
    "hard link absolute": ([member("hl", kind=tarfile.LNKTYPE, link="/etc/passwd")], "hard link"),
    "written through a symlink": (
        [member("link", kind=tarfile.SYMTYPE, link=".."), member("link/evil", b"x")],
        "'link/evil': written through the symlink 'link'",
    ),
    "written through an in-tree symlink": (
        [
            member("d", kind=tarfile.DIRTYPE),
            member("link", kind=tarfile.SYMTYPE, link="d"),
            member("link/f", b"x"),
        ],
        "written through the symlink",
    ),
    "empty symlink target": ([member("nowhere", kind=tarfile.SYMTYPE, link="")], "empty target"),
    "a file used as a directory": (
        [member("f", b"x"), member("f/g", b"y")],
        "'f/g': written inside the file 'f'",
    ),
    "character device": ([member("null", kind=tarfile.CHRTYPE)], "'null': a character device"),
    "fifo": ([member("pipe", kind=tarfile.FIFOTYPE)], "'pipe': a fifo"),
    "duplicate": ([member("a.py", b"1"), member("./a.py", b"2")], "second member named 'a.py'"),
    "too big": (
        [member("a.bin", b"x" * 600), member("b.bin", b"x" * 600)],
        "'b.bin': members unpack to over",
    ),
}


def lying_header(path: Path) -> Path:
    """A member whose header claims a terabyte it does not carry."""
    info = tarfile.TarInfo("huge.bin")
    info.size = 10**12
    return build_raw(path, info.tobuf(tarfile.PAX_FORMAT))


def build_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data))
    return path


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_with_nothing_written_anywhere(site: Path, case: str) -> None:
    members, why = HOSTILE[case]
    archive = build(site / "evil.tar.gz", members)
    before = snapshot(site)
    with pytest.raises(UnsafeArchive, match=why.replace("(", r"\(")):
        unpack_cached(
            archive=archive, sha256=sha256_of(archive), cache_dir=site / "cache", max_unpacked_bytes=1000
        )
    after = snapshot(site)
    assert after.pop("cache") == "dir"
    assert after == before, "nothing written outside the cache, nothing left inside it"
    assert not Path("/tmp/dptrain-evil-absolute").exists()
    with pytest.raises(UnsafeArchive):  # refused before anything is written: dest is never even created
        safe_extract(archive, site / "dest", max_unpacked_bytes=1000)
    assert not (site / "dest").exists()


def test_a_header_lying_about_its_size_is_refused_before_reading_on(site: Path) -> None:
    archive = lying_header(site / "liar.tar.gz")
    with pytest.raises(UnsafeArchive, match="'huge.bin': members unpack to over 1000 bytes"):
        safe_extract(archive, site / "dest", max_unpacked_bytes=1000)
    assert not (site / "dest").exists()


def test_a_gzip_bomb_hidden_in_a_pax_header_is_stopped_by_counting_real_bytes(site: Path) -> None:
    # Member sizes sum to one byte; the pax record alone decompresses to 4 MiB.
    info, data = member("tiny.txt", b"x")
    info.pax_headers = {"comment": "z" * (4 << 20)}
    archive = build(site / "bomb.tar.gz", [(info, data)])
    assert archive.stat().st_size < 64 << 10
    with pytest.raises(UnsafeArchive, match="decompresses to more than"):
        safe_extract(archive, site / "dest", max_unpacked_bytes=1000)
    assert not (site / "dest").exists()


def test_too_many_members_are_refused(site: Path) -> None:
    archive = build(site / "many.tar.gz", [member(f"f{i}.txt", b"x") for i in range(11)])
    with pytest.raises(UnsafeArchive, match="more than 10 members"):
        safe_extract(archive, site / "dest", max_unpacked_bytes=LIMIT, max_members=10)
    assert not (site / "dest").exists()
    safe_extract(archive, site / "dest", max_unpacked_bytes=LIMIT, max_members=11)
    assert sorted(p.name for p in (site / "dest").iterdir()) == sorted(f"f{i}.txt" for i in range(11))


def test_archives_made_by_plain_tar_with_dot_slash_names_are_accepted(site: Path) -> None:
    archive = build(
        site / "dot.tar.gz",
        [
            member("./", kind=tarfile.DIRTYPE),
            member("./pkg", kind=tarfile.DIRTYPE),
            member("./pkg/a.py", b"A"),
        ],
    )
    safe_extract(archive, site / "dest", max_unpacked_bytes=LIMIT)
    assert (site / "dest" / "pkg" / "a.py").read_bytes() == b"A"


def test_only_the_members_the_survey_approved_are_extracted(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stands in for the file changing between the checking pass and the extracting pass.
    archive = build(site / "a.tar.gz", [member("a.py", b"A"), member("b.py", b"B")])
    approved = code_cache._survey(archive, max_unpacked_bytes=LIMIT, max_members=10)[:1]
    monkeypatch.setattr(code_cache, "_survey", lambda *_, **__: approved)
    with pytest.raises(UnsafeArchive, match="'b.py': the archive changed while it was read"):
        safe_extract(archive, site / "dest", max_unpacked_bytes=LIMIT)
