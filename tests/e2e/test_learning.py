"""The whole loop learns: `policyloop demo` on the bootstrap model, through the real services,
NATS and Redis, raises held-out accuracy within a short budget (the full demo's target is
+35 points in 10 minutes; here a smaller run must still show a clear gain).

Two measures, each with room for the run-to-run spread seen on this 2-core machine: greedy
accuracy on 600 held-out problems (+15.5 and +17.2 points in 120 s, about 250 learner steps;
200 problems were too few — that draw happened to be easier, 30% before, and showed +5 to +19
for the same runs' kind), and the mean train reward of the last quarter of the run against the
first (+0.09 to +0.15 in five runs). The run is a number of learner steps, not seconds, so a busy
machine makes it slower, not shorter; the budget only bounds it. The run logs to TensorBoard:
the learner's steps and the demo's evaluations are read back from its event files.

The learning run takes minutes: it is in the slow set (make test-all). The default run takes the
demo's whole path in 20 steps and checks everything it reports except the gain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.cluster.prometheus import prometheus_binary

STEPS = 240
BUDGET_S = 600
EVAL_PROBLEMS = 600
MIN_HELDOUT_GAIN = 0.08
MIN_TRAIN_REWARD_GAIN = 0.05
SHORT_STEPS = 20
SHORT_EVAL_PROBLEMS = 100


def run_demo(tmp_path: Path, steps: int, eval_problems: int, *extra: str
             ) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "policyloop", "demo", "--run-dir", str(tmp_path / "run"), "--out", str(out),
         "--steps", str(steps), "--budget-s", str(BUDGET_S), "--eval-interval-s", "60",
         "--eval-problems", str(eval_problems), "--tracker", "tensorboard", *extra],
        capture_output=True, text=True, timeout=840,
    )
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
    return result, json.loads((out / "summary.json").read_text()), out


def check_outputs(tmp_path: Path, result: subprocess.CompletedProcess[str], summary: dict, out: Path,
                  steps: int, eval_problems: int) -> None:
    """What every demo reports, whatever it learned: steps, weight sync, lag, the plot, the
    ledger (with Prometheus) and the tracker's records."""
    assert summary["eval_problems"] == eval_problems
    assert summary["steps"] >= steps and summary["generated_tokens"] > 0
    assert sum(summary["version_lag_histogram"].values()) > 0
    # Weights went as one keyframe and then deltas, verified by every replica.
    sync = summary["weight_sync"]
    assert sync["versions"] == summary["steps"] and sync["keyframes"] == 1
    assert 0 < sync["delta_bytes"] < sync["full_bytes"] and sync["full_over_sent"] > 1
    assert (out / "reward_accuracy.png").stat().st_size > 1000
    assert "held-out accuracy after RL" in result.stdout
    assert "watch the ledger live: policyloop top --run-dir" in result.stdout
    if prometheus_binary() is not None:  # the demo ran Prometheus beside its cluster: the ledger over the run
        assert (out / "ledger.png").stat().st_size > 10_000 and "ledger.png" in result.stdout
        assert "Grafana dashboard: import" in result.stdout
        panels = int(result.stdout.split("ledger over the run, ", 1)[1].split(" panels", 1)[0])
        assert panels >= 6, result.stdout[-2000:]  # drops and dead letters may have no series in a clean run
    # The tracker: every learner step, and the demo's evaluations at the versions they measured.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = (tmp_path / "run" / "tracking" / "tensorboard").iterdir()
    assert summary["tracker_run"] == run.name and f"tracker: run {run.name}" in result.stdout
    steps_seen = EventAccumulator(str(run), size_guidance={"scalars": 0})
    steps_seen.Reload()
    rewards = steps_seen.Scalars("train/mean_reward")
    assert [e.step for e in rewards] == list(range(1, len(rewards) + 1)) and len(rewards) >= summary["steps"]
    evaluations = EventAccumulator(str(run / "evaluation"), size_guidance={"scalars": 0})
    evaluations.Reload()
    assert [(e.step, e.value) for e in evaluations.Scalars("eval/heldout_accuracy")] == \
        [(e["version"], pytest.approx(e["accuracy"])) for e in summary["evaluations"]]


@pytest.mark.timeout(600)
def test_the_demo_runs_every_service_and_reports_what_it_did(tmp_path: Path) -> None:
    """The demo's whole path in a few steps (the learning itself: the slow test below)."""
    result, summary, out = run_demo(tmp_path, SHORT_STEPS, SHORT_EVAL_PROBLEMS)
    check_outputs(tmp_path, result, summary, out, SHORT_STEPS, SHORT_EVAL_PROBLEMS)


# Slow (minutes each): the default run covers the critic's step, its checkpoint and resume
# (tests/integration/test_trainer.py, test_recovery.py) and the demo's outputs (the short demo above).
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("advantages", ["group", "gae"])
def test_demo_raises_heldout_accuracy(tmp_path: Path, advantages: str) -> None:
    """GRPO's group advantages (the demo's default) and PPO's with a critic (`--advantages gae`)."""
    result, summary, out = run_demo(tmp_path, STEPS, EVAL_PROBLEMS, "--advantages", advantages)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    check_outputs(tmp_path, result, summary, out, STEPS, EVAL_PROBLEMS)
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    assert gain >= MIN_HELDOUT_GAIN, summary
    rewards = [p["mean_reward"] for p in summary["progress"] if p["step"] > 0]
    quarter = len(rewards) // 4
    assert quarter >= 5, summary["progress"]
    first, last = rewards[:quarter], rewards[-quarter:]
    assert sum(last) / quarter - sum(first) / quarter >= MIN_TRAIN_REWARD_GAIN, rewards
    if advantages == "gae":  # the critic's values came to fit the returns
        assert summary["learner_stats"]["explained_variance"] > 0, summary["learner_stats"]


# Slow (the whole cluster for minutes): the default run covers two LoRA runs through the loop
# (tests/integration/test_lora_loop.py) and each part on its own.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_trains_two_lora_runs_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "policyloop", "demo", "--run-dir", str(tmp_path / "run"), "--out", str(out),
         "--runs", "2", "--lora-rank", "16", "--budget-s", "240", "--eval-interval-s", "60",
         "--eval-problems", str(EVAL_PROBLEMS), "--no-prometheus"],
        capture_output=True, text=True, timeout=840,
    )
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 2 and len({r["run_id"] for r in runs}) == 2, summary
    for run in runs:
        assert run["steps"] > 0 and run["accuracy_after"] > run["accuracy_before"], run
        assert 0 < run["adapter_bytes_per_version"] <= run["adapter_raw_bytes"]
        assert run["evaluations"], run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (out / "reward_accuracy.png").stat().st_size > 1000
