"""The learner's figures count the samples trained at the staleness bound (the alert
PolicyloopLagAtTheBound divides them by all samples trained)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from policyloop.contracts.v1 import status_pb2
from policyloop.learner.figures import LearnerFigures
from tests.helpers import scored_group


def at_bound() -> float:
    return REGISTRY.get_sample_value("policyloop_learner_samples_at_lag_bound_total") or 0.0


def trained(max_lag: int) -> float:
    figures = LearnerFigures(status_pb2.LearnerStatus(loop=status_pb2.LoopConfig(max_lag=max_lag)))
    before = at_bound()
    # Trained at version 3: lags 0 (made by version 3), 1 and 2.
    figures.trained([*scored_group("a", version=3), *scored_group("b", version=2), *scored_group("c", version=1)], 3)
    assert dict(figures.status.lag_histogram) == {0: 2, 1: 2, 2: 2}
    return at_bound() - before


def test_samples_at_the_bound_are_counted() -> None:
    assert trained(max_lag=1) == 4  # lags 1 and 2 are at (or, dropped later, past) the bound
    assert trained(max_lag=2) == 2
    assert trained(max_lag=0) == 0  # synchronous: lag 0 is every sample's, not a sign of pressure
    assert trained(max_lag=-1) == 0  # no bound
