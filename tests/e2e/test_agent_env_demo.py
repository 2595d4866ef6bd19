"""`policyloop demo --agent-env` end to end: the chat model on the tally desk through the real
services (the desk in a sandbox session per episode), the evaluator scoring held-out episodes at
the run's start and end; summary.json and the plot. Minutes: in the slow set; the default run
covers the same path in tests/integration/test_program_env.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import prebuilt_model


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_agent_env_demo_trains_and_evaluates_the_desk(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model = prebuilt_model(request.config, "chat")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "policyloop", "demo", "--agent-env", "--steps", "6",
                           "--model-path", str(model), "--run-dir", str(tmp_path / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "RUN_STATE_FINISHED" and summary["steps"] == 6
    assert [s for s, _ in summary["rewards"]] == sorted({s for s, _ in summary["rewards"]})
    versions = [e["version"] for e in summary["evals"]]
    assert versions[0] == 0 and versions[-1] == 6  # the run's start and end, scored by the evaluator
    assert all(e["low"] <= e["pass_rate"] <= e["high"] for e in summary["evals"])
    assert (out / "agent_env.png").stat().st_size > 1000
