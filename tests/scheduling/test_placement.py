"""The placement rules on their own: order, all-or-nothing, per-user limits, no starvation, best fit."""

from __future__ import annotations

from service.scheduling.placement import Node, Pending, decide, never_fits


def _nodes(*slots: int, device: str = "cpu") -> list[Node]:
    return [Node(name=f"n{i}", device=device, slots=s, free=s) for i, s in enumerate(slots)]


def _job(job_id: str, *, nodes: int = 1, ppn: int = 1, owner: int = 1, device: str = "cpu") -> Pending:
    return Pending(job_id=job_id, owner_id=owner, device=device, nodes=nodes, processes_per_node=ppn)


def _where(decisions: list) -> dict[str, list[str] | str | None]:  # type: ignore[type-arg]
    return {d.job_id: [n.name for n in d.nodes] if d.placed else d.reason for d in decisions}


def test_two_two_node_jobs_on_three_nodes_one_runs_whole_and_the_other_waits_whole() -> None:
    got = _where(
        decide(
            [_job("a", nodes=2, ppn=2), _job("b", nodes=2, ppn=2)],
            nodes=_nodes(2, 2, 2),
            running={},
            max_running=9,
        )
    )
    assert got == {"a": ["n0", "n1"], "b": "waiting for 2 nodes with 2 free cpu slots: 1 such now"}


def test_nothing_is_held_for_a_job_that_waits() -> None:
    nodes = _nodes(2, 2, 2)
    decide([_job("a", nodes=2, ppn=2), _job("b", nodes=2, ppn=2)], nodes=nodes, running={}, max_running=9)
    assert [n.free for n in nodes] == [0, 0, 2], "the waiting job took no part of what it needs"


def test_a_busy_cluster_makes_later_jobs_of_that_device_wait_behind_the_first() -> None:
    nodes = _nodes(2, 2)
    nodes[0].free = 0
    got = _where(decide([_job("big", nodes=2), _job("small")], nodes=nodes, running={}, max_running=9))
    assert got == {
        "big": "waiting for 2 nodes with 1 free cpu slot: 1 such now",
        "small": "waiting for 1 node with 1 free cpu slot: behind earlier cpu jobs",
    }, "a stream of small jobs must not starve a large one"


def test_a_job_larger_than_the_cluster_blocks_nobody() -> None:
    got = _where(
        decide([_job("huge", nodes=4), _job("small")], nodes=_nodes(1, 1, 1), running={}, max_running=9)
    )
    assert got == {
        "huge": "no live node can hold this job: it needs 4 nodes with 1 free cpu slot; "
        "3 live cpu nodes, 3 of them with 1 slot",
        "small": ["n0"],
    }


def test_other_devices_are_not_held_up() -> None:
    nodes = _nodes(1) + [Node(name="g0", device="cuda", slots=8, free=8)]
    nodes[0].free = 0
    got = _where(
        decide([_job("cpu"), _job("gpu", device="cuda", ppn=8)], nodes=nodes, running={}, max_running=9)
    )
    assert got == {"cpu": "waiting for 1 node with 1 free cpu slot: 0 such now", "gpu": ["g0"]}


def test_the_owner_limit_holds_back_only_that_owner() -> None:
    pending = [_job("a1", owner=1), _job("a2", owner=1), _job("b1", owner=2)]
    running = {1: 1}
    got = _where(decide(pending, nodes=_nodes(4), running=running, max_running=2))
    assert got == {"a1": ["n0"], "a2": "waiting: its owner has 2 jobs running, the limit is 2", "b1": ["n0"]}
    assert running == {1: 2, 2: 1}


def test_best_fit_keeps_the_large_node_for_the_large_job() -> None:
    got = _where(
        decide([_job("small", ppn=2), _job("large", ppn=4)], nodes=_nodes(4, 2), running={}, max_running=9)
    )
    assert got == {"small": ["n1"], "large": ["n0"]}


def test_every_node_of_a_job_needs_the_slots_per_node() -> None:
    got = _where(decide([_job("wide", nodes=2, ppn=3)], nodes=_nodes(4, 2, 3), running={}, max_running=9))
    assert got == {"wide": ["n2", "n0"]}, "n1 has too few slots; best fit orders by free slots"


class TestNeverFits:
    """The rule the submit answer and every round share: could any set of these nodes ever hold it."""

    def test_a_job_that_fits_the_nodes_busy_or_not_says_nothing(self) -> None:
        nodes = _nodes(4, 2)
        nodes[0].free = nodes[1].free = 0
        assert never_fits(_job("fits", nodes=2, ppn=2), nodes) is None, "busy nodes can still hold it later"

    def test_no_live_node_of_its_kind(self) -> None:
        got = never_fits(_job("lonely", ppn=2), _nodes(8, device="cuda"))
        assert (
            got == "no live node can hold this job: it needs 1 node with 2 free cpu slots; no live cpu node"
        )

    def test_every_node_too_small_names_the_largest(self) -> None:
        got = never_fits(_job("wide", ppn=3), _nodes(2, 1))
        assert got == (
            "no live node can hold this job: it needs 1 node with 3 free cpu slots; "
            "2 live cpu nodes, the largest with 2 slots"
        )

    def test_too_few_nodes_large_enough_counts_them(self) -> None:
        got = never_fits(_job("gang", nodes=3, ppn=2), _nodes(2, 4, 1))
        assert got == (
            "no live node can hold this job: it needs 3 nodes with 2 free cpu slots; "
            "3 live cpu nodes, 2 of them with 2 slots"
        )

    def test_placement_flags_it_and_says_it_before_the_owner_limit(self) -> None:
        [d] = decide([_job("big", ppn=3)], nodes=_nodes(2), running={1: 5}, max_running=1)
        assert (d.placed, d.unplaceable) == (False, True)
        assert d.reason == never_fits(_job("big", ppn=3), _nodes(2)), (
            "a job no node can hold says so, not that its owner's other jobs run"
        )

    def test_a_job_that_only_waits_is_not_flagged(self) -> None:
        nodes = _nodes(2)
        nodes[0].free = 0
        [d] = decide([_job("later", ppn=2)], nodes=nodes, running={}, max_running=9)
        assert (d.placed, d.unplaceable, d.reason) == (
            False,
            False,
            "waiting for 1 node with 2 free cpu slots: 0 such now",
        )
