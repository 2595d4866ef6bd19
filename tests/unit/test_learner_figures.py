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


def test_a_steps_phases_add_up_to_its_wall_time() -> None:
    import time

    from policyloop.learner.figures import STEP_PHASES, in_order, publish_phases, trainer_phases
    from policyloop.rl.trainer import StepReport
    from policyloop.telemetry.phases import PhaseClock
    from policyloop.weights.push import PushReport

    started = time.perf_counter()
    clock = PhaseClock()
    for name in ("wait_for_batch", "trainer", "export", "hash", "ledger", "colocated", "push", "registry"):
        time.sleep(0.002)
        clock.lap(name)
    wall = time.perf_counter() - started
    report = StepReport(step=1, samples=2, groups=1, mean_reward=0.0, grad_norm=0.0, trained_tokens=4, seconds=0.0,
                        statistics={"loss": 0.0, "clip_fraction": 0.0, "kl_behaviour": 0.0},
                        phases={"pack": 0.0005, "forward": 0.0005, "backward": 0.0005, "optimizer": 0.0001})
    pushed = PushReport(version=1, kind="delta", payload_bytes=1, raw_bytes=2, changed_fraction=0.5, encode_s=0.001,
                        push_s=0.001)
    phases = in_order(trainer_phases(publish_phases(clock.seconds, pushed), report))
    assert list(phases) == [p for p in STEP_PHASES if p in phases] and "trainer" not in phases
    assert phases["encode"] == 0.001 and phases["trainer_other"] > 0
    total = sum(clock.seconds.values())
    assert abs(sum(phases.values()) - total) < 1e-9 and total <= wall
    labels = {"phase": "forward", "path": "step"}
    before = REGISTRY.get_sample_value("policyloop_learner_phase_seconds_total", labels) or 0.0
    LearnerFigures(status_pb2.LearnerStatus()).phases(phases)
    assert REGISTRY.get_sample_value("policyloop_learner_phase_seconds_total", labels) == before + 0.0005
