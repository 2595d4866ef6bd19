"""The version-lag harness's figures from heartbeat details (the whole harness runs at a small
size in tests/integration/test_perf_smoke.py; its figures are measured by hand at full size)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from version_lag import summarise  # noqa: E402

from policyloop.contracts.v1 import status_pb2  # noqa: E402


def test_summarise_computes_rates_fractions_and_idle_time() -> None:
    learner = status_pb2.LearnerStatus(
        lag_histogram={0: 60, 1: 36}, dropped=status_pb2.DroppedCounts(stale=2, duplicate=2), step=12,
        first_trajectory_at=1000.0, last_step_at=1040.0, busy_s=10.0, trained_tokens=800)
    rollouts = [status_pb2.RolloutStatus(generated_tokens=1000), status_pb2.RolloutStatus(generated_tokens=600)]
    figures = summarise(learner, rollouts, run_started_unix=990.0)
    assert figures["lag_max"] == 1 and figures["lag_histogram"] == {"0": 60, "1": 36}
    assert figures["dropped_fraction"] == {"stale": 0.02, "duplicate": 0.02}
    assert figures["dropped_fraction_total"] == 0.04
    assert figures["generated_tokens_per_s"] == 40.0 and figures["learner_tokens_per_s"] == 20.0
    assert figures["learner_idle_fraction"] == 0.75 and figures["wall_seconds"] == 50.0
    empty = summarise(status_pb2.LearnerStatus(), [], 0.0)
    assert empty["lag_max"] == 0 and empty["dropped_fraction_total"] == 0
