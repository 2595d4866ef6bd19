"""The scrape configuration and the alert rules every deployment uses: `promtool check` accepts
them, and `promtool test rules` shows each alert firing on the state it names and staying quiet
on a healthy loop."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS = Path(str(resources.files("policyloop.telemetry").joinpath("prometheus")))
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus; "
                                                         "`make test` installs it)")

RULES = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_scrape_configuration_and_the_rules_check() -> None:
    rules = promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", "prometheus.yml", cwd=PROMETHEUS)
    assert config.returncode == 0, config.stdout + config.stderr


def fired(alert: str, labels: dict[str, str]) -> dict[str, Any]:
    """The alert as promtool expects it: its rule's labels plus the series', annotations expanded."""
    rule = next(r for r in RULES if r["alert"] == alert)
    every = {**rule.get("labels", {}), **labels}
    annotations = {key: re.sub(r"{{ \$labels\.(\w+) }}", lambda m: every.get(m.group(1), ""), text)
                   for key, text in rule.get("annotations", {}).items()}
    return {"exp_labels": every, "exp_annotations": annotations}


SERVICE = {"job": "policyloop", "instance": "rollout-0", "service": "rollout"}
BACKLOG = 'policyloop_bus_backlog_messages{stream="TRAJECTORIES", consumer="learner", kind="pending"}'
# (alert, input series for its state, when to look, the alerts expected then) — one minute of
# samples every 15 s is "4 values".
CASES = [
    ("PolicyloopServiceDown", [('up{job="policyloop", instance="rollout-0", service="rollout"}', "1 1 0x10")],
     "3m", [fired("PolicyloopServiceDown", SERVICE)]),
    ("PolicyloopServiceUnhealthy",
     [('policyloop_service_healthy{job="policyloop", instance="rollout-0", service="rollout"}', "1 0x12")],
     "3m", [fired("PolicyloopServiceUnhealthy", SERVICE)]),
    ("PolicyloopLearnerIdleWhileBacklogGrows",
     [("policyloop_learner_step_seconds_count", "0+1x8 8x24"), (BACKLOG, "0x8 1+2x24")],
     "8m", [fired("PolicyloopLearnerIdleWhileBacklogGrows", {})]),
    ("PolicyloopLagAtTheBound",
     [("policyloop_learner_samples_at_lag_bound_total", "0+30x60"), ("policyloop_version_lag_count", "0+40x60")],
     "14m", [fired("PolicyloopLagAtTheBound", {})]),
    ("PolicyloopStaleDrops", [('policyloop_learner_dropped_total{reason="stale"}', "0+2x60")],
     "14m", [fired("PolicyloopStaleDrops", {})]),
    ("PolicyloopDeadLetters",
     [('policyloop_bus_dead_lettered_total{stream="ROLLOUTS", kind="permanent"}', "0 0 1 1 1")],
     "1m", [fired("PolicyloopDeadLetters", {"stream": "ROLLOUTS", "kind": "permanent"})]),
    ("PolicyloopWeightSyncFallbacks", [("policyloop_weight_sync_fallbacks_total", "0 0 1 1")],
     "45s", [fired("PolicyloopWeightSyncFallbacks", {})]),
    ("PolicyloopWeightsQuarantined", [('policyloop_weights_quarantined_total{what="payload"}', "0 1 1")],
     "30s", [fired("PolicyloopWeightsQuarantined", {})]),
]
# A loop at work: every service up and healthy, the learner stepping and the backlog drained,
# lag below the bound, nothing dropped, dead-lettered, refused or quarantined.
HEALTHY = [
    ('up{job="policyloop", instance="rollout-0", service="rollout"}', "1x60"),
    ('policyloop_service_healthy{job="policyloop", instance="rollout-0", service="rollout"}', "1x60"),
    ("policyloop_learner_step_seconds_count", "0+1x60"),
    (BACKLOG, "3 0 2 0 4 1 0x54"),
    ("policyloop_learner_samples_at_lag_bound_total", "0+2x60"),
    ("policyloop_version_lag_count", "0+40x60"),
    ('policyloop_learner_dropped_total{reason="stale"}', "0x60"),
    ('policyloop_bus_dead_lettered_total{stream="ROLLOUTS", kind="permanent"}', "0x60"),
    ("policyloop_weight_sync_fallbacks_total", "0x60"),
    ('policyloop_weights_quarantined_total{what="payload"}', "0x60"),
]


def test_each_alert_fires_on_its_state_and_none_on_a_healthy_loop(tmp_path: Path) -> None:
    assert sorted(case[0] for case in CASES) == sorted(r["alert"] for r in RULES)  # every rule has a case
    tests = [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series],
              "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}]}
             for alert, series, at, expected in CASES]
    tests.append({"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in HEALTHY],
                  "alert_rule_test": [{"eval_time": "14m", "alertname": r["alert"], "exp_alerts": []}
                                      for r in RULES]})
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(PROMETHEUS / "alerts.yml")], "evaluation_interval": "15s",
                                    "tests": tests}))
    result = promtool("test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
