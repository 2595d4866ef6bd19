"""`policyloop top`: the operational ledger of a running cluster in a terminal, refreshed live.

Figures come from two consecutive scrapes (`policyloop.cluster.scrape`): levels from the newer
one (health, versions, backlogs, the last step's KL and entropy), rates and distributions from
what the counters and histograms gained between the two (tokens per second, the lag histogram,
reward per environment, publish latency quantiles, drops and dead letters); before there are two,
the totals since the services started.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table
from rich.text import Text

from policyloop.cluster.local import REWARD_MODEL
from policyloop.cluster.scrape import Scrape


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' estimate of quantile `q` from cumulative bucket counts (upper bound → count),
    interpolating linearly inside the bucket; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound, as Prometheus answers
            inside = count - below
            return bound if inside <= 0 else lower + (bound - lower) * (rank - below) / inside
        lower, below = bound, count
    return lower


def _gained(current: Scrape, previous: Scrape | None, name: str, *labels: str, **match: str
            ) -> dict[tuple[str, ...], float]:
    """What a counter (or histogram series) grew by between the scrapes, grouped by `labels`.
    Each series is compared with itself: one that went down (its process restarted) counts from
    zero, as Prometheus' increase() does."""
    before = {} if previous is None else {
        frozenset(s.labels.items()): s.value for s in previous.series(name, **match)}
    out: dict[tuple[str, ...], float] = {}
    for s in current.series(name, **match):
        earlier = before.get(frozenset(s.labels.items()), 0.0)
        key = tuple(s.labels.get(label, "") for label in labels)
        out[key] = out.get(key, 0.0) + (s.value - earlier if s.value >= earlier else s.value)
    return out


def _buckets(current: Scrape, previous: Scrape | None, name: str, *labels: str, **match: str
             ) -> dict[tuple[str, ...], dict[float, float]]:
    """Per group of `labels`, the histogram's cumulative buckets gained between the scrapes."""
    out: dict[tuple[str, ...], dict[float, float]] = {}
    for key, value in _gained(current, previous, f"{name}_bucket", *labels, "le", **match).items():
        out.setdefault(key[:-1], {})[float(key[-1])] = value
    return out


