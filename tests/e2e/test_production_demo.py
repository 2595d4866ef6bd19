"""`policyloop demo --production` end to end, through the real services: the evaluator scores
versions while the learner trains, promotes by rule to a serving replica, the scripted client's
traffic and feedback become traces, the traces SFT data a run trains on, then an RL environment a further run trains on.
Slow (minutes): tests/integration/test_evaluation.py covers the same parts in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAFFIC = 32


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_production_demo_trains_promotes_serves_and_learns_from_its_traces(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "policyloop", "demo", "--production", "--run-dir", str(tmp_path / "run"),
         "--out", str(out), "--budget-s", "120", "--traces-budget-s", "60", "--traffic", str(TRAFFIC),
         "--every-versions", "10", "--no-prometheus"],
        capture_output=True, text=True, timeout=1100,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    trained = [e for e in summary["evals"] if e["run_id"] == "production"]
    from_traces = [e for e in summary["evals"] if e["run_id"] == "from-traces"]
    assert len(trained) >= 2 and from_traces, summary["evals"]
    # Every 10th version, besides each run's baseline (the version it started from, its first result).
    baselines = {run: min(e["version"] for e in summary["evals"] if e["run_id"] == run) for run in
                 {e["run_id"] for e in summary["evals"]}}
    assert all((e["version"] % 10 == 0 or e["version"] == baselines[e["run_id"]])
               and e["low"] <= e["pass_rate"] <= e["high"] for e in summary["evals"])
    assert summary["promotions"] and summary["served_version"] >= summary["promotions"][0]["version"]
    assert summary["traffic"] == summary["feedback"] == TRAFFIC and summary["traces_tasks"] > 0
    # SFT on the traces before RL on them: every demonstration trained, as versions of the policy.
    per_step = summary["config"]["groups_per_step"]  # full batches: every demonstration fed is trained
    assert summary["sft_demonstrations"] == -(-2 * summary["traces_tasks"] // per_step) * per_step
    assert summary["sft_versions"][1] > summary["sft_versions"][0]
    assert (out / "production.png").stat().st_size > 10_000
