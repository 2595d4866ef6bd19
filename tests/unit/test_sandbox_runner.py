"""The sandbox runner on real processes: isolation, limits, timeouts, output caps."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.runner import (
    JobLimits,
    JobUids,
    SandboxUnavailable,
    check_isolation,
    effective_limits,
    run_job,
)

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"no namespaces here: {exc}", allow_module_level=True)


def job(*command: str, **kw: object) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(job_id="j", command=list(command), **kw)  # type: ignore[arg-type]


async def test_runs_a_program_with_its_files_and_stdin() -> None:
    files = {"main.py": b"import sys, helper; print(sys.stdin.read().upper(), helper.X)", "helper.py": b"X = 7",
             "data/deep/in.txt": b"in"}
    result = await run_job(job("python3", "main.py", files=files, stdin=b"hello"), JobLimits())
    assert (result.exit_code, result.stdout, result.limit_hit) == (0, b"HELLO 7\n", bus_pb2.SANDBOX_LIMIT_NONE)
    listed = await run_job(job("sh", "-c", "cat data/deep/in.txt; ls -A", files=files), JobLimits())
    assert listed.stdout == b"indata\nhelper.py\nmain.py\n", listed


async def test_files_outside_the_scratch_directory_are_refused() -> None:
    for path in ("/etc/x", "../x", "a/../../x", "", "."):
        result = await run_job(job("true", files={path: b"x"}), JobLimits())
        assert result.error.startswith("files:") and result.exit_code == -1, (path, result)
    # Paths that clash (a file where a directory must be) cannot be set up: a result, not a raise.
    clash = await run_job(job("true", files={"a": b"x", "a/b": b"y"}), JobLimits())
    assert clash.error.startswith("the job could not be set up"), clash


async def test_no_network_and_own_pid_namespace() -> None:
    code = (b"import os, socket\nprint(os.getpid())\n"
            b"try:\n socket.create_connection(('127.0.0.1', 22), timeout=2)\n print('connected')\n"
            b"except OSError as e:\n print('refused', e.errno)\n")
    result = await run_job(job("python3", "n.py", files={"n.py": code}), JobLimits())
    pid, outcome = result.stdout.decode().split("\n")[:2]
    assert pid == "1"  # its own pid namespace, whose init the job's main process is
    assert outcome.startswith("refused")


async def test_wall_timeout_kills_the_whole_tree() -> None:
    marker = "sleep 4242"
    result = await run_job(job("sh", "-c", f"({marker} &) ; {marker}"), JobLimits(wall_seconds=1))
    assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_WALL_TIME and result.exit_code < 0
    for _ in range(100):  # the kernel ends the namespace's processes as its init goes
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        await asyncio.sleep(0.1)
    assert left == ""


async def test_cpu_and_output_limits() -> None:
    spin = await run_job(job("python3", "-c", "while True: pass"), JobLimits(cpu_seconds=1, wall_seconds=10))
    assert spin.limit_hit == bus_pb2.SANDBOX_LIMIT_CPU_TIME and spin.exit_code != 0
    loud = await run_job(job("python3", "-c", "print('x' * 100000)"), JobLimits(max_output_bytes=1000))
    assert len(loud.stdout) == 1000 and loud.stdout_truncated
    assert loud.limit_hit == bus_pb2.SANDBOX_LIMIT_OUTPUT


def test_requested_limits_are_capped() -> None:
    limits = effective_limits(bus_pb2.SandboxLimits(wall_seconds=999, cpu_seconds=2),
                              JobLimits(), JobLimits(wall_seconds=60, cpu_seconds=30))
    assert (limits.wall_seconds, limits.cpu_seconds, limits.memory_bytes) == (60, 2, JobLimits().memory_bytes)


async def test_every_job_has_its_own_process_budget() -> None:
    """Each job forks up to its limit; back to back (what bwrap leaves behind may wait for init to
    reap it) and side by side (concurrent jobs), no job is charged for another's processes."""
    forks = "for i in 1 2 3 4 5 6; do sleep 0.05 & done; wait; echo done"
    limits = JobLimits(max_processes=12, wall_seconds=10)
    uids = JobUids(base=300_000, count=64)
    results = [await run_job(job("sh", "-c", forks), limits, uids=uids) for _ in range(30)]
    results += await asyncio.gather(*(run_job(job("sh", "-c", forks), limits, uids=uids) for _ in range(6)))
    assert [(r.exit_code, r.stdout, r.limit_hit) for r in results] == [(0, b"done\n", 0)] * 36
    # A job that forks past its own limit is still stopped by it.
    bomb = await run_job(job("sh", "-c", "for i in $(seq 40); do sleep 1 & done; wait"), limits, uids=uids)
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
        (JobEnding(-9, 1.0, watchdog=L.SANDBOX_LIMIT_CPU_TIME, usage=usage), L.SANDBOX_LIMIT_CPU_TIME),
        (JobEnding(128 + 24, 0.5), L.SANDBOX_LIMIT_CPU_TIME),  # SIGXCPU (the per-process backstop), through bwrap
        # The limit is the whole job's, with a cgroup or without.
        (JobEnding(0, 2.0, usage=CgroupUsage(2.0, 1, 0, 0)), L.SANDBOX_LIMIT_CPU_TIME),
        (JobEnding(0, 2.5), L.SANDBOX_LIMIT_CPU_TIME),
        (JobEnding(-9, 0.1, watchdog=L.SANDBOX_LIMIT_PROCESSES), L.SANDBOX_LIMIT_PROCESSES),
        (JobEnding(-9, 0.1, watchdog=L.SANDBOX_LIMIT_PROCESSES, usage=usage), L.SANDBOX_LIMIT_PROCESSES),
        (JobEnding(-9, 0.1, usage=CgroupUsage(0.1, 9, oom_kills=1, forks_refused=3)), L.SANDBOX_LIMIT_MEMORY),
        (JobEnding(0, 0.1, usage=CgroupUsage(0.1, 9, oom_kills=0, forks_refused=3)), L.SANDBOX_LIMIT_PROCESSES),
        # With a cgroup the job's stderr is not evidence; without one it is all there is.
        (JobEnding(1, 0.1, usage=usage, stderr=b"MemoryError"), L.SANDBOX_LIMIT_NONE),
        (JobEnding(1, 0.1, stderr=b"MemoryError"), L.SANDBOX_LIMIT_MEMORY),
        (JobEnding(0, 0.1, stderr=b"BlockingIOError: [Errno 11]"), L.SANDBOX_LIMIT_PROCESSES),
        (JobEnding(1, 0.1, file_at_limit=True, output_truncated=True), L.SANDBOX_LIMIT_FILE_SIZE),
        (JobEnding(1, 0.1, filesystem_full=True, usage=usage), L.SANDBOX_LIMIT_FILE_SIZE),
        (JobEnding(-25, 0.1), L.SANDBOX_LIMIT_FILE_SIZE),
        (JobEnding(0, 0.1, output_truncated=True), L.SANDBOX_LIMIT_OUTPUT),
        # Ended for flooding its output: whatever CPU it burnt meanwhile is not why it stopped.
        (JobEnding(-9, 2.5, watchdog=L.SANDBOX_LIMIT_OUTPUT, output_truncated=True), L.SANDBOX_LIMIT_OUTPUT),
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


