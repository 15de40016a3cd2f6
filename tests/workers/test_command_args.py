"""`$(NAME)` in a command's arguments: the Kubernetes rules, as a pure function of the rank's environment."""

from __future__ import annotations

import pytest

from workers.command.args import expand, expand_command

ENV = {"DPTRAIN_DATA_ROOT": "/data", "RANK": "1", "NESTED": "$(RANK)", "EMPTY": ""}


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("--dataset=$(DPTRAIN_DATA_ROOT)/shakespeare_char", "--dataset=/data/shakespeare_char"),
        ("$(RANK)$(RANK)", "11"),  # adjacent references
        ("$(DPTRAIN_DATA_ROOT)/$(RANK)", "/data/1"),
        ("$$(RANK)", "$(RANK)"),  # the escape: a literal reference
        ("$$$(RANK)", "$1"),  # an escaped `$`, then a reference
        ("cost$$", "cost$"),  # `$$` is one `$` anywhere
        ("$(UNSET)/x", "$(UNSET)/x"),  # unset: as written
        ("$(NESTED)", "$(RANK)"),  # a value is never expanded again
        ("$(EMPTY)x", "x"),  # set but empty is still set
        ("$RANK ${RANK} $", "$RANK ${RANK} $"),  # a shell's syntax is not ours: no shell runs
        ("$(RANK", "$(RANK"),  # unclosed
        ("$()", "$()"),
        ("plain", "plain"),
    ],
)
def test_references_expand_from_the_environment_as_kubernetes_does(arg: str, expanded: str) -> None:
    assert expand(arg, ENV) == expanded


def test_every_argument_is_expanded_on_its_own() -> None:
    cmd = ["python", "train.py", "--out=$(RANK)", "$$(RANK)"]
    assert expand_command(cmd, ENV) == ["python", "train.py", "--out=1", "$(RANK)"]
    assert cmd[2] == "--out=$(RANK)", "the spec's list is not changed"
