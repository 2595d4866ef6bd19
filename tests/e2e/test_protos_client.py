"""A gRPC client built only from protos/ drives a running `policyloop up`: invalid calls get the
right status codes; an arithmetic and a code environment are submitted, a run mixing both is
started, watched until the learner has trained samples of both and the evaluator has scored a
version on the eval split, and stopped. Meanwhile
`policyloop top` shows the ledger move; afterwards every query of the Grafana dashboard returns
data from the cluster's Prometheus, and a trained trajectory's spans reach an OTLP receiver as
one tree."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policyloop.cluster.catalogue import SERVICE_NAMES
from policyloop.cluster.local import ClusterInfo
from policyloop.cluster.prometheus import prometheus_binary
from policyloop.telemetry.dashboard import load_dashboard, runnable_queries
from tests.e2e.test_local_cluster import POLICYLOOP, assert_prometheus_scrapes_every_service, pid_alive, wait_for_file
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, lineage, lineage_or_none

REPO = Path(__file__).resolve().parents[2]


def generate_stubs(out: Path) -> None:
    """Python modules from the .proto files alone (the package is policyloop.v1, as they say)."""
    protos = sorted((REPO / "protos" / "policyloop" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'protos'}", f"--python_out={out}",
                    f"--grpc_python_out={out}", *map(str, protos)], check=True, capture_output=True, timeout=60)
    for package in (out / "policyloop", out / "policyloop" / "v1"):
        (package / "__init__.py").touch()


class TopInTmux:
    """`policyloop top` running in a tmux session, its screen read with capture-pane."""

    def __init__(self, run_dir: Path) -> None:
        self.tmux = shutil.which("tmux")
        self.session = f"policyloop-top-{os.getpid()}"
        if self.tmux is not None:
            # The pane's size also in LINES/COLUMNS: under pytest, rich read a smaller height than the pane's.
            command = " ".join(["env", "LINES=70", "COLUMNS=150", *POLICYLOOP, "top", "--run-dir", str(run_dir),
                                "--interval-s", "1", "--window-s", "600"])  # the whole run: no env drops out
            subprocess.run([self.tmux, "new-session", "-d", "-s", self.session, "-x", "150", "-y", "70", command],
                           check=True, timeout=30)

    def screen(self) -> str:
        assert self.tmux is not None
        return subprocess.run([self.tmux, "capture-pane", "-p", "-t", self.session], capture_output=True, text=True,
                              timeout=30).stdout

    def wait_for(self, check: Callable[[str], bool], what: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            assert time.monotonic() < deadline, f"top never showed {what}:\n{screen}"
            time.sleep(0.5)

    def close(self) -> None:
        if self.tmux is not None:
            subprocess.run([self.tmux, "kill-session", "-t", self.session], capture_output=True, timeout=30)


def check_the_cluster_is_up(run_dir: Path, report: dict[str, Any]) -> list[int]:
    """`policyloop status` (JSON and table) shows every service healthy, and `up` runs them, NATS,
    Redis and, where it is installed, Prometheus scraping every service. Returns their pids."""
    assert report["all_healthy"] and report["missing"] == []
    assert sorted(i["service"] for i in report["instances"]) == sorted(SERVICE_NAMES)
    by_service = {i["service"]: i for i in report["instances"]}
    assert by_service["rollout"]["backlog"]["stream"] == "TASKS"
    assert by_service["learner"]["backlog"]["consumer"] == "learner"
    table = subprocess.run([*POLICYLOOP, "status", "--run-dir", str(run_dir)], capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 0 and all(name in table.stdout for name in SERVICE_NAMES)
    info = ClusterInfo.load(run_dir)
    pids = list(info.pids.values())
    with_prometheus = prometheus_binary() is not None
    assert len(pids) == len(SERVICE_NAMES) + 2 + with_prometheus
    assert all(pid_alive(pid) for pid in pids)
    if with_prometheus:
        assert_prometheus_scrapes_every_service(info.prometheus_url)
    return pids


def check_a_trained_trajectorys_trace(receiver: OtlpReceiver) -> None:
    """One trajectory of the code environment, trained: its spans, from the gateway's feed to the
    learner's step and the version that carried it, form one tree with the sandbox jobs that scored
    it, across five services."""

    def trained_code_sample(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        for span in spans:
            chain = lineage_or_none(spans, span) if span.name == "train" else [span]
            if chain[0].parent_span_id or len(chain) < 3:
                continue  # not a train span, or one whose ancestors have not all arrived
            trajectory = span.attributes.get("policyloop.trajectory_id")
            sample = next((s for s in spans if s.name == "sample" and s.trace_id == span.trace_id
                           and s.attributes.get("policyloop.trajectory_id") == trajectory), None)
            if sample is None:
                continue
            scored = next(s for s in chain if s.name == "process ROLLOUTS")
            scores = {s.span_id for s in spans if s.name == "score" and s.parent_span_id == scored.span_id}
            if sample.attributes.get("policyloop.environment") == "functions@v1" and any(
                    s.name == "process SANDBOX" and s.parent_span_id in scores for s in spans):
                return span
        return None

    receiver.wait_for(lambda spans: trained_code_sample(spans) is not None,
                      "a trained code trajectory's spans, its sandbox jobs included", timeout_s=90)
    spans = receiver.snapshot()
    train = trained_code_sample(spans)
    assert train is not None
    # The group goes as one message from its task's handling: its samples are siblings there.
    assert [(s.service, s.name) for s in lineage(spans, train)] == [
        ("gateway", "feed task"), ("rollout", "process TASKS"), ("reward", "process ROLLOUTS"),
        ("learner", "process TRAJECTORIES"), ("learner", "train")]
    trajectory = train.attributes["policyloop.trajectory_id"]
    mine = [s for s in spans if s.trace_id == train.trace_id]
    ids = {s.span_id for s in mine}
    roots = [s for s in mine if s.parent_span_id not in ids]
    assert [(r.service, r.name) for r in roots] == [("gateway", "feed task")]  # one tree
    own = {s.name for s in mine if s.attributes.get("policyloop.trajectory_id") == trajectory}
    assert {"sample", "score", "train", "publish version"} <= own, own
    published = next(s for s in mine if s.name == "publish version" and s.parent_span_id == train.parent_span_id)
    assert published.attributes["policyloop.policy_version"] == train.attributes["policyloop.policy_version"] >= 1
    jobs = [s for s in mine if s.service == "sandbox"]
    assert jobs and all(s.attributes["policyloop.job_outcome"] for s in jobs)


def prometheus_query(url: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector `expr` evaluates to now; a query Prometheus refuses fails at once."""
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10) as r:
        answer = json.load(r)
    assert answer["status"] == "success", f"{expr}: {answer}"
    return answer["data"]["result"]


