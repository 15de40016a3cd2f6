"""The bwrap command line of an attempt's sandbox: what it binds, how, what it never shows."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rank_contract.layout import JobFiles
from workers.sandbox import bubblewrap
from workers.sandbox.bubblewrap import Box, bwrap_argv
from workers.sandbox.scratch import make_scratch, remove_earlier, remove_scratch, short_tmp

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _mounts(argv: list[str]) -> dict[str, tuple[str, str]]:
    """Destination -> (option, source) of every bind in `argv` (before the command)."""
    found: dict[str, tuple[str, str]] = {}
    args = argv[: argv.index("--")]
    for i, arg in enumerate(args):
        if arg in ("--bind", "--ro-bind", "--dev-bind"):
            found[args[i + 2]] = (arg, args[i + 1])
    return found


@dataclass(frozen=True)
class Folders:
    """The folders of one node's attempt that its sandbox binds."""

    run_dir: Path
    checkpoint_dir: Path
    output_dir: Path
    code_dir: Path
    data_root: Path


@pytest.fixture
def folders(tmp_path: Path) -> Folders:
    """DPTRAIN_HOME holds the code cache, artifacts live apart."""
    home = tmp_path / "home"
    code = home / "code-cache" / ("ab" * 32)
    run_dir = tmp_path / "artifacts" / "jobs" / "j1" / "attempt-1" / "node-0"
    for folder in (code, run_dir, tmp_path / "data"):
        folder.mkdir(parents=True)
    (home / "token").write_text("secret")
    job_dir = run_dir.parents[1]
    return Folders(run_dir, job_dir / "checkpoints", job_dir / "outputs", code, tmp_path / "data")


@pytest.fixture
def box(folders: Folders) -> Box:
    """A node's sandbox as the worker makes it (workers/sandbox/rank_setup.prepare)."""
    scratch = make_scratch(folders.run_dir, folders.code_dir)
    return Box(
        workdir=scratch.workdir,
        tmp_dir=scratch.tmp,
        writable=(folders.run_dir, folders.checkpoint_dir, folders.output_dir),
        read_only=(folders.code_dir, folders.data_root),
    )


