"""The chaos harness's kill schedule (the harness runs at a small size in
tests/integration/test_perf_smoke.py; its figures are measured by hand at full size)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from chaos import CLUSTER_KINDS, KINDS, META_LEADER, TRAJECTORIES_LEADER, kill_schedule  # noqa: E402


@pytest.mark.parametrize("seed", range(20))
def test_a_cluster_schedule_always_kills_both_leaders(seed: int) -> None:
    schedule = kill_schedule(3, random.Random(seed), CLUSTER_KINDS, (META_LEADER, TRAJECTORIES_LEADER))
    assert len(schedule) == 3 and {META_LEADER, TRAJECTORIES_LEADER} <= set(schedule)
    full = kill_schedule(12, random.Random(seed), CLUSTER_KINDS, (META_LEADER, TRAJECTORIES_LEADER))
    assert set(full[:len(CLUSTER_KINDS)]) == set(CLUSTER_KINDS)  # every kind once, then at random


def test_the_single_server_schedule_is_unchanged() -> None:
    schedule = kill_schedule(10, random.Random(0))
    assert set(schedule[:len(KINDS)]) == set(KINDS) and "nats-server" in schedule
    assert not any(kind.startswith("nats:") for kind in schedule)
    # The same seed gives the same schedule as before the cluster kinds existed.
    first = list(KINDS)
    rng = random.Random(0)
    rng.shuffle(first)
    assert schedule[:len(KINDS)] == first