def dashboard_panels_without_data(prometheus_url: str, timeout_s: float) -> list[str]:
    """Asks the cluster's Prometheus every query of the Grafana dashboard (its variables set to
    every value), each until it returns data or `timeout_s` has passed: the queries still empty."""
    waiting = runnable_queries(load_dashboard())
    assert waiting
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = [(query, expr) for query, expr in waiting if not prometheus_query(prometheus_url, expr)]
        if not waiting or time.monotonic() >= deadline:
            return [f"{query.where}: {expr}" for query, expr in waiting]
        time.sleep(1)  # Prometheus scrapes every 5 s


def learner_steps(screen: str) -> int:
    found = re.search(r"learner steps\s*│\s*([\d,]+)", screen)
    return int(found.group(1).replace(",", "")) if found else -1


def check_top_followed_the_run(top: TopInTmux, steps_before: int) -> None:
    """The figures moved while the run trained: steps, tokens, lag, reward per environment."""
    screen = top.wait_for(lambda s: learner_steps(s) >= steps_before + 2 and "sums@v1" in s and "functions@v1" in s,
                          "the run's steps and both environments' rewards")
    for figure in ("tokens/s generated", "tokens/s trained", "version lag", "KL (behaviour) / entropy",
                   "publish: step end → serving p50 / p99", "dropped", "dead letters", "TRAJECTORIES",
                   "functions@v1"):
        assert figure in screen, f"{figure!r} not on the screen:\n{screen}"
    assert "Prometheus http://127.0.0.1" in screen or "services' /metrics" in screen


def check_every_process_stopped_gracefully(up: subprocess.Popen, out: str, pids: list[int], run_dir: Path) -> None:
    """Ctrl-C on `up` stopped every process it ran, each service by SIGTERM (not SIGKILL)."""
    assert up.returncode == 0 and "stopped" in out, out
    assert not [pid for pid in pids if pid_alive(pid)]
    for name in SERVICE_NAMES:
        log = (run_dir / "logs" / f"{name}-0.log").read_text()
        assert '"event": "service_stopped"' in log, f"{name} did not stop gracefully:\n{log[-2000:]}"


