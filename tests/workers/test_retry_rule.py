"""Which failures are retried: the not-retried set by name, as the wire carries it, and how it is built."""

from __future__ import annotations

import pytest

from api_schemas import JobError
from rank_contract.data import DataPathError
from rank_contract.failures import Failure, named
from workers.attempt.end import NOT_RETRIED, is_retryable
from workers.engine.batch_loader import DataLoadError, DataReadError
from workers.engine.compile import CompileUnavailable
from workers.engine.loader_faults import LoaderProcessDied, LoaderTimeout
from workers.sandbox.code_cache import CodeCorrupt, CodeMissing, UnsafeArchive

# The set as decided before the failure types had one home (issue 39): moving the names next to
# their definitions must neither add nor drop one. A change here is a change of the retry rule.
DECIDED = frozenset(
    {
        # Built-in exceptions a rank's own code raises, and pydantic's and pickle's.
        "FloatingPointError",
        "ValueError",
        "ValidationError",
        "TypeError",
        "KeyError",
        "IndexError",
        "AttributeError",
        "NameError",
        "UnboundLocalError",
        "ImportError",
        "ModuleNotFoundError",
        "SyntaxError",
        "IndentationError",
        "TabError",
        "AssertionError",
        "NotImplementedError",
        "PermissionError",
        "PicklingError",
        # dptrain's own.
        "CheckpointMissing",
        "UnsafeArchive",
        "CodeCorrupt",
        "CodeMissing",
        "CommandNotFound",
        "CommandNotExecutable",
        "CompileUnavailable",
        "DataPathError",
        "DataLoadError",
        "OutputTooLarge",
        "CheckpointTooLarge",
        "InitCheckpointMismatch",
        "InitCheckpointMissing",
        "EnvironmentBuildFailed",
        "RequirementsFileMissing",
        "EnvironmentTooLarge",
    }
)


def test_the_not_retried_set_is_the_one_decided() -> None:
    added, dropped = sorted(NOT_RETRIED - DECIDED), sorted(DECIDED - NOT_RETRIED)
    assert (added, dropped) == ([], []), (
        f"the retry rule changed: now not retried {added}, now retried {dropped}"
    )


# Our exception classes whose name is the failure type a rank (or the node) reports.
RAISED: list[type[BaseException]] = [
    CodeMissing,
    CodeCorrupt,
    UnsafeArchive,
    CompileUnavailable,
    DataPathError,
    DataLoadError,
    DataReadError,
    LoaderProcessDied,
    LoaderTimeout,
]


@pytest.mark.parametrize("cls", RAISED, ids=lambda cls: cls.__name__)
def test_an_exception_of_ours_is_judged_by_its_declared_type(cls: type[BaseException]) -> None:
    declared = Failure(cls.__name__)  # ValueError if the class were not declared in the registry
    judged = is_retryable(JobError(type=cls.__name__, message="m"))  # as a rank reports it
    assert judged is declared.retried, f"{cls.__name__}: declared retried={declared.retried}, judged {judged}"


def test_a_subclass_is_judged_by_its_own_name() -> None:
    # DataReadError is a DataLoadError (not retried) raised for an OSError: a storage hiccup, retried.
    assert issubclass(DataReadError, DataLoadError)
    assert not is_retryable(JobError(type=DataLoadError.__name__, message="m"))
    assert is_retryable(JobError(type=DataReadError.__name__, message="m"))


def test_a_declared_exception_cannot_be_renamed_away_from_its_type() -> None:
    # A renamed class would report a new, unknown type (retried): refused when its module loads.
    with pytest.raises(TypeError, match="CompileUnavailable"):

        @named(Failure.COMPILE_UNAVAILABLE)
        class CompileNotAvailable(RuntimeError):
            pass
