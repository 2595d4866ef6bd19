"""`policyloop top`'s figures from two scrapes: rates, the lag histogram, reward per environment and
latency quantiles as Prometheus computes them; a restarted process's counters count from zero."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from policyloop.cluster.scrape import Sample, Scrape, parse_metrics
from policyloop.cluster.top import Ledger, histogram_quantile, render


def test_quantiles_interpolate_inside_the_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 2.0}) == 1.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


def scrape(at: float, **values: float) -> Scrape:
    samples = [Sample("up", {"instance": "learner-0", "service": "learner"}, 1.0),
               Sample("policyloop_service_healthy", {"instance": "learner-0", "service": "learner"}, 1.0),
               Sample("policyloop_policy_version", {"instance": "learner-0", "service": "learner"}, values["version"])]
    for instance, tokens in (("rollout-0", values["gen0"]), ("rollout-1", values["gen1"])):
        samples.append(Sample("policyloop_generated_tokens_total", {"instance": instance, "environment": "a@1"},
                              tokens))
    for le, count in (("0.0", values["lag0"]), ("1.0", values["lag0"] + values["lag1"]),
                      ("+Inf", values["lag0"] + values["lag1"])):
        samples.append(Sample("policyloop_version_lag_bucket", {"le": le}, count))
    samples += [Sample("policyloop_learner_step_seconds_count", {}, values["steps"]),
                Sample("policyloop_reward_count", {"environment": "a@1"}, values["rewards"]),
                Sample("policyloop_reward_points", {"environment": "a@1"}, values["reward_sum"]),
                Sample("policyloop_bus_backlog_messages",
                       {"stream": "TASKS", "consumer": "rollout", "kind": "pending", "instance": "rollout-0"},
                       values["backlog"]),
                Sample("policyloop_learner_dropped_total", {"reason": "stale"}, values["stale"])]
    return Scrape(samples, at=at, source="test")


def test_rates_and_distributions_cover_what_the_counters_gained_between_two_scrapes() -> None:
    before = scrape(100.0, version=3, gen0=1000, gen1=500, lag0=10, lag1=2, steps=3, rewards=16, reward_sum=4,
                    backlog=40, stale=1)
    after = scrape(110.0, version=5, gen0=1600, gen1=100, lag0=14, lag1=6, steps=5, rewards=32, reward_sum=12,
                   backlog=20, stale=1)  # rollout-1 restarted: its counter starts again at 0
    ledger = Ledger.between(before, after)
    assert ledger.seconds == 10
    assert ledger.services == [("learner-0", "learner", True, True, 5)]
    assert ledger.generated_per_s == pytest.approx((600 + 100) / 10)
    assert ledger.steps == 5 and ledger.steps_per_s == pytest.approx(0.2)
    assert ledger.lag_histogram == {0: 4, 1: 4}
    assert ledger.reward["a@1"][:2] == (16, pytest.approx(0.5))
    assert ledger.backlogs[("TASKS", "rollout")] == (20, pytest.approx(-2.0))
    assert ledger.dropped == {}  # no stale drop in this interval
    first = Ledger.between(None, before)  # one scrape: the totals since start
    assert first.lag_histogram == {0: 10, 1: 2} and first.dropped == {"stale": 1}
    text = Console(width=120, record=True)
    text.print(render(ledger))
    screen = text.export_text()
    assert "learner-0" in screen and "TASKS" in screen and "a@1" in screen and "70.0" in screen


def test_a_service_metrics_page_becomes_labelled_samples() -> None:
    page = ("# TYPE policyloop_reward histogram\n"
            'policyloop_reward_bucket{environment="a@1",le="0.5"} 3.0\n'
            'policyloop_reward_bucket{environment="a@1",le="+Inf"} 4.0\n'
            'policyloop_reward_count{environment="a@1"} 4.0\n'
            'policyloop_reward_sum{environment="a@1"} 2.5\n'
            "# TYPE python_gc_objects_collected counter\n"
            "python_gc_objects_collected_total 12.0\n")
    samples = parse_metrics(page, "reward-0", "reward")
    assert {s.name for s in samples} == {"policyloop_reward_bucket", "policyloop_reward_count", "policyloop_reward_sum"}
    assert all(s.labels["instance"] == "reward-0" and s.labels["service"] == "reward" for s in samples)


def test_the_window_compares_with_the_oldest_scrape_within_it() -> None:
    from policyloop.cluster.top import LedgerWindow

    def at(t: float, steps: float) -> Scrape:
        return Scrape([Sample("policyloop_learner_step_seconds_count", {}, steps)], at=t, source="test")

    window = LedgerWindow(seconds=10)
    assert window.add(at(0, 0)).seconds == 0  # alone: the totals since start
    assert window.add(at(4, 4)).steps_per_s == pytest.approx(1.0)  # against t=0
    assert window.add(at(8, 16)).steps_per_s == pytest.approx(2.0)  # still against t=0
    ledger = window.add(at(14, 22))  # t=4 is now 10 s old: t=0 drops out
    assert (ledger.seconds, ledger.steps_per_s) == (10, pytest.approx(1.8))
