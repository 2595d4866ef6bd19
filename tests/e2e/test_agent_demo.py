"""`policyloop demo --agent` end to end, through the real services: the chat model served as an
Agents SDK agent, measured on held-out questions through the endpoint, scripted agent traffic
with feedback, SFT on the rewarded sessions through the learner, the promoted version served and
measured again. Slow (minutes): tests/integration/test_agents.py drives the same parts (the
demo's agent runs, measures, feedback and the sessions' environment) in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAFFIC = 128


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_agent_demo_learns_from_its_sessions_and_serves_the_promoted_version(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "policyloop", "demo", "--agent", "--run-dir", str(tmp_path / "run"), "--out", str(out),
         "--traffic", str(TRAFFIC), "--no-prometheus"],
        capture_output=True, text=True, timeout=1100,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after, usage = summary["before"], summary["after"], summary["traffic"]
    assert before["version"] == 0 and after["version"] == summary["promoted"] == summary["versions"][1] > 0
    assert before["sessions"] == after["sessions"] == summary["config"]["heldout"]
    assert usage["sessions"] == summary["feedback"] == TRAFFIC
    # The rewarded sessions are the environment's tasks; every demonstration fed is trained.
    assert 0 < summary["sessions_kept"] <= usage["right_answers"]
    per_step = summary["config"]["groups_per_step"]
    fed = summary["config"]["sft_epochs"] * summary["sessions_kept"]
    assert summary["demonstrations_trained"] == -(-fed // per_step) * per_step
    for measure in (before, after):
        assert measure["validity_interval"][0] <= measure["validity"] <= measure["validity_interval"][1]
        assert measure["right_answers"] <= measure["valid_calls"] <= measure["sessions"]
    assert (out / "agent.png").stat().st_size > 10_000
