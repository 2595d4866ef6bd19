"""The container scripts a fresh host runs first (`make podman-setup && make images &&
perf/compose_smoke.py`): what breaks them on a first run on a bare machine, checked without
building anything (the build itself is run by hand, see docs/deploy.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "docker").glob("*.sh"))


def test_no_shell_function_has_its_output_captured() -> None:
    """A function run in $(...) hands back everything it prints: a progress line became part of
    an image name (`FROM building localhost/debian:bookworm ...`). Functions print progress; a value
    goes through a variable."""
    captured = []
    for script in SCRIPTS:
        text = script.read_text()
        functions = re.findall(r"^\s*(?:function\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*\(\)\s*\{", text, flags=re.MULTILINE)
        for name in functions:
            if re.search(r"\$\(\s*" + re.escape(name) + r"\b", text):
                captured.append(f"{script.name}: $({name} ...)")
    assert SCRIPTS and captured == []


def test_podman_setup_installs_what_its_settings_drive() -> None:
    """The network backend and runtime setup-podman.sh configures run other programs: each must be
    among the packages it installs (a host that happened to have iptables hid netavark's need)."""
    text = (REPO / "docker" / "setup-podman.sh").read_text()
    packages = set(re.search(r"^packages=\(([^)]*)\)", text, flags=re.MULTILINE | re.DOTALL).group(1).split())  # type: ignore[union-attr]
    backend = re.search(r'^network_backend = "(\w+)"', text, flags=re.MULTILINE).group(1)  # type: ignore[union-attr]
    runtime = re.search(r'^runtime = "(\w+)"', text, flags=re.MULTILINE).group(1)  # type: ignore[union-attr]
    # netavark makes the bridge and its NAT and port-forward rules with iptables/ip6tables;
    # aardvark-dns answers the compose service names.
    drives = {"netavark": {"netavark", "aardvark-dns", "iptables"}}[backend] | {runtime, "podman", "conmon"}
    assert drives <= packages, drives - packages
    # What docker/compose.sh and build-images.sh run on the host.
    assert {"docker-compose", "curl", "debootstrap"} <= packages


def test_compose_smoke_says_what_to_run_when_there_is_no_container_engine(tmp_path: Path) -> None:
    """Run before `make podman-setup` (no podman, no docker on PATH), the smoke harness names what
    is missing and what to run, instead of ending in a traceback."""
    result = subprocess.run([sys.executable, str(REPO / "perf" / "compose_smoke.py")], cwd=tmp_path,
                            env={**os.environ, "PATH": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "no container engine" in result.stderr and "make podman-setup" in result.stderr, result.stderr
    assert result.stdout == ""


def test_health_checks_leave_a_busy_host_time_for_the_probe() -> None:
    """`policyloop probe` is a Python process: on a loaded 2-core host its start alone took 6-16 s,
    and a 5 s limit kept healthy services "unhealthy" until compose gave up. compose.yaml and the
    images' HEALTHCHECK allow the same, generous, time."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    check = compose["x-policyloop-healthcheck"]
    assert check["test"] == ["CMD", "policyloop", "probe"] and _seconds(check["timeout"]) >= 30
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    timeouts = re.findall(r"^HEALTHCHECK .*--timeout=(\w+) .*CMD \[\"policyloop\", \"probe\"\]", dockerfile,
                          flags=re.MULTILINE)
    assert len(timeouts) == 2 and {_seconds(t) for t in timeouts} == {_seconds(check["timeout"])}


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)(s|m)", duration).groups()  # type: ignore[union-attr]
    return float(value) * (60 if unit == "m" else 1)
