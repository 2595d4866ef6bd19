"""Every perf/ harness runs end to end at a small size and prints the JSON it promises, so a harness
can no longer break without a test going red (those that start a whole cluster for a window of
steps in `make test-all`). Each runs as users run it (`python perf/X.py ...`),
on the tiny test model where it takes one; the figures are checked for presence and sanity, never
for speed (the figures themselves are measured by hand at full size, see docs/measurements.md).
perf/weights_bench.py has its own smoke test (test_weights_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.sandbox.runner import SandboxUnavailable, check_isolation

ROOT = Path(__file__).resolve().parents[2]
# Upper bounds for a run that takes seconds here, with room for a loaded machine: a harness that
# hangs fails instead of holding up the suite.
CLUSTER_TIMEOUT_S = 420
TIMEOUT_S = 120


def run_harness(script: str, *args: str, cwd: Path, timeout_s: float = TIMEOUT_S) -> dict:
    """Runs perf/<script> with `args` and returns the JSON it printed on stdout."""
    result = subprocess.run([sys.executable, str(ROOT / "perf" / script), *args], cwd=cwd,
                            capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


# Slow (a whole cluster, half a minute): the default run covers its figures (test_version_lag_summary)
# and the behaviour it measures (test_pacing, the learner's stale drops, the demo's lag histogram).
@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 30)
def test_version_lag_runs_one_configuration_on_the_local_cluster(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    summary = run_harness(
        "version_lag.py", "--max-lags", "1", "--replicas", "1", "--steps", "2", "--groups-per-step", "2",
        "--group-size", "4", "--eval-problems", "8", "--timeout-s", "300", "--model-path", str(tiny_model_dir),
        "--out", str(out), cwd=tmp_path, timeout_s=CLUSTER_TIMEOUT_S)
    assert set(summary) == {"configurations", "all_lag_within_bound", "all_dropped_within_2pct"}
    [config] = summary["configurations"]
    assert (config["max_lag"], config["replicas"]) == (1, 1)
    assert config["steps"] >= 2
    trained = sum(config["lag_histogram"].values())
    assert trained >= 2 * 2 * 4  # two steps of two groups of four
    assert config["lag_max"] == max(int(lag) for lag in config["lag_histogram"]) <= 1
    assert summary["all_lag_within_bound"] is True
    assert 0.0 <= config["dropped_fraction_total"] <= 1.0
    assert 0.0 <= config["learner_idle_fraction"] <= 1.0
    assert config["generated_tokens_per_s"] > 0 and config["learner_tokens_per_s"] > 0
    assert 0.0 <= config["accuracy_after"] <= 1.0 and config["accuracy_version"] >= 0
    assert config["wall_seconds"] > 0 and config["harness_seconds"] > 0
    assert json.loads((out / "result.json").read_text()) == summary
    assert (out / "version_lag.png").stat().st_size > 1000


# Slow (a whole cluster, killed twice): the default run covers kills, restarts and the ledger's
# audit in tests/integration/test_recovery.py, service by service.
@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 30)
def test_chaos_kills_restarts_and_audits_the_ledger(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    result = run_harness(
        "chaos.py", "--kills", "2", "--kinds", "publisher-0,learner-0", "--steps", "2", "--steps-after-kills", "1",
        "--min-gap-s", "0.5", "--max-gap-s", "1", "--down-s", "0.5", "--groups-per-step", "2", "--group-size", "4",
        "--ack-wait-s", "3", "--settle-s", "1", "--timeout-s", "300", "--model-path", str(tiny_model_dir),
        "--out", str(out), cwd=tmp_path, timeout_s=CLUSTER_TIMEOUT_S)
    assert result["kills"] == 2
    assert sorted(k["process"] for k in result["kill_log"]) == ["learner-0", "publisher-0"]
    assert all(k["process"] in k["restarted"] and k["at_version"] >= 0 for k in result["kill_log"])
    # The learner's restart is timed to its next step, phase by phase from its log.
    [learner] = [k for k in result["kill_log"] if k["process"] == "learner-0"]
    assert learner["time_to_next_step_s"] > 0 and set(learner["restart_phases_s"]) == {
        "service_started", "trainer_loaded", "resumed", "first_step"}
    figures = result["time_to_next_step"]
    assert (figures["learner_kills"], figures["missed"], figures["killed_again_before_step"]) == (1, 0, 0)
    assert figures["median_s"] == figures["max_s"] == learner["time_to_next_step_s"]
    assert result["reached_target_steps"] and result["steps"] >= result["target_steps"] >= 2
    # The audit: everything generated is accounted for, nothing trained twice, versions in order.
    assert result["generated"] > 0 and result["trained"] > 0
    assert result["generated"] == (result["trained"] + sum(result["dropped"].values()) + result["dead_lettered"]
                                   + result["pending"] + result["lost"])
    assert (result["lost"], result["trained_twice"], result["trained_not_generated"]) == (0, 0, 0)
    assert result["versions_monotonic"] and result["versions_agree"] and result["ok"] is True
    assert json.loads((out / "result.json").read_text()) == result


def test_bus_throughput_publishes_and_consumes(tmp_path: Path) -> None:
    result = run_harness("bus_throughput.py", "--messages", "50", "--repeats", "2", "--concurrency", "4",
                         cwd=tmp_path)
    assert (result["benchmark"], result["messages"], result["repeats"]) == ("bus_throughput", 50, 2)
    assert result["payload_bytes"] > 64  # 64 prompt token ids and the task's fields
    for figure in ("publish_acked_per_s", "consume_acked_per_s"):
        assert len(result[figure]) == 2 and all(rate > 0 for rate in result[figure])
        assert result[f"{figure}_median"] > 0


def test_engine_throughput_generates_every_token(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = run_harness("engine_throughput.py", "--model-path", str(tiny_model_dir), "--requests", "3",
                         "--max-new-tokens", "4", "--repeats", "2", cwd=tmp_path)
    assert (result["requests"], result["max_new_tokens"], result["repeats"]) == (3, 4, 2)
    assert [r["tokens"] for r in result["rounds"]] == [3 * 4, 3 * 4]  # ignore_eos: every request runs to the end
    assert result["generated_tokens_per_s_median"] > 0 and result["seconds_median"] > 0


def test_sandbox_bench_runs_jobs_and_scores(tmp_path: Path) -> None:
    try:
        check_isolation()
    except SandboxUnavailable as exc:
        pytest.skip(f"the sandbox cannot isolate jobs here: {exc}")
    result = run_harness("sandbox_bench.py", "--jobs", "2", "--prepare-s", "0.2", cwd=tmp_path)
    assert result["jobs"] == 2
    modes = [result["rlimit"]] + ([] if result["cgroup"] == "unavailable here" else [result["cgroup"]])
    for mode in modes:
        for side_by_side in ("one_at_a_time", "two_side_by_side"):
            assert mode[side_by_side]["job_wall_ms_median"] > 0 and mode[side_by_side]["jobs_per_s"] > 0
        assert mode["unit_test_scoring"]["score_wall_ms_median"] > 0
        sessions = mode["sessions"]
        assert sessions["steps_per_session"] == 50 and 0 < sessions["step_ms_median"] <= sessions["step_ms_p99"]
        assert sessions["first_answer_ms_median"] > 0 and sessions["session_wall_ms_median"] > 0
        prepared = mode["prepared_sessions"]  # run fresh, then forked from a prepared process
        assert prepared["fresh"]["session_cpu_ms_median"] > 0 and prepared["forked"]["session_wall_ms_median"] > 0


# Slow (a whole cluster): the default run checks its figures from two scrapes
# (tests/unit/test_step_profile.py) and the phases the learner exports (test_learner_figures).
@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 30)
def test_step_profile_reads_every_phase_of_a_step_and_a_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    summary = run_harness("step_profile.py", "--seconds", "8", "--warmup-steps", "2", "--groups-per-step", "2",
                          "--group-size", "4", "--model-path", str(tiny_model_dir), "--out", str(out),
                          cwd=tmp_path, timeout_s=CLUSTER_TIMEOUT_S)
    [run] = summary["runs"]
    assert run["learner"]["steps"] >= 1 and run["learner"]["steps_per_s"] > 0
    phases = run["learner"]["per_step_ms"]
    assert {"wait_for_batch", "forward", "backward", "optimizer", "export", "push"} <= set(phases)
    assert abs(sum(phases.values()) - run["learner"]["step_ms"]) < 1
    assert run["rollout"]["versions"] >= 1 and {"fetch", "load"} <= set(run["rollout"]["per_version_ms"])
    cpu = run["cpu"]["core_ms_per_step"]
    assert cpu["learner-0"] > 0 and cpu["rollout-0 children"] > 0 and cpu["nats-server"] > 0  # its engine, the bus
    assert (out / "step_profile.png").stat().st_size > 1000


# Slow (the one-process loop, then a whole cluster): the default run checks the loop
# (test_single_process) and the harness's figures (tests/unit/test_vs_single_process.py).
@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 120)
def test_vs_single_process_trains_both_sides_and_compares_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    summary = run_harness("vs_single_process.py", "--seconds", "12", "--mark-every", "6", "--eval-problems", "40",
                          "--groups-per-step", "2", "--group-size", "4", "--model-path", str(tiny_model_dir),
                          "--out", str(out), cwd=tmp_path, timeout_s=CLUSTER_TIMEOUT_S + 60)
    [run] = summary["runs"]
    for name in ("single", "cluster"):
        assert [p["seconds"] for p in run[name]["curve"]] == [0.0, 6.0, 12.0]
        assert run[name]["steps"] >= 1 and run[name]["steps_per_s"] > 0
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in run[name]["curve"])
    assert summary["median"]["steps_per_s_ratio"] > 0
    assert (out / "vs_single_process.png").stat().st_size > 1000


# Slow (two trainers on the test model): the default run covers adapter versions as deltas
# (test_adapter_sync) and the LoRA step (test_lora).
@pytest.mark.slow
def test_adapter_bytes_encodes_both_sides_versions(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = run_harness("adapter_bytes.py", "--model-path", str(tiny_model_dir), "--steps", "3", "--rank", "4",
                         "--out", str(tmp_path / "out"), cwd=tmp_path)
    for side in ("full", "adapter"):
        figures = result[side]
        assert figures["raw_bytes"] > 0 and figures["keyframe_bytes"] > 0 and len(figures["delta_bytes"]) == 2
    assert result["full"]["raw_bytes"] > result["adapter"]["raw_bytes"] == 4 * result["adapter_params"]
    assert result["full_over_adapter_delta"] > 0 and (tmp_path / "out" / "adapter_bytes.png").exists()


def test_learner_alone_steps_and_encodes_the_demo_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = run_harness("learner_alone.py", "--steps", "2", "--warmup", "0", "--groups-per-step", "2",
                         "--group-size", "4", "--model-path", str(tiny_model_dir), cwd=tmp_path)
    assert result["config"]["steps"] == 2 and result["config"]["threads"] == 1
    assert set(result["phases_ms"]) >= {"pack", "forward", "backward", "optimizer"}
    assert result["step_ms"] > 0 and result["encode_ms"] > 0 and result["apply_ms"] > 0
    assert 0 < result["delta_ratio"] < 1.5  # a delta of a trained version, framed
    assert set(result["to_engine_ms"]) == {"directory_write", "directory_read", "request_send", "request_read"}
    assert all(ms > 0 for ms in result["to_engine_ms"].values())
    assert result["mean_prompt_tokens"] > 0 and result["mean_response_tokens"] > 0


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_tinker_sampling_times_a_request_directly_and_through_the_api(tmp_path: Path, tiny_model_dir: Path) -> None:
    figures = run_harness("tinker_sampling.py", "--requests", "3", "--model-path", str(tiny_model_dir), cwd=tmp_path)
    assert (figures["requests"], figures["num_samples"]) == (3, 8)
    for path in ("direct", "through_the_api"):
        assert 0 < figures[path]["median_ms"] <= figures[path]["p90_ms"]
    assert figures["hop_median_ms"] == pytest.approx(
        figures["through_the_api"]["median_ms"] - figures["direct"]["median_ms"], abs=0.02)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_reward_throughput_scores_samples_at_each_batch_size(tmp_path: Path) -> None:
    from tests.tiny_model import build_tiny_reward_model

    model = build_tiny_reward_model(tmp_path / "reward-model")
    figures = run_harness("reward_throughput.py", "--model-path", str(model), "--samples", "32", "--batch-sizes",
                          "1,8", "--repeats", "1", "--out", str(tmp_path / "out"), cwd=tmp_path)
    one, eight = figures["results"]
    assert (one["max_batch"], one["calls"], one["mean_batch"]) == (1, 32, 1.0)
    assert (eight["max_batch"], eight["calls"], eight["mean_batch"]) == (8, 4, 8.0)
    assert one["samples_per_s"] > 0 and eight["samples_per_s"] > 0
    assert (tmp_path / "out" / "reward_throughput.png").stat().st_size > 0


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_reward_throughput_times_a_judge_at_each_concurrency(tmp_path: Path, tiny_model_dir: Path) -> None:
    figures = run_harness("reward_throughput.py", "--scorer", "judge", "--model-path", str(tiny_model_dir),
                          "--samples", "16", "--batch-sizes", "1,4", "--repeats", "1", "--out", str(tmp_path / "out"),
                          cwd=tmp_path)
    assert figures["scorer"] == "judge" and [r["max_batch"] for r in figures["results"]] == [1, 4]
    assert all(r["samples_per_s"] > 0 and 0 <= r["replies_without_verdict"] <= 16 for r in figures["results"])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_gpu_check_runs_its_parts_on_the_cpu_with_a_tiny_shape(tmp_path: Path) -> None:
    figures = run_harness("gpu_check.py", "--shape", "tiny", "--device", "cpu", "--steps", "2", "--groups", "2",
                          "--group-size", "4", "--prompt-tokens", "8", "--response-tokens", "8", "--engine-requests",
                          "4", "--new-tokens", "8", cwd=tmp_path)
    assert (figures["device"], figures["shape"]) == ("cpu", "tiny") and figures["parameters"] > 0
    assert len(figures["learner"]["step_s"]) == 2 and figures["learner"]["step_s_median"] > 0
    weights = figures["weights"]
    assert weights["exact"] and 0 < weights["delta_bytes"] and weights["raw_bytes"] > 0
    assert figures["engine"]["engine_tokens"] == 4 * 8 and figures["engine"]["engine_tokens_per_s"] > 0


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_weight_swap_times_the_activation_pause_and_the_paused_load(tmp_path: Path) -> None:
    figures = run_harness("weight_swap.py", "--sizes", "tiny", "--reps", "2", "--plot", str(tmp_path / "swap.png"),
                          cwd=tmp_path)
    [tiny] = figures["results"]
    swap, paused = tiny["swap"], tiny["pause"]
    assert tiny["size"] == "tiny" and swap["tensors"] > 0 and 0 < swap["prepare_s"] and 0 <= swap["pause_ms"]
    assert swap["step_ms"] > 0 and paused["pause_ms"] > 0 and paused["stream_gap_ms"] > 0
    assert (tmp_path / "swap.png").stat().st_size > 0


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_fanout_fetches_every_version_to_every_replica_direct_and_relayed(tmp_path: Path) -> None:
    figures = run_harness("fanout.py", "--replicas", "8", "--delta-mb", "0.05", "--link-mbps", "200", "--fanout", "2",
                          "--versions", "1", "--workers", "1", "--plot", str(tmp_path / "fanout.png"), cwd=tmp_path)
    direct, relayed = figures["results"]
    assert (direct["mode"], relayed["mode"]) == ("direct", "relayed")
    delta = direct["delta_bytes"]
    assert direct["publisher_egress_bytes_per_version"] == 8 * delta  # every copy from the publisher
    assert relayed["publisher_egress_bytes_per_version"] == 2 * delta  # its two children's
    assert relayed["depth"] == 3 and relayed["fallbacks"] == 0
    assert relayed["bytes_served_per_replica"]["max"] == 2 * delta
    assert all(r["p99_s"] > 0 and r["bound_s"] > 0 for r in (direct, relayed))
    assert (tmp_path / "fanout.png").stat().st_size > 0
