"""The step profile's figures from two scrapes of a cluster (the whole harness runs at a small
size in tests/integration/test_perf_smoke.py, marked slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from step_profile import children_by_parent, cpu_per_step, cpu_seconds, profile  # noqa: E402

from policyloop.cluster.scrape import Sample, Scrape  # noqa: E402


def scrape(steps: float, phases: dict[str, float], versions: float, loads: dict[str, float],
           overlapped: dict[str, float] | None = None) -> Scrape:
    learner = {"instance": "learner-0", "service": "learner"}
    return Scrape([
        Sample("policyloop_learner_step_seconds_count", learner, steps),
        *(Sample("policyloop_learner_phase_seconds_total", {**learner, "phase": p, "path": "step"}, v)
          for p, v in phases.items()),
        *(Sample("policyloop_learner_phase_seconds_total", {**learner, "phase": p, "path": "overlap"}, v)
          for p, v in (overlapped or {}).items()),
        Sample("policyloop_weight_sync_seconds_count", {"instance": "rollout-0", "phase": "fetch"}, versions),
        *(Sample("policyloop_rollout_version_phase_seconds_total", {"instance": "rollout-0", "phase": p}, v)
          for p, v in loads.items()),
    ])


def test_per_step_and_per_version_means_over_the_window() -> None:
    before = scrape(10, {"wait_for_batch": 5.0, "forward": 2.0, "push": 1.0}, 10, {"fetch": 1.0, "load": 2.0})
    after = scrape(30, {"wait_for_batch": 7.0, "forward": 8.0, "push": 3.0}, 30, {"fetch": 3.0, "load": 6.0})
    figures = profile(before, after, seconds=20.0)
    learner = figures["learner"]
    assert learner["steps"] == 20 and learner["steps_per_s"] == 1.0
    # Phases in the order a step runs them, in ms per step; they add up to the step.
    assert learner["per_step_ms"] == {"wait_for_batch": 100.0, "forward": 300.0, "push": 100.0}
    assert list(learner["per_step_ms"]) == ["wait_for_batch", "forward", "push"] and learner["step_ms"] == 500.0
    assert learner["busy_fraction"] == 0.9  # 2 s of 20 waiting for a batch
    assert learner["overlapped_ms"] == 0.0 and learner["per_step_overlapped_ms"] == {}
    assert figures["rollout"] == {"versions": 20, "version_ms": 300.0,
                                  "per_version_ms": {"fetch": 100.0, "load": 200.0}}


def test_a_publication_alongside_the_next_step_is_apart_from_the_steps_own_phases() -> None:
    before = scrape(10, {"forward": 2.0, "publish_wait": 0.0}, 10, {}, overlapped={"encode": 1.0, "push": 1.0})
    after = scrape(20, {"forward": 4.0, "publish_wait": 0.5}, 20, {}, overlapped={"encode": 1.5, "push": 2.0})
    learner = profile(before, after, seconds=10.0)["learner"]
    assert learner["per_step_ms"] == {"forward": 200.0, "publish_wait": 50.0} and learner["step_ms"] == 250.0
    assert learner["per_step_overlapped_ms"] == {"encode": 50.0, "push": 100.0} and learner["overlapped_ms"] == 150.0


def test_a_window_without_steps_reports_none() -> None:
    same = scrape(10, {"forward": 2.0}, 3, {"fetch": 1.0})
    figures = profile(same, same, seconds=5.0)
    assert figures["learner"]["steps"] == 0 and figures["learner"]["per_step_ms"] == {}
    assert figures["rollout"]["per_version_ms"] == {}


def test_cpu_per_step_is_each_processs_time_over_the_steps_largest_first() -> None:
    before = {"learner-0": 10.0, "rollout-0": 4.0, "rollout-0 children": 3.0, "nats-server": 1.0}
    after = {"learner-0": 14.0, "rollout-0": 5.0, "rollout-0 children": 5.0, "nats-server": 1.0, "late-0": 2.0}
    # 10 steps: 4 s of the learner's CPU is 400 core-ms a step; idle and unpaired processes are left out.
    assert cpu_per_step(before, after, 10) == {"learner-0": 400.0, "rollout-0 children": 200.0, "rollout-0": 100.0}
    assert list(cpu_per_step(before, after, 10)) == ["learner-0", "rollout-0 children", "rollout-0"]
    assert cpu_per_step(before, after, 0) == {}


def test_a_processs_cpu_time_and_its_children_are_read_from_proc() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                             "while time.process_time() < end: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while (cpu_seconds(busy.pid) or 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (cpu_seconds(busy.pid) or 0.0) >= 0.3  # its spin, counted
        assert busy.pid in children_by_parent()[os.getpid()]
    finally:
        busy.kill()
        busy.wait()
    assert cpu_seconds(busy.pid) is None  # gone
