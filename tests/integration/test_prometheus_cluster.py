"""Prometheus beside a local cluster: it scrapes every service instance through the discovery
file the cluster writes, follows a scale up and down, and runs the alert rules."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policyloop.cluster.catalogue import SERVICES
from policyloop.cluster.local import LocalCluster
from policyloop.cluster.prometheus import prometheus_binary

pytestmark = pytest.mark.skipif(prometheus_binary() is None, reason="prometheus is not installed (Debian package "
                                                                     "prometheus; `make test` installs it)")


def api(url: str, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


def scraped_up(url: str) -> dict[str, float]:
    """Instance → value of `up` (1: its last scrape worked)."""
    return {r["metric"]["instance"]: float(r["value"][1])
            for r in api(url, "query", query='up{job="policyloop"}')["result"]}


def test_prometheus_scrapes_every_instance_and_follows_a_scale(tmp_path: Path, tiny_model_dir: Path) -> None:
    light = tuple(e for e in SERVICES if e.name in ("gateway", "reward"))
    cluster = LocalCluster(tmp_path / "run", services=light, prometheus=True,
                           extra_env={"POLICYLOOP_MODEL_PATH": str(tiny_model_dir)})
    info = cluster.start()
    try:
        url = info.prometheus_url
        assert url and json.loads((tmp_path / "run" / "cluster.json").read_text())["prometheus_url"] == url
        wait_until(lambda: scraped_up(url) == {"gateway-0": 1.0, "reward-0": 1.0}, "both instances scraped")
        healthy = api(url, "query", query="policyloop_service_healthy")["result"]
        assert {(r["metric"]["service"], r["metric"]["instance"]) for r in healthy} == {
            ("gateway", "gateway-0"), ("reward", "reward-0")}
        # The reward replica keeps its consumer's backlog current, without anyone asking.
        wait_until(lambda: bool(api(url, "query", query='policyloop_bus_backlog_messages{consumer="reward"}')
                                ["result"]), "the reward consumer's backlog scraped")
        rules = [rule["name"] for group in api(url, "rules")["groups"] for rule in group["rules"]]
        assert "PolicyloopServiceDown" in rules and "PolicyloopDeadLetters" in rules

        cluster.scale("reward", 2)
        wait_until(lambda: scraped_up(url).get("reward-1") == 1.0, "the new replica scraped")

        cluster.scale("reward", 1)

        def gone() -> bool:
            active = api(url, "targets", state="active")["activeTargets"]
            return {t["labels"]["instance"] for t in active} == {"gateway-0", "reward-0"}

        wait_until(gone, "the stopped replica no longer a target")
    finally:
        cluster.stop()
    assert cluster.prometheus is not None and not cluster.prometheus.alive
