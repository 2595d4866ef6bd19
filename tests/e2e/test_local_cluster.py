"""`policyloop up`, `status`, `top` and `scale` where no cluster runs, or against servers given by
URL; the helpers the end-to-end tests share. `up` with every service, `status` and Ctrl-C are
checked in test_protos_client.py, on the cluster that test drives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policyloop.cluster.catalogue import SERVICE_NAMES
from policyloop.cluster.local import ClusterInfo

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


@pytest.mark.timeout(300)
def test_a_demo_told_to_stop_stops_its_cluster(tmp_path: Path) -> None:
    """SIGTERM to `policyloop demo` ends it as Ctrl-C does: every process of its cluster is
    stopped on the way out, none left running."""
    run_dir = tmp_path / "run"
    demo = subprocess.Popen([*POLICYLOOP, "demo", "--run-dir", str(run_dir), "--out", str(tmp_path / "out"),
                             "--steps", "100000", "--budget-s", "900", "--no-prometheus"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(run_dir / "cluster.json", demo, timeout_s=240)  # after a first bootstrap, if need be
        info = ClusterInfo.load(run_dir)
        assert info.pids and all(pid_alive(pid) for pid in info.pids.values())
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=120) != 0
        deadline = time.monotonic() + 60
        while any(pid_alive(pid) for pid in info.pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [name for name, pid in info.pids.items() if pid_alive(pid)] == []
    finally:
        if demo.poll() is None:
            demo.kill()
