"""`policyloop up` brings up NATS, Redis and all six services; `policyloop status` reports them
healthy; Ctrl-C stops every process. Then the demo drives messages through the whole cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from policyloop.cluster.catalogue import SERVICE_NAMES
from policyloop.cluster.local import ClusterInfo
from policyloop.cluster.prometheus import prometheus_binary

POLICYLOOP = [sys.executable, "-m", "policyloop"]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"policyloop up exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout_s}s")
        time.sleep(0.1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_prometheus_scrapes_every_service(url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        query = urllib.request.quote('up{job="policyloop"} == 1')
        with urllib.request.urlopen(f"{url}/api/v1/query?query={query}", timeout=10) as response:
            scraped = {r["metric"]["service"] for r in json.loads(response.read())["data"]["result"]}
        if scraped == set(SERVICE_NAMES):
            return
        assert time.monotonic() < deadline, f"Prometheus scrapes only {sorted(scraped)}"
        time.sleep(0.5)


def test_up_status_and_ctrl_c(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "cluster"
    up = subprocess.Popen([*POLICYLOOP, "up", "--run-dir", str(run_dir), "--model-path", str(tiny_model_dir)],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_file(run_dir / "cluster.json", up, 60)
        status = subprocess.run([*POLICYLOOP, "status", "--run-dir", str(run_dir), "--wait-s", "90", "--json"],
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["all_healthy"] and report["missing"] == []
        assert sorted(i["service"] for i in report["instances"]) == sorted(SERVICE_NAMES)
        by_service = {i["service"]: i for i in report["instances"]}
        assert by_service["rollout"]["backlog"]["stream"] == "TASKS"
        assert by_service["learner"]["backlog"]["consumer"] == "learner"
        table = subprocess.run([*POLICYLOOP, "status", "--run-dir", str(run_dir)], capture_output=True,
                               text=True, timeout=60)
        assert table.returncode == 0 and all(name in table.stdout for name in SERVICE_NAMES)
        info = ClusterInfo.load(run_dir)
        pids = list(info.pids.values())
        # The services, nats-server, redis-server and, where it is installed, Prometheus.
        with_prometheus = prometheus_binary() is not None
        assert len(pids) == len(SERVICE_NAMES) + 2 + with_prometheus
        assert all(pid_alive(pid) for pid in pids)
        if with_prometheus:
            assert_prometheus_scrapes_every_service(info.prometheus_url)
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert "stopped" in out
    assert not [pid for pid in pids if pid_alive(pid)]
    # Each service stopped gracefully (SIGTERM), not by SIGKILL.
    for name in SERVICE_NAMES:
        log = (run_dir / "logs" / f"{name}-0.log").read_text()
        assert '"event": "service_stopped"' in log, f"{name} did not stop gracefully:\n{log[-2000:]}"


def test_status_without_a_cluster_says_so(tmp_path: Path) -> None:
    result = subprocess.run([*POLICYLOOP, "status", "--run-dir", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "no cluster.json" in result.stdout


def test_top_without_a_cluster_says_so(tmp_path: Path) -> None:
    result = subprocess.run([*POLICYLOOP, "top", "--run-dir", str(tmp_path), "--iterations", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no cluster.json" in result.stdout


def test_scaling_a_service_the_cluster_does_not_run_is_refused(tmp_path: Path) -> None:
    import pytest

    from policyloop.cluster.catalogue import entry
    from policyloop.cluster.local import LocalCluster

    cluster = LocalCluster(tmp_path / "c", services=(entry("reward"),))
    with pytest.raises(ValueError, match="cannot scale 'gateway'"):
        cluster.scale("gateway", 1)
    with pytest.raises(ValueError, match="cannot scale 'reward' to -1"):
        cluster.scale("reward", -1)
    assert cluster.processes == []  # nothing started


async def test_cluster_uses_servers_given_by_url(tmp_path: Path, nats_server, redis_server) -> None:  # type: ignore[no-untyped-def]
    from policyloop.cluster.catalogue import entry
    from policyloop.cluster.local import LocalCluster
    from policyloop.cluster.status import cluster_status

    cluster = LocalCluster(tmp_path / "c", nats_url=nats_server.url, redis_url=redis_server.url,
                           services=(entry("reward"),), replicas={"reward": 2})
    info = cluster.start()
    try:
        assert set(info.pids) == {"reward-0", "reward-1"}  # no servers of its own
        deadline = time.monotonic() + 30
        while True:
            status = await cluster_status(nats_server.url, redis_server.url, "default")
            healthy = sorted(i.instance for i in status.instances if i.healthy)
            if healthy == ["reward-0", "reward-1"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert healthy == ["reward-0", "reward-1"]
        assert not status.all_healthy and "gateway" in status.missing  # only reward runs here
    finally:
        cluster.stop()
    assert all(not pid_alive(pid) for pid in info.pids.values())
