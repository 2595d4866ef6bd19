"""What a harness or the demo says when the local cluster does not come up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from policyloop.cluster.local import ManagedProcess
from policyloop.cluster.status import ClusterStatus, InstanceStatus
from policyloop.demo.loop import unhealthy_report


def test_it_names_the_missing_and_unhealthy_with_their_process_state_and_log_tail(tmp_path: Path) -> None:
    crashed = ManagedProcess("reward-0", [sys.executable, "-c", "print('ImportError: no validate_group'); exit(1)"],
                             {}, tmp_path / "reward-0.log")
    stuck = ManagedProcess("tinker-0", [sys.executable, "-c",
                                        "import time; print('loading', flush=True); time.sleep(60)"],
                           {}, tmp_path / "tinker-0.log")
    fine = ManagedProcess("gateway-0", [sys.executable, "-c", "print('serving')"], {}, tmp_path / "gateway-0.log")
    for managed in (crashed, stuck, fine):
        managed.start()
    try:
        assert crashed.proc is not None and crashed.proc.wait(30) == 1
        assert fine.proc is not None and fine.proc.wait(30) == 0
        deadline = time.monotonic() + 30
        while "loading" not in stuck.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling a condition: its first line in the log
        status = ClusterStatus(instances=[InstanceStatus("tinker", "tinker-0", False, 0),
                                          InstanceStatus("gateway", "gateway-0", True, 0)],
                               missing=["reward"], backlogs={})
        report = unhealthy_report([crashed, stuck, fine], status, 180)
    finally:
        stuck.signal(9)
        assert stuck.proc is not None
        stuck.proc.wait(30)
    lines = report.splitlines()
    assert lines[0] == "the cluster is not healthy after 180 s: missing ['reward'], unhealthy ['tinker-0']"
    assert "--- reward-0 (exited 1), reward-0.log ends:" in lines and "ImportError: no validate_group" in lines
    assert "--- tinker-0 (running), tinker-0.log ends:" in lines and "loading" in lines
    assert not any("gateway" in line or "serving" in line for line in lines)
