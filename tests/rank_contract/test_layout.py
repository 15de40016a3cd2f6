"""The job layout: where each of a job's files lies under the artifact root, byte for byte as ever."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from rank_contract.layout import JobFiles, RunFiles, code_archive, code_folder, rank_of

ROOT = Path("/srv/artifacts")
JOB = "0123456789abcdef0123456789abcdef"


class TestWhereAJobsFilesLie:
    """Every path is the one jobs already on disk have: a job's files are found after an upgrade."""

    def test_the_jobs_own_folders(self) -> None:
        job = JobFiles(ROOT, JOB)
        base = f"/srv/artifacts/jobs/{JOB}"
        assert str(job.jobs) == "/srv/artifacts/jobs"
        assert str(job.folder) == base
        assert str(job.checkpoints) == f"{base}/checkpoints"
        assert str(job.checkpoint(12)) == f"{base}/checkpoints/ckpt-000000012.pt"
        assert str(job.outputs) == f"{base}/outputs"
        assert str(job.init) == f"{base}/init"
        assert str(job.init_checkpoint(7)) == f"{base}/init/ckpt-000000007.pt"
        assert str(job.attempt(3)) == f"{base}/attempt-3"

    def test_a_nodes_run_directory_and_what_lies_in_it(self) -> None:
        run = JobFiles(ROOT, JOB).run(2, 1)
        base = f"/srv/artifacts/jobs/{JOB}/attempt-2/node-1"
        expected = {
            run.folder: base,
            run.spec: f"{base}/spec.json",
            run.pid: f"{base}/torchrun.pid",
            run.stop: f"{base}/stop",
            run.stacks_taken: f"{base}/stacks-taken",
            run.logs: f"{base}/logs",
            run.events: f"{base}/events",
            run.launcher_log: f"{base}/logs/launcher.log",
            run.setup_log: f"{base}/logs/setup.log",
            run.rank_log(5): f"{base}/logs/rank5.log",
            run.rank_events(5): f"{base}/events/rank5.jsonl",
            run.exception(5): f"{base}/exceptions/rank5.json",
            run.finished(5): f"{base}/finished/rank5",
            run.workdir: f"{base}/work",
            run.tmp: f"{base}/tmp",
            run.home: f"{base}/home",
        }
        wrong = {want: str(path) for path, want in expected.items() if str(path) != want}
        assert wrong == {}, f"expected path: path made {wrong}"
        assert run.scratch == (run.workdir, run.tmp, run.home)

    def test_a_rank_finds_the_same_files_from_its_run_directory_alone(self) -> None:
        # A rank knows only DPTRAIN_RUN_DIR: what it builds from it is what the worker built.
        worker = JobFiles(ROOT, JOB).run(4)
        rank = RunFiles(Path(str(worker.folder)))
        assert (rank.rank_events(0), rank.stop, rank.finished(0)) == (
            worker.rank_events(0),
            worker.stop,
            worker.finished(0),
        )
        assert worker.folder.name == "node-0", "a single-node job runs as node 0"

    def test_code_archives(self) -> None:
        sha = "ab" * 32
        assert str(code_folder(ROOT)) == "/srv/artifacts/code"
        assert str(code_archive(ROOT, sha)) == f"/srv/artifacts/code/{sha}.tar.gz"

    def test_a_path_relative_to_the_root_is_what_open_beneath_walks(self) -> None:
        job = JobFiles(ROOT, JOB)
        assert job.relative(job.checkpoint(3)) == f"jobs/{JOB}/checkpoints/ckpt-000000003.pt"


class TestOnlyOurJobIdsNameAFolder:
    """A job id becomes one path component: anything but the shape the service makes is refused."""

    def test_the_ids_the_service_makes_are_accepted(self) -> None:
        job_id = uuid.uuid4().hex  # service.jobs.service makes them so
        assert JobFiles(ROOT, job_id).folder.name == job_id

    @pytest.mark.parametrize(
        "job_id",
        [
            "",
            "..",
            "../" + JOB[3:],
            JOB[:16] + "/" + JOB[17:],
            JOB.upper(),
            JOB[:-1],
            JOB + "0",
            JOB[:-1] + "\n",
            "job-1",
        ],
    )
    def test_anything_else_is_refused(self, job_id: str) -> None:
        with pytest.raises(ValueError, match="not a job id"):
            JobFiles(ROOT, job_id)

    def test_a_sha256_names_an_archive_only_if_it_is_one(self) -> None:
        for bad in ("../x", "AB" * 32, "ab" * 31, "ab" * 32 + "\n"):
            with pytest.raises(ValueError, match="not a sha256"):
                code_archive(ROOT, bad)

    @pytest.mark.parametrize(("attempt", "node"), [(0, 0), (-1, 0), (1, -1)])
    def test_attempts_count_from_one_and_nodes_from_zero(self, attempt: int, node: int) -> None:
        with pytest.raises(ValueError, match="numbered from"):
            JobFiles(ROOT, JOB).run(attempt, node)

    def test_a_step_no_checkpoint_can_have_names_no_file(self) -> None:
        with pytest.raises(ValueError, match="no checkpoint name"):
            JobFiles(ROOT, JOB).checkpoint(-1)


def test_the_rank_of_a_log_or_event_file() -> None:
    run = RunFiles(Path("/r"))
    assert [
        rank_of(p.name) for p in (run.rank_log(3), run.rank_events(12), run.launcher_log, run.setup_log)
    ] == [
        3,
        12,
        None,
        None,
    ]
