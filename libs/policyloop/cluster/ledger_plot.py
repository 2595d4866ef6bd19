"""The operational ledger over a whole run, as one figure: the time series Prometheus kept of the
figures docs/metrics.md defines (tokens per second, learner steps, backlogs, version lag, KL and
entropy, reward, publish latency, drops and dead letters), read back with range queries."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

# (panel title, [(legend, PromQL)]) — rates over 30 s: Prometheus scrapes every 5 s.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("tokens per second", [
        ("generated", "sum(rate(policyloop_generated_tokens_total[30s]))"),
        ("trained", "sum(rate(policyloop_learner_tokens_total[30s]))")]),
    ("learner steps per second", [("steps", "sum(rate(policyloop_learner_step_seconds_count[30s]))")]),
    ("backlog (pending messages)", [
        ("{stream}", 'sum by (stream) (max by (stream, consumer) (policyloop_bus_backlog_messages{kind="pending"}))')]),
    ("version lag", [
        ("median", "histogram_quantile(0.5, sum by (le) (rate(policyloop_version_lag_bucket[30s])))"),
        ("max", "histogram_quantile(1, sum by (le) (rate(policyloop_version_lag_bucket[30s])))")]),
    ("KL and entropy of the last step", [
        ("KL to behaviour", 'max(policyloop_learner_step_stat{stat="kl_behaviour"})'),
        ("entropy", 'max(policyloop_learner_step_stat{stat="entropy"})')]),
    ("mean reward", [
        ("{environment}", "sum by (environment) (delta(policyloop_reward_points[30s])) / "
                          "sum by (environment) (increase(policyloop_reward_count[30s]))")]),
    ("publish latency (s)", [
        ("push p50", 'histogram_quantile(0.5, sum by (le) (rate(policyloop_weight_sync_seconds_bucket{phase="push"}'
                     '[1m])))'),
        ("step end → serving p99", "histogram_quantile(0.99, sum by (le) "
                                   "(rate(policyloop_weights_step_to_serving_seconds_bucket[1m])))")]),
    ("dropped and dead-lettered per second", [
        ("dropped {reason}", "sum by (reason) (rate(policyloop_learner_dropped_total[1m]))"),
        ("dead letters {stream}", "sum by (stream) (rate(policyloop_bus_dead_lettered_total[1m]))")]),
]


def query_range(url: str, query: str, start: float, end: float, step_s: float
                ) -> list[tuple[dict[str, str], list[float], list[float]]]:
    """Each series of `query` over [start, end]: its labels, times (s since start) and values."""
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.loads(response.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {query!r}: {body.get('error')}")
    series = []
    for result in body["data"]["result"]:
        points = [(float(t) - start, float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if points:
            series.append((result["metric"], [p[0] for p in points], [p[1] for p in points]))
    return series


def write_ledger_plot(url: str, start: float, end: float, path: Path) -> int:
    """Writes the figure; returns how many panels had data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step_s = max(5.0, (end - start) / 300)
    fig, axes = plt.subplots(4, 2, figsize=(12, 12), sharex=True)
    with_data = 0
    for ax, (title, queries) in zip(axes.flat, PANELS, strict=True):
        drawn = 0
        for legend, query in queries:
            for labels, times, values in query_range(url, query, start, end, step_s):
                ax.plot(times, values, label=legend.format_map(_Missing(labels)))
                drawn += 1
        with_data += drawn > 0
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the cluster started")
    fig.suptitle("policyloop: the operational ledger of the run (from Prometheus)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return with_data


class _Missing(dict):  # type: ignore[type-arg]
    """Labels for a legend template; a label the series lacks reads as empty."""

    def __missing__(self, key: str) -> str:
        return ""
