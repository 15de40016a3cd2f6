"""Which failures are retried: the not-retried set by name, as the wire carries it, and how it is built."""

from __future__ import annotations

from workers.attempt.end import NOT_RETRIED

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
