"""The sandbox runner on real processes: isolation, limits, timeouts, output caps."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.runner import (
    JobLimits,
    JobUids,
    SandboxUnavailable,
    check_isolation,
    check_scratch_root,
    effective_limits,
    run_job,
)

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"no namespaces here: {exc}", allow_module_level=True)


@pytest.fixture
def tmp_path():  # type: ignore[no-untyped-def]
    """A scratch root the unprivileged job user can traverse (pytest's own is root-only)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="pl-sandbox-test-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_scratch_root_must_be_traversable(tmp_path: Path) -> None:
    import os

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    if os.geteuid() == 0:
        with pytest.raises(SandboxUnavailable, match="not traversable"):
            check_scratch_root(private / "scratch")
    check_scratch_root(tmp_path / "scratch")


def job(*command: str, **kw: object) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(job_id="j", command=list(command), **kw)  # type: ignore[arg-type]


async def test_runs_a_program_with_its_files_and_stdin(tmp_path: Path) -> None:
    result = await run_job(job("python3", "main.py", files={"main.py": b"import sys; print(sys.stdin.read().upper())"},
                               stdin=b"hello"), JobLimits(), tmp_path)
    assert (result.exit_code, result.stdout, result.limit_hit) == (0, b"HELLO\n", bus_pb2.SANDBOX_LIMIT_NONE)
    assert list(tmp_path.iterdir()) == []  # scratch removed


async def test_no_network_and_own_pid_namespace(tmp_path: Path) -> None:
    code = (b"import os, socket\nprint(os.getpid())\n"
            b"try:\n socket.create_connection(('127.0.0.1', 22), timeout=2)\n print('connected')\n"
            b"except OSError as e:\n print('refused', e.errno)\n")
    result = await run_job(job("python3", "n.py", files={"n.py": code}), JobLimits(), tmp_path)
    pid, outcome = result.stdout.decode().split("\n")[:2]
    assert pid == "2"  # its own pid namespace: bwrap is its init (pid 1), the job comes next
    assert outcome.startswith("refused")


async def test_wall_timeout_kills_the_whole_tree(tmp_path: Path) -> None:
    marker = "sleep 4242"
    result = await run_job(job("sh", "-c", f"({marker} &) ; {marker}"), JobLimits(wall_seconds=1), tmp_path)
    assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_WALL_TIME and result.exit_code < 0
    await asyncio.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == ""


async def test_cpu_and_output_limits(tmp_path: Path) -> None:
    spin = await run_job(job("python3", "-c", "while True: pass"), JobLimits(cpu_seconds=1, wall_seconds=10), tmp_path)
    assert spin.limit_hit == bus_pb2.SANDBOX_LIMIT_CPU_TIME and spin.exit_code != 0
    loud = await run_job(job("python3", "-c", "print('x' * 100000)"), JobLimits(max_output_bytes=1000), tmp_path)
    assert len(loud.stdout) == 1000 and loud.stdout_truncated
    assert loud.limit_hit == bus_pb2.SANDBOX_LIMIT_OUTPUT


def test_requested_limits_are_capped() -> None:
    limits = effective_limits(bus_pb2.SandboxLimits(wall_seconds=999, cpu_seconds=2),
                              JobLimits(), JobLimits(wall_seconds=60, cpu_seconds=30))
    assert (limits.wall_seconds, limits.cpu_seconds, limits.memory_bytes) == (60, 2, JobLimits().memory_bytes)


async def test_every_job_has_its_own_process_budget(tmp_path: Path) -> None:
    """Each job forks up to its limit; back to back (what bwrap leaves behind may wait for init to
    reap it) and side by side (concurrent jobs), no job is charged for another's processes."""
    forks = "for i in 1 2 3 4 5 6; do sleep 0.05 & done; wait; echo done"
    limits = JobLimits(max_processes=12, wall_seconds=10)
    uids = JobUids(base=300_000, count=64)
    results = [await run_job(job("sh", "-c", forks), limits, tmp_path, uids=uids) for _ in range(30)]
    results += await asyncio.gather(*(run_job(job("sh", "-c", forks), limits, tmp_path, uids=uids) for _ in range(6)))
    assert [(r.exit_code, r.stdout, r.limit_hit) for r in results] == [(0, b"done\n", 0)] * 36
    # A job that forks past its own limit is still stopped by it.
    bomb = await run_job(job("sh", "-c", "for i in $(seq 40); do sleep 1 & done; wait"), limits, tmp_path, uids=uids)
    assert bomb.limit_hit == bus_pb2.SANDBOX_LIMIT_PROCESSES


def test_job_uids_go_round_a_range() -> None:
    uids = JobUids(base=500, count=3)
    assert [uids.next() for _ in range(7)] == [500, 501, 502, 500, 501, 502, 500]
    with pytest.raises(ValueError, match="positive"):
        JobUids(base=0)


def test_job_cgroups_go_below_this_process_own_cgroup() -> None:
    from policyloop.sandbox.cgroups import CgroupsUnavailable, job_parents

    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "33 31 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 /kubepods/pod1 /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    own = "8:pids:/svc\n4:memory:/kubepods/pod1/box\n2:cpu,cpuacct:/\n0::/\n"
    parents = job_parents(mountinfo, own, "policyloop-sandbox-7")
    assert parents == {"memory": Path("/sys/fs/cgroup/memory/box/policyloop-sandbox-7"),
                       "pids": Path("/sys/fs/cgroup/pids/svc/policyloop-sandbox-7"),
                       "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct/policyloop-sandbox-7")}
    # A v2-only host, and a cgroup outside the part of the hierarchy mounted here.
    with pytest.raises(CgroupsUnavailable, match="memory"):
        job_parents("41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", "0::/\n", "x")
    with pytest.raises(CgroupsUnavailable, match="outside"):
        job_parents(mountinfo, own.replace("/kubepods/pod1/box", "/elsewhere"), "x")


