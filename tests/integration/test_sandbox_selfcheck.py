"""`policyloop sandbox-check`: the hostile probes an operator runs in a deployed sandbox container
pass against the real sandbox here, and a probe whose verdict is not met fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from policyloop.sandbox.selfcheck import PROBES, HostileProbe, run_probe

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)


def test_every_hostile_probe_is_contained() -> None:
    result = subprocess.run([sys.executable, "-m", "policyloop", "sandbox-check"], capture_output=True,
                            text=True, timeout=180)
    report = json.loads(result.stdout)
    assert {p["name"] for p in report["probes"]} == {p.name for p in PROBES}
    failed = [p for p in report["probes"] if not p["ok"]]
    assert not failed and report["ok"] and result.returncode == 0, failed


async def test_a_verdict_that_is_not_met_fails_the_probe() -> None:
    escaped = HostileProbe("escaped", "print('CONNECTED')", lambda r: b"CONNECTED" not in r.stdout, "never says it")
    outcome = await run_probe(escaped, None)
    assert not outcome.ok and outcome.stdout == "CONNECTED\n" and outcome.error == ""