def check_the_clients_report(report: dict[str, Any]) -> None:
    """What the client built from the protos alone saw: status codes naming the field, the run."""
    # The client imported the generated stubs, nothing of the project.
    assert report["imported"] == ["policyloop", "policyloop.v1", "policyloop.v1.bus_pb2",
                                  "policyloop.v1.loop_pb2", "policyloop.v1.loop_pb2_grpc"]
    invalid = report["invalid"]
    assert invalid["no_tasks"].startswith("INVALID_ARGUMENT environment.tasks")
    assert invalid["no_scorer"].startswith("INVALID_ARGUMENT environment.scorer")
    assert invalid["unknown_environment"].startswith("NOT_FOUND environments[0].environment")
    assert invalid["bad_weight"].startswith("INVALID_ARGUMENT environments[0].weight")
    assert invalid["unknown_run"].startswith("NOT_FOUND run_id")
    assert invalid["changed_definition"].startswith("ALREADY_EXISTS")
    assert invalid["other_loss"].startswith("FAILED_PRECONDITION loss.kind")
    assert invalid["other_max_lag"].startswith("FAILED_PRECONDITION max_lag")
    assert invalid["setting_of_another_loss"].startswith("INVALID_ARGUMENT loss.beta: not a setting of the ppo loss")
    assert report["submitted"] == [["sums@v1", 40, True], ["functions@v1", 3, True]]
    assert report["resubmitted_same"] is False
    assert report["run_started"] == "RUN_STATE_RUNNING" and report["watch_updates"] >= 2
    progress = report["progress"]
    assert progress["learner_step"] >= 2, report
    assert set(progress["environments"]) == {"sums@v1", "functions@v1"}
    assert all(e["trained_samples"] > 0 for e in progress["environments"].values()), report
    assert progress["generated_tokens"] > 0 and progress["policy_version"] >= 2
    assert report["run_stopped"] == report["get_run"] == "RUN_STATE_STOPPED"
    # The evaluator scored versions of the run on the sums' eval split, with their intervals.
    assert report["evals"] and all(low <= rate <= high for _, rate, low, high in report["evals"])
    assert ["policy", progress["policy_version"]] in report["policies"] or report["policies"][0][1] >= 2


@pytest.mark.timeout(480)
def test_a_client_from_the_protos_alone_runs_a_mixed_environment(tmp_path: Path, tiny_model_dir: Path) -> None:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    generate_stubs(stubs)
    run_dir = tmp_path / "cluster"
    # No lag bound: code groups wait for the sandbox (one job at a time) and may be scored several
    # versions after the arithmetic ones; here they must be trained, not dropped as stale.
    receiver = OtlpReceiver().__enter__()
    # A KL penalty to the base: its statistic (kl_reference) has a dashboard panel, which must show data.
    env = {**os.environ, "POLICYLOOP_GROUPS_PER_STEP": "4", "POLICYLOOP_MAX_LAG": "-1",
           "POLICYLOOP_LOSS__KL_COEF": "0.01",
           "POLICYLOOP_EVERY_VERSIONS": "1",  # the evaluator scores every version
           "POLICYLOOP_TRACING__OTLP_ENDPOINT": receiver.endpoint, "POLICYLOOP_TRACING__BATCH_DELAY_S": "0.5"}
    up = subprocess.Popen([*POLICYLOOP, "up", "--run-dir", str(run_dir), "--model-path", str(tiny_model_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    top: TopInTmux | None = None
    try:
        wait_for_file(run_dir / "cluster.json", up, 60)
        status = subprocess.run([*POLICYLOOP, "status", "--run-dir", str(run_dir), "--wait-s", "120", "--json"],
                                capture_output=True, text=True, timeout=150)
        assert status.returncode == 0, status.stdout + status.stderr
        pids = check_the_cluster_is_up(run_dir, json.loads(status.stdout))
        top = TopInTmux(run_dir)
        if top.tmux is not None:
            before = learner_steps(top.wait_for(lambda s: "learner-0" in s and learner_steps(s) >= 0, "the cluster"))
        gateway = json.loads((run_dir / "cluster.json").read_text())["processes"]["gateway-0"]["grpc"]
        client = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("protos_client.py")), f"127.0.0.1:{gateway}"],
            capture_output=True, text=True, timeout=330, cwd=tmp_path,
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(stubs)})
        assert client.returncode == 0, client.stdout + client.stderr
        report = json.loads(client.stdout.strip().splitlines()[-1])
        if top.tmux is not None:
            check_top_followed_the_run(top, before)
        # Every panel of the Grafana dashboard has data, read from this cluster's Prometheus.
        prometheus_url = json.loads((run_dir / "cluster.json").read_text())["prometheus_url"]
        if shutil.which("prometheus") is not None:
            assert prometheus_url, "prometheus is installed, but `policyloop up` runs none"
            empty = dashboard_panels_without_data(prometheus_url, timeout_s=60)
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        # Without Prometheus (a dead URL), top reads every service's /metrics itself.
        direct = subprocess.run([*POLICYLOOP, "top", "--run-dir", str(run_dir), "--prometheus-url",
                                 "http://127.0.0.1:9", "--iterations", "1"], capture_output=True, text=True,
                                timeout=60)
        assert direct.returncode == 0 and "services' /metrics" in direct.stdout and "rollout-0" in direct.stdout
        check_a_trained_trajectorys_trace(receiver)
    finally:
        if top is not None:
            top.close()
        up.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = up.communicate(timeout=90)
        receiver.__exit__()
    check_every_process_stopped_gracefully(up, out, pids, run_dir)
    check_the_clients_report(report)
    if not prometheus_url:
        pytest.skip("the rest passed; prometheus is not installed, so the Grafana dashboard's queries were not "
                    "checked against a cluster (Debian package prometheus; `make test` installs it)")
