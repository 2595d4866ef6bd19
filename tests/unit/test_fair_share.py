"""The learner's choice of the next run (policyloop.learner.fair)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyloop.learner.fair import FairShare


def share(**weights: float) -> FairShare:
    fair = FairShare()
    for run_id, weight in weights.items():
        fair.add(run_id, weight)
    return fair


def test_equal_runs_that_are_always_ready_take_turns() -> None:
    fair = share(a=1, b=1, c=1)
    picks = [fair.pick(["a", "b", "c"]) for _ in range(9)]
    assert picks == ["a", "b", "c"] * 3


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 30))
def test_always_ready_runs_get_steps_in_proportion_to_their_weights(wa: int, wb: int, rounds: int) -> None:
    fair = share(a=wa, b=wb)
    counts = Counter(fair.pick(["a", "b"]) for _ in range(rounds * (wa + wb)))
    assert counts["a"] == rounds * wa and counts["b"] == rounds * wb


@given(st.lists(st.sets(st.sampled_from("abcd")), min_size=1, max_size=80))
def test_only_a_ready_run_is_picked_and_none_when_none_is(readiness: list[set[str]]) -> None:
    fair = share(a=1, b=2, c=1, d=3)
    for ready in readiness:
        picked = fair.pick(sorted(ready))
        assert (picked in ready) if ready else picked is None


@given(st.lists(st.sets(st.sampled_from("bcd")), min_size=1, max_size=80))
def test_a_run_that_stays_ready_waits_at_most_one_turn_per_other_run(others: list[set[str]]) -> None:
    """With equal weights, whatever the other runs do (ready or not, coming and going), a run that
    is ready at every pick is chosen at least once in every 4 consecutive picks."""
    fair = share(a=1, b=1, c=1, d=1)
    since = 0
    for ready in others:
        since = 0 if fair.pick(["a", *sorted(ready)]) == "a" else since + 1
        assert since < 4


def test_a_run_back_from_having_no_batch_rejoins_without_a_burst() -> None:
    fair = share(a=1, b=1)
    for _ in range(10):
        assert fair.pick(["a"]) == "a"  # b is slow: a is never held up
    picks = [fair.pick(["a", "b"]) for _ in range(6)]
    assert Counter(picks) == {"a": 3, "b": 3}  # b banked nothing while it had no batch


def test_runs_join_and_leave() -> None:
    fair = share(a=1)
    assert fair.pick(["a", "x"]) == "a"  # an unknown run is ignored
    fair.add("b", 1)
    assert Counter(fair.pick(["a", "b"]) for _ in range(4)) == {"a": 2, "b": 2}
    fair.remove("a")
    assert "a" not in fair and fair.pick(["a", "b"]) == "b"
    with pytest.raises(ValueError, match="weight"):
        fair.add("c", 0)