@dataclass
class Ledger:
    """The figures `top` shows, for the interval between two scrapes (`seconds`)."""

    seconds: float
    source: str
    services: list[tuple[str, str, bool, bool | None, int]] = field(default_factory=list)  # instance, service,
    # up, healthy (None: no health of its own, as a reward model's engine), version
    backlogs: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (stream, consumer):
    # (pending, change per second)
    generated_per_s: float = 0.0
    trained_per_s: float = 0.0
    steps_per_s: float = 0.0
    steps: int = 0
    lag_histogram: dict[int, float] = field(default_factory=dict)
    kl: float | None = None
    entropy: float | None = None
    reward: dict[str, tuple[float, float | None, float | None, float | None]] = field(default_factory=dict)
    # environment: (samples, mean, p10, p90)
    publish_p50: float | None = None
    publish_p99: float | None = None
    push_p50: float | None = None
    dropped: dict[str, float] = field(default_factory=dict)
    dead_letters: dict[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def between(cls, previous: Scrape | None, current: Scrape) -> Ledger:
        seconds = current.at - previous.at if previous is not None else 0.0
        ledger = cls(seconds=seconds, source=current.source)
        ledger._levels(previous, current)
        ledger._rates(previous, current)
        ledger._distributions(previous, current)
        return ledger

    def _levels(self, previous: Scrape | None, current: Scrape) -> None:
        up = current.by("up", "instance", "service", reduce="max")
        healthy = current.by("policyloop_service_healthy", "instance", reduce="max")
        version = current.by("policyloop_policy_version", "instance", reduce="max")
        self.services = sorted((instance, service, value == 1, _healthy(healthy, instance, service, value == 1),
                                int(version.get((instance,), 0))) for (instance, service), value in up.items())
        pending = current.by("policyloop_bus_backlog_messages", "stream", "consumer", reduce="max", kind="pending")
        before = previous.by("policyloop_bus_backlog_messages", "stream", "consumer", reduce="max",
                             kind="pending") if previous is not None else {}
        self.backlogs = {key: (value, (value - before[key]) / self.seconds if key in before and self.seconds else 0.0)
                         for key, value in pending.items()}  # type: ignore[misc]
        stats = current.by("policyloop_learner_step_stat", "stat", reduce="max")
        self.kl = stats.get(("kl_behaviour",))
        self.entropy = stats.get(("entropy",))
        self.steps = int(current.total("policyloop_learner_step_seconds_count"))

    def _rates(self, previous: Scrape | None, current: Scrape) -> None:
        def per_s(name: str) -> float:
            gained = sum(_gained(current, previous, name).values())
            return gained / self.seconds if self.seconds else 0.0

        self.generated_per_s = per_s("policyloop_generated_tokens_total")
        self.trained_per_s = per_s("policyloop_learner_tokens_total")
        self.steps_per_s = per_s("policyloop_learner_step_seconds_count")
        self.dropped = {reason: n for (reason,), n in
                        _gained(current, previous, "policyloop_learner_dropped_total", "reason").items() if n}
        self.dead_letters = {key: n for key, n in _gained(current, previous, "policyloop_bus_dead_lettered_total",
                                                          "stream", "kind").items() if n}  # type: ignore[misc]

    def _distributions(self, previous: Scrape | None, current: Scrape) -> None:
        lag = _buckets(current, previous, "policyloop_version_lag").get((), {})
        finite = sorted(b for b in lag if not math.isinf(b))
        below = 0.0
        for bound in finite:  # observations are whole versions: bucket `le=b` holds lag b and below
            self.lag_histogram[int(bound)] = lag[bound] - below
            below = lag[bound]
        self.lag_histogram = {k: v for k, v in self.lag_histogram.items() if v}
        counts = _gained(current, previous, "policyloop_reward_count", "environment")
        sums = current.by("policyloop_reward_points", "environment")  # a gauge: rewards may be negative
        if previous is not None:
            before = previous.by("policyloop_reward_points", "environment")
            sums = {key: value - before.get(key, 0.0) for key, value in sums.items()}
        buckets = _buckets(current, previous, "policyloop_reward", "environment")
        for (environment,), n in counts.items():
            mean = sums.get((environment,), 0.0) / n if n else None
            edges = buckets.get((environment,), {})
            self.reward[environment] = (n, mean, histogram_quantile(0.1, edges), histogram_quantile(0.9, edges))
        serving = _buckets(current, previous, "policyloop_weights_step_to_serving_seconds").get((), {})
        self.publish_p50, self.publish_p99 = histogram_quantile(0.5, serving), histogram_quantile(0.99, serving)
        push = _buckets(current, previous, "policyloop_weight_sync_seconds", "phase")
        self.push_p50 = histogram_quantile(0.5, push.get(("push",), {}))


class LedgerWindow:
    """The scrapes of about the last `seconds`: each new one is compared with the oldest kept, so
    rates cover the window rather than one refresh (Prometheus itself moves every scrape interval)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.scrapes: deque[Scrape] = deque()

    def add(self, current: Scrape) -> Ledger:
        while len(self.scrapes) > 1 and current.at - self.scrapes[1].at >= self.seconds:
            self.scrapes.popleft()
        ledger = Ledger.between(self.scrapes[0] if self.scrapes else None, current)
        self.scrapes.append(current)
        return ledger


def _healthy(healthy: Mapping[tuple[str, ...], float], instance: str, service: str, up: bool) -> bool | None:
    """Whether the instance reports itself healthy; None for a process that has no such report
    (the reward model's engine: `up` is its health). A service that does not answer is unhealthy."""
    if (instance,) in healthy:
        return healthy[(instance,)] == 1
    return None if service == REWARD_MODEL and up else False


def _number(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.{digits}f}{unit}"


def render(ledger: Ledger) -> Group:
    """The ledger as rich tables, one per concern."""
    window = f"last {ledger.seconds:.0f} s" if ledger.seconds else "since start"
    services = Table(title="services", title_justify="left")
    for column in ("instance", "up", "healthy", "version"):
        services.add_column(column)
    for instance, _service, up, healthy, version in ledger.services:
        shown = "–" if healthy is None else "yes" if healthy else "[red]no[/red]"
        services.add_row(instance, "yes" if up else "[red]no[/red]", shown, str(version))
    backlogs = Table(title="backlog (pending)", title_justify="left")
    for column in ("stream", "consumer", "messages", "change/s"):
        backlogs.add_column(column)
    for (stream, consumer), (pending, change) in sorted(ledger.backlogs.items()):
        backlogs.add_row(stream, consumer, _number(pending, 0), f"{change:+.1f}")
    loop = Table(title=f"loop ({window})", title_justify="left")
    loop.add_column("figure")
    loop.add_column("value")
    rows = [
        ("learner steps", f"{ledger.steps:,} ({ledger.steps_per_s:.2f}/s)"),
        ("tokens/s generated", _number(ledger.generated_per_s)),
        ("tokens/s trained", _number(ledger.trained_per_s)),
        ("version lag", "  ".join(f"{lag}: {n:,.0f}" for lag, n in sorted(ledger.lag_histogram.items())) or "–"),
        ("KL (behaviour) / entropy", f"{_number(ledger.kl, 4)} / {_number(ledger.entropy, 3)}"),
        ("publish: push p50", _number(ledger.push_p50, 3, " s")),
        ("publish: step end → serving p50 / p99",
         f"{_number(ledger.publish_p50, 3, ' s')} / {_number(ledger.publish_p99, 3, ' s')}"),
        ("dropped", "  ".join(f"{r}: {n:,.0f}" for r, n in sorted(ledger.dropped.items())) or "0"),
        ("dead letters", "  ".join(f"{s}/{k}: {n:,.0f}" for (s, k), n in sorted(ledger.dead_letters.items())) or "0"),
    ]
    for name, value in rows:
        loop.add_row(name, value)
    reward = Table(title=f"reward by environment ({window})", title_justify="left")
    for column in ("environment", "samples", "mean", "p10", "p90"):
        reward.add_column(column)
    for environment, (n, mean, p10, p90) in sorted(ledger.reward.items()):
        reward.add_row(environment, f"{n:,.0f}", _number(mean, 3), _number(p10, 2), _number(p90, 2))
    return Group(Text(f"policyloop top — {ledger.source}", style="bold"), services, backlogs, loop, reward)
