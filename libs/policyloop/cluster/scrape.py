"""Reading the loop's metrics at one instant, from Prometheus when it runs or from every
service's own /metrics otherwise: both give the same samples (name, labels, value), so what is
computed from them (`policyloop top`) does not care where they came from."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "policyloop_"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class Scrape:
    """Every policyloop sample of the cluster at time `at` (monotonic seconds)."""

    samples: list[Sample]
    at: float = field(default_factory=time.monotonic)
    source: str = ""

    def series(self, name: str, **match: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in match.items())]

    def total(self, name: str, **match: str) -> float:
        return sum(s.value for s in self.series(name, **match))

    def by(self, name: str, *labels: str, reduce: str = "sum", **match: str) -> dict[tuple[str, ...], float]:
        """Values grouped by `labels` (reduce: sum or max over the rest, e.g. over instances)."""
        out: dict[tuple[str, ...], float] = {}
        for s in self.series(name, **match):
            key = tuple(s.labels.get(label, "") for label in labels)
            out[key] = s.value + out.get(key, 0.0) if reduce == "sum" else max(s.value, out.get(key, s.value))
        return out


def parse_metrics(text: str, instance: str, service: str) -> list[Sample]:
    """One service's /metrics text as samples, labelled as Prometheus labels its targets."""
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX):
                samples.append(Sample(s.name, {"service": service, **s.labels, "instance": instance}, float(s.value)))
    return samples


@dataclass(frozen=True)
class MetricsEndpoint:
    instance: str   # rollout-0, …
    service: str
    url: str        # http://host:port/metrics


async def scrape_services(endpoints: Iterable[MetricsEndpoint], timeout_s: float = 3.0) -> Scrape:
    """Every endpoint's /metrics; an instance that does not answer contributes `up` 0 only."""
    endpoints = list(endpoints)

    async def one(session: aiohttp.ClientSession, endpoint: MetricsEndpoint) -> list[Sample]:
        up = Sample("up", {"service": endpoint.service, "instance": endpoint.instance}, 0.0)
        try:
            async with session.get(endpoint.url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    return [up]
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return [up]
        return [Sample("up", up.labels, 1.0), *parse_metrics(text, endpoint.instance, endpoint.service)]

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session, e) for e in endpoints))
    return Scrape([s for result in results for s in result], source="services' /metrics")


def scrape_prometheus(url: str, timeout_s: float = 5.0) -> Scrape:
    """The newest value of every policyloop series (and `up`) Prometheus holds."""
    query = urllib.parse.quote(f'{{__name__=~"{PREFIX}.*|up", job="policyloop"}}')
    with urllib.request.urlopen(f"{url}/api/v1/query?query={query}", timeout=timeout_s) as response:
        body = json.loads(response.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus at {url}: {body.get('error', body)}")
    samples = []
    for result in body["data"]["result"]:
        labels = dict(result["metric"])
        name = labels.pop("__name__")
        labels.pop("job", None)
        samples.append(Sample(name, labels, float(result["value"][1])))
    return Scrape(samples, source=f"Prometheus {url}")