def test_a_job_tree_is_read_parents_first_from_proc(tmp_path: Path) -> None:
    """CPU time of every process below the root and of the children each reaped; tasks as
    RLIMIT_NPROC counts them (threads; a zombie as one)."""
    from policyloop.sandbox.runner import CLOCK_TICKS, tree_usage

    def process(pid: int, children: list[int], ticks: tuple[int, int, int, int], threads: int) -> None:
        task = tmp_path / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)) + (" " if children else ""))
        fields = ["S", "1", *["0"] * 9, *map(str, ticks), "20", "0", str(threads), *["0"] * 30]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (weird) name) " + " ".join(fields) + "\n")

    process(10, [11], (1, 1, 0, 0), 1)         # the launcher: not counted
    process(11, [12], (2, 0, 0, 0), 1)         # bwrap
    process(12, [13, 14, 99], (5, 5, 7, 3), 3)  # the job's main process, three threads, reaped children's time
    process(13, [], (4, 0, 0, 0), 0)           # a zombie
    process(14, [], (0, 6, 0, 0), 1)
    usage = tree_usage(10, proc=tmp_path)  # 99 is listed but gone: skipped
    assert usage.cpu_seconds == pytest.approx((2 + 20 + 4 + 6) / CLOCK_TICKS) and usage.tasks == 6
    assert tree_usage(10, stop_above=3, proc=tmp_path).tasks == 4  # stops once over
    assert tree_usage(77, proc=tmp_path).tasks == 0  # a root that is gone


