"""Hostile jobs run through the real sandbox where it is deployed, each with the verdict a contained
job must get: `policyloop sandbox-check` in a sandbox container (or on a host) shows that the
container gives bubblewrap what isolation needs, rather than trusting that it does.

Each probe is a small Python job and a check on its result; a probe passes only when the job
ran (no sandbox error) and was contained the way the check describes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import JobCgroups, job_cgroups
from policyloop.sandbox.runner import JobLimits, SandboxUnavailable, check_isolation, run_job

L = bus_pb2.SandboxLimit
CHECK_LIMITS = JobLimits(wall_seconds=15, cpu_seconds=2, memory_bytes=128 * 1024**2, max_processes=16,
                         max_output_bytes=16 * 1024)
MARKER = "POLICYLOOP_SELFCHECK_SECRET"


@dataclass(frozen=True)
class HostileProbe:
    name: str
    code: str                                              # the job: python3 job.py
    contained: Callable[[bus_pb2.SandboxResult], bool]     # the verdict of a contained job
    expectation: str                                       # the verdict, in words


@dataclass(frozen=True)
class ProbeOutcome:
    name: str
    ok: bool
    expectation: str
    limit_hit: str
    exit_code: int
    stdout: str
    error: str


def _out(result: bus_pb2.SandboxResult) -> str:
    return result.stdout.decode(errors="replace")


PROBES: tuple[HostileProbe, ...] = (
    HostileProbe("network", """
import socket
for address in (("1.1.1.1", 53), ("8.8.8.8", 443), ("127.0.0.1", 9100), ("nats", 4222)):
    try:
        socket.create_connection(address, timeout=2)
        print("CONNECTED", address)
    except OSError:
        print("refused")
""", lambda r: "CONNECTED" not in _out(r) and _out(r).count("refused") == 4,
        "no connection anywhere, the service's own port and the cluster's names included"),
    HostileProbe("write-outside", """
for path in ("/usr/evil", "/evil", "/etc/passwd", "/opt/venv/evil", "/data/evil", "/proc/evil"):
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError:
        print("denied")
open("inside.txt", "w").write("ok")
print(open("inside.txt").read())
""", lambda r: "WROTE" not in _out(r) and _out(r).count("denied") == 6 and _out(r).endswith("ok\n"),
        "only its scratch directory is writable"),
    HostileProbe("secrets", f"""
import glob, os
found = [k for k in os.environ if k.startswith("POLICYLOOP") or k == "{MARKER}"]
for path in ["/proc/1/environ", *glob.glob("/proc/*/environ"), "/etc/shadow", "/root/.bashrc",
             "/var/run/secrets/kubernetes.io/serviceaccount/token"]:
    try:
        if "{MARKER}" in open(path, errors="replace").read() or "serviceaccount" in path:
            found.append(path)
    except OSError:
        pass
print("LEAKED" if found else "nothing", found)
""", lambda r: "nothing []" in _out(r), "no environment, no host files, no service-account token"),
    HostileProbe("processes", """
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids", pids, "uid", os.getuid())
""", lambda r: _out(r).startswith("pids [1] uid ") and not _out(r).strip().endswith("uid 0"),
        "sees only its own process, not as root"),
    HostileProbe("fork-bomb", """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except OSError:
        time.sleep(0.01)
""", lambda r: r.limit_hit == L.SANDBOX_LIMIT_PROCESSES, "ended at the process limit"),
    HostileProbe("memory-bomb", """
blocks = []
while True:
    blocks.append(bytearray(16 * 1024 * 1024))
""", lambda r: r.limit_hit == L.SANDBOX_LIMIT_MEMORY, "ended at the memory limit"),
    HostileProbe("cpu-loop", """
while True:
    pass
""", lambda r: r.limit_hit == L.SANDBOX_LIMIT_CPU_TIME, "ended at the CPU limit"),
)


async def run_probe(probe: HostileProbe, cgroups: JobCgroups | None, limits: JobLimits = CHECK_LIMITS
                    ) -> ProbeOutcome:
    job = bus_pb2.SandboxJob(job_id=f"selfcheck-{probe.name}-{uuid.uuid4().hex[:8]}",
                             command=["python3", "job.py"], files={"job.py": probe.code.encode()})
    result = await run_job(job, limits, instance="selfcheck", cgroups=cgroups)
    ok = not result.error and probe.contained(result)
    return ProbeOutcome(probe.name, ok, probe.expectation, L.Name(result.limit_hit), result.exit_code,
                        _out(result)[-400:], result.error)


async def self_check(cgroups_mode: str = "auto", probes: tuple[HostileProbe, ...] = PROBES) -> list[ProbeOutcome]:
    """Every probe, one after the other. Raises SandboxUnavailable when bubblewrap cannot isolate
    a job here at all (the sandbox service would refuse to start for the same reason)."""
    check_isolation()
    # A value only this process holds: the secrets probe looks for it from inside the job.
    os.environ.setdefault(MARKER, uuid.uuid4().hex)
    cgroups = job_cgroups(cgroups_mode)
    try:
        return [await run_probe(probe, cgroups) for probe in probes]
    finally:
        if cgroups is not None:
            cgroups.remove_parents()


__all__ = ["PROBES", "HostileProbe", "ProbeOutcome", "SandboxUnavailable", "run_probe", "self_check"]
