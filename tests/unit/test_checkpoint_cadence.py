"""When the learner's next checkpoint is due: every N versions, or every S seconds, whichever comes
first, counted from the newest snapshot (the clock is passed in: no waiting)."""

from __future__ import annotations

from policyloop.rl.checkpoint import CheckpointCadence


def test_by_versions_from_the_newest_snapshot() -> None:
    cadence = CheckpointCadence(every=3, every_s=0, version=4, at=0.0)
    assert [v for v in range(4, 12) if cadence.due(v, now=1e9)] == [7, 8, 9, 10, 11]
    cadence.taken(8, now=5.0)  # a snapshot later than due (a write was under way at 7)
    assert not cadence.due(10, now=1e9) and cadence.due(11, now=1e9)


def test_by_seconds_but_never_twice_for_one_version() -> None:
    cadence = CheckpointCadence(every=0, every_s=2.0, version=0, at=100.0)
    assert not cadence.due(5, now=101.9)
    assert cadence.due(5, now=102.0)
    cadence.taken(5, now=102.0)
    assert not cadence.due(5, now=200.0)  # nothing new to write
    assert cadence.due(6, now=104.0) and not cadence.due(6, now=103.0)


def test_whichever_comes_first_and_off_when_both_are_zero() -> None:
    both = CheckpointCadence(every=50, every_s=2.0, version=10, at=0.0)
    assert both.due(11, now=2.0) and both.due(60, now=0.5) and not both.due(59, now=0.5)
    never = CheckpointCadence(every=0, every_s=0, version=0, at=0.0)
    assert not any(never.due(v, now=1e9) for v in range(1, 100))