def test_a_refused_fork_on_stderr_is_seen_across_reads() -> None:
    from policyloop.sandbox.runner import RefusedForkSigns

    signs = RefusedForkSigns()
    signs.feed(b"x" * 100_000 + b"sh: 1: Cannot f")
    assert not signs.seen
    signs.feed(b"ork\n")
    assert signs.seen


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_denies_what_it_lists_on_each_abi(machine: str) -> None:
    """The filter's program run by a small classic-BPF interpreter, for each ABI it knows."""
    import errno
    import struct

    from policyloop.sandbox import seccomp

    abi = seccomp.ABIS[machine]
    encoded = seccomp.job_filter(machine)
    assert encoded is not None and len(encoded) % 8 == 0
    program = [struct.unpack("=HBBI", encoded[i:i + 8]) for i in range(0, len(encoded), 8)]

    def run(nr: int, arch: int) -> int:
        data, pc, a = {0: nr, 4: arch}, 0, 0
        while True:
            code, jt, jf, k = program[pc]
            if code == seccomp.LD_ABS_W:
                a = data[k]
            elif code in (seccomp.JEQ_K, seccomp.JGE_K):
                taken = a == k if code == seccomp.JEQ_K else a >= k
                pc += jt if taken else jf
            else:
                assert code == seccomp.RET_K
                return k
            pc += 1

    deny = seccomp.RET_ERRNO | errno.EPERM
    for name in seccomp.DENIED:
        assert run(abi.numbers[name], abi.audit_arch) == deny, name
    allowed = set(range(0, 460)) - set(abi.numbers.values())
    assert {run(nr, abi.audit_arch) for nr in allowed} == {seccomp.RET_ALLOW}
    assert run(abi.numbers["ptrace"], 0x40000003) == seccomp.RET_KILL_PROCESS  # i386: a foreign ABI
    if abi.x32_bit is not None:
        assert run(abi.x32_bit | 521, abi.audit_arch) == deny  # x32's ptrace
    assert seccomp.job_filter("mips") is None


def test_a_job_outcome_is_one_bounded_word() -> None:
    from policyloop.sandbox.runner import job_outcome

    assert job_outcome(bus_pb2.SandboxResult(exit_code=0)) == "ok"
    assert job_outcome(bus_pb2.SandboxResult(exit_code=1)) == "failed"
    assert job_outcome(bus_pb2.SandboxResult(exit_code=-9, limit_hit=bus_pb2.SANDBOX_LIMIT_WALL_TIME)) == "wall_time"
    assert job_outcome(bus_pb2.SandboxResult(exit_code=0, error="cannot fork")) == "error"
    names = {job_outcome(bus_pb2.SandboxResult(exit_code=-9, limit_hit=value))
             for value in bus_pb2.SandboxLimit.values() if value}
    assert names == {"wall_time", "cpu_time", "memory", "processes", "file_size", "output", "step_time",
                     "abandoned", "close_grace"}


async def test_a_closed_session_that_lingers_is_killed_for_the_grace_not_the_wall_clock(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from policyloop.sandbox import runner

    monkeypatch.setattr(runner, "CLOSE_GRACE_S", 0.05)
    loop = asyncio.get_running_loop()
    closed = loop.create_future()
    closed.set_result(bus_pb2.SANDBOX_LIMIT_NONE)  # the caller closed it
    never, flooded = loop.create_future(), loop.create_future()  # the process does not exit
    limits = runner.JobLimits(wall_seconds=60)
    ending = await runner._until_ending(never, flooded, None, closed, limits, time.monotonic())
    assert ending == (True, False, bus_pb2.SANDBOX_LIMIT_CLOSE_GRACE)
    assert runner.classify(runner.JobEnding(returncode=-9, cpu_seconds=0.1, watchdog=ending[2]), limits) \
        == bus_pb2.SANDBOX_LIMIT_CLOSE_GRACE
    # Closed with less wall time left than the grace: the wall clock is what ended it.
    ending = await runner._until_ending(never, flooded, None, closed, limits, time.monotonic() - 59.99)
    assert ending == (True, True, bus_pb2.SANDBOX_LIMIT_NONE)


async def test_a_prepared_process_out_of_protocol_is_ended_and_fails_its_sessions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It runs the environment's code: a report it cannot parse ends it, and a session waiting for
    its exit report learns that the prepared process ended, rather than wait for ever."""
    import socket

    from policyloop.sandbox.forked import ExitReport, Parent, ParentConversation, ParentFailed

    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    parent = Parent("k", tmp_path, ours, reader, writer, time.monotonic(), 60.0, ParentConversation())
    loop = asyncio.get_running_loop()
    waiting, done = loop.create_future(), loop.create_future()
    parent.exits.update({7: waiting, 8: done})
    reading = asyncio.ensure_future(parent.read_reports())
    theirs.sendall(b"exited 8 0 0.25 2048\nexited 99 0 0.1 1\nexited seven\n")
    await asyncio.wait_for(reading, 10)
    assert done.result() == ExitReport(0, 0.25, 2048 * 1024)  # reported before the bad line
    assert 99 not in parent.exits  # an orphan the namespace's init reaped: no session's
    assert parent.ended and not parent.room_for(1.0)
    with pytest.raises(ParentFailed, match="ended"):
        waiting.result()
    parent.close()
    assert parent.conversation.done.is_set()
    theirs.close()