def test_the_limit_reported_is_the_most_decisive_sign() -> None:
    from policyloop.sandbox.cgroups import CgroupUsage
    from policyloop.sandbox.runner import JobEnding, classify

    limits = JobLimits(cpu_seconds=2)
    usage = CgroupUsage(cpu_seconds=0.1, peak_memory_bytes=1, oom_kills=0, forks_refused=0)
    L = bus_pb2.SandboxLimit
    cases = [
        (JobEnding(0, 0.1), L.SANDBOX_LIMIT_NONE),
        (JobEnding(-9, 0.1, timed_out=True, output_truncated=True), L.SANDBOX_LIMIT_WALL_TIME),
        (JobEnding(-9, 1.0, cpu_watchdog=True, usage=usage), L.SANDBOX_LIMIT_CPU_TIME),
        (JobEnding(128 + 24, 0.5), L.SANDBOX_LIMIT_CPU_TIME),  # SIGXCPU, through bwrap
        # The job's total reaching the limit stops it only where the limit is the job's (cgroup).
        (JobEnding(0, 2.0, usage=CgroupUsage(2.0, 1, 0, 0)), L.SANDBOX_LIMIT_CPU_TIME),
        (JobEnding(0, 2.5), L.SANDBOX_LIMIT_NONE),
        (JobEnding(-9, 0.1, usage=CgroupUsage(0.1, 9, oom_kills=1, forks_refused=3)), L.SANDBOX_LIMIT_MEMORY),
        (JobEnding(0, 0.1, usage=CgroupUsage(0.1, 9, oom_kills=0, forks_refused=3)), L.SANDBOX_LIMIT_PROCESSES),
        # With a cgroup the job's stderr is not evidence; without one it is all there is.
        (JobEnding(1, 0.1, usage=usage, stderr=b"MemoryError"), L.SANDBOX_LIMIT_NONE),
        (JobEnding(1, 0.1, stderr=b"MemoryError"), L.SANDBOX_LIMIT_MEMORY),
        (JobEnding(0, 0.1, stderr=b"BlockingIOError: [Errno 11]"), L.SANDBOX_LIMIT_PROCESSES),
        (JobEnding(1, 0.1, file_at_limit=True, output_truncated=True), L.SANDBOX_LIMIT_FILE_SIZE),
        (JobEnding(-25, 0.1), L.SANDBOX_LIMIT_FILE_SIZE),
        (JobEnding(0, 0.1, output_truncated=True), L.SANDBOX_LIMIT_OUTPUT),
    ]
    assert [classify(ending, limits) for ending, _ in cases] == [expected for _, expected in cases]


def test_a_file_at_the_size_limit_is_found(tmp_path: Path) -> None:
    from policyloop.sandbox.runner import file_reached

    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "small").write_bytes(b"x" * 99)
    (tmp_path / "deep" / "link").symlink_to("/usr/bin/python3")  # links are not followed
    assert not file_reached(tmp_path, 100)
    (tmp_path / "deep" / "er" / "full").write_bytes(b"x" * 100)
    assert file_reached(tmp_path, 100)