class TestMounts:
    def test_the_attempts_folders_are_writable_at_their_host_paths(self, box: Box, folders: Folders) -> None:
        mounts = _mounts(bwrap_argv(box, TORCHRUN))
        assert mounts[str(folders.run_dir)] == ("--bind", str(folders.run_dir))
        assert mounts[str(folders.checkpoint_dir)] == ("--bind", str(folders.checkpoint_dir))
        assert mounts[str(folders.output_dir)] == ("--bind", str(folders.output_dir)), "DPTRAIN_OUTPUT_DIR"
        assert mounts["/tmp"] == ("--bind", str(box.tmp_dir)), "/tmp is the attempt's own tmp"

    def test_code_data_python_and_system_are_read_only(self, box: Box, folders: Folders) -> None:
        mounts = _mounts(bwrap_argv(box, TORCHRUN))
        for path in (
            folders.code_dir,
            folders.data_root,
            Path(os.path.realpath(sys.base_prefix)),
            Path("/usr"),
            Path("/etc"),
        ):
            assert mounts.get(str(path)) == ("--ro-bind", str(path)), (
                f"{path} read-only: {mounts.get(str(path))}"
            )
        writable = {dest for dest, (option, _) in mounts.items() if option != "--ro-bind"}
        expected = {str(folders.run_dir), str(folders.checkpoint_dir), str(folders.output_dir), "/tmp"}
        assert writable == expected, writable

    def test_nothing_else_of_dptrain_home_and_not_the_repository_root(
        self, box: Box, folders: Folders
    ) -> None:
        home = folders.code_dir.parents[1]
        sources = {Path(source) for _, source in _mounts(bwrap_argv(box, TORCHRUN)).values()}
        under_home = {s for s in sources if s == home or home in s.parents}
        assert under_home == {folders.code_dir}, f"only the job's own code tree of DPTRAIN_HOME: {under_home}"
        assert not [s for s in sources if s in home.parents], "no folder above DPTRAIN_HOME is bound"
        # In development our packages are an editable install of this repository, whose root may hold
        # the default DPTRAIN_HOME (.dptrain): each package folder is bound, never the root.
        assert ROOT not in sources and not [s for s in sources if s in ROOT.parents]
        assert ROOT / "workers" in sources or any(s in (ROOT / "workers").parents for s in sources)

    def test_new_namespaces_proc_and_dev_and_the_working_directory(self, box: Box) -> None:
        argv = bwrap_argv(box, TORCHRUN)
        options = argv[: argv.index("--")]
        for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"):
            assert flag in options, flag
        assert "--unshare-net" not in options, "multi-node rendezvous needs the host's network"
        assert (
            options[options.index("--proc") + 1] == "/proc" and options[options.index("--dev") + 1] == "/dev"
        )
        assert options[options.index("--chdir") + 1] == str(box.workdir)
        assert argv[-len(TORCHRUN) :] == TORCHRUN

    def test_gpus_are_device_bound_on_cuda_nodes_only(
        self, box: Box, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(bubblewrap.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidiactl"])
        assert "--dev-bind" not in bwrap_argv(box, TORCHRUN)
        mounts = _mounts(bwrap_argv(dataclasses.replace(box, gpus=True), TORCHRUN))
        assert mounts["/dev/nvidia0"] == ("--dev-bind", "/dev/nvidia0")
        assert mounts["/dev/nvidiactl"] == ("--dev-bind", "/dev/nvidiactl")


class TestUser:
    def test_a_root_workers_sandbox_switches_to_the_ranks_user_with_no_new_privileges(self, box: Box) -> None:
        argv = bwrap_argv(dataclasses.replace(box, uid=65534, gid=65534), TORCHRUN)
        switch = argv[argv.index("--") + 1 : -len(TORCHRUN)]
        assert switch[0].endswith("/setpriv") and "--reuid=65534" in switch and "--regid=65534" in switch
        assert {"--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"} <= set(switch)
        assert "--unshare-user" not in argv, "a root bwrap's user namespace would map the ranks to host root"

    def test_without_a_user_the_command_runs_as_bwraps_own(self, box: Box) -> None:
        argv = bwrap_argv(box, TORCHRUN)
        assert argv[argv.index("--") + 1 :] == TORCHRUN


class TestScratch:
    def test_the_workdir_is_a_writable_copy_and_scratch_goes_at_the_end(self, tmp_path: Path) -> None:
        code = tmp_path / "code"
        (code / "pkg").mkdir(parents=True)
        (code / "pkg" / "train.py").write_text("print(1)\n")
        (code / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(code / "run.sh", 0o555)
        for path in (code / "pkg" / "train.py", code / "pkg", code):
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        run_dir = tmp_path / "run"
        (run_dir / "logs").mkdir(parents=True)
        scratch = make_scratch(run_dir, code)
        (scratch.workdir / "state.txt").write_text("mine")
        (scratch.workdir / "pkg" / "train.py").write_text("changed\n")
        assert (code / "pkg" / "train.py").read_text() == "print(1)\n", "the cached tree is untouched"
        assert os.access(scratch.workdir / "run.sh", os.X_OK), "an executable stays executable"
        os.chmod(scratch.workdir / "pkg", 0o500)  # a job that locks a folder of its own
        remove_scratch(run_dir)
        assert sorted(p.name for p in run_dir.iterdir()) == ["logs"], "work, tmp and home are gone; logs stay"

    def test_a_later_attempt_removes_the_scratch_an_earlier_one_left_on_its_node(
        self, tmp_path: Path
    ) -> None:
        job = JobFiles(tmp_path, "c" * 32)
        job_dir = job.folder
        for attempt, node in ((1, 0), (1, 1), (2, 0)):
            make_scratch(job_dir / f"attempt-{attempt}" / f"node-{node}", None)
        remove_earlier(job, attempt=3, node_rank=0)
        left = sorted(str(p.relative_to(job_dir)) for p in job_dir.glob("attempt-*/node-*/*"))
        assert left == ["attempt-1/node-1/home", "attempt-1/node-1/tmp", "attempt-1/node-1/work"], left

    def test_unsandboxed_ranks_get_a_short_tmpdir_that_goes_with_the_scratch(self, tmp_path: Path) -> None:
        # A run directory under an ordinary home is too deep for multiprocessing's AF_UNIX sockets.
        run_dir = tmp_path / ("d" * 80) / "attempt-1" / "node-0"
        scratch = make_scratch(run_dir, None)
        tmp = short_tmp(run_dir)
        assert len(str(tmp / "pymp-abcdefgh" / "listener-abcdefgh")) < 108 < len(str(scratch.tmp))
        (tmp / "x").write_text("y")
        assert (scratch.tmp / "x").read_text() == "y", "the short path is the attempt's own tmp"
        assert short_tmp(run_dir) == tmp, "a second delivery of the attempt reuses the name"
        remove_scratch(run_dir)
        assert not tmp.is_symlink() and not scratch.tmp.exists()
