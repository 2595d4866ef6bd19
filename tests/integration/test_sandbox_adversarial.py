"""Hostile jobs against the real sandbox (bubblewrap namespaces, a cgroup per job where this
process can make one, rlimits): each is contained, the result says which limit fired, and the
sandbox goes on serving. The limit cases run twice: with the job's cgroup (the kernel's count)
and on rlimits alone (what a sandbox without cgroups has)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox import cgroups as sandbox_cgroups
from policyloop.sandbox.cgroups import JobCgroups
from policyloop.sandbox.runner import JobLimits, SandboxUnavailable, check_isolation, run_job
from tests.conftest import ServiceLauncher

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

if not Path("/usr/bin/python3").exists():  # pragma: no cover - the jobs use the system interpreter
    pytest.skip("no /usr/bin/python3 for the jobs", allow_module_level=True)

L = bus_pb2.SandboxLimit
LIMITS = JobLimits(wall_seconds=10, cpu_seconds=3, memory_bytes=256 * 1024**2, max_processes=24,
                   max_output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def job_cgroups() -> Iterator[JobCgroups | None]:
    cgroups = sandbox_cgroups.job_cgroups("auto")
    yield cgroups
    if cgroups is not None:
        cgroups.remove_parents()


@pytest.fixture(params=["cgroup", "rlimit"])
def cgroups(request: pytest.FixtureRequest, job_cgroups: JobCgroups | None) -> JobCgroups | None:
    """Each limit case with the job's cgroup and without (rlimits alone)."""
    if request.param == "rlimit":
        return None
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    return job_cgroups


def accounted(result: bus_pb2.SandboxResult, cgroups: JobCgroups | None) -> bool:
    return result.accounting == (bus_pb2.SANDBOX_ACCOUNTING_RLIMIT if cgroups is None
                                 else bus_pb2.SANDBOX_ACCOUNTING_CGROUP)


@pytest.fixture
def scratch_root() -> Iterator[Path]:
    """A scratch root the unprivileged job user can traverse (pytest's own is root-only)."""
    root = Path(tempfile.mkdtemp(prefix="pl-sandbox-adv-"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def python_job(code: str, **limits: float) -> tuple[bus_pb2.SandboxJob, JobLimits]:
    job = bus_pb2.SandboxJob(job_id=uuid.uuid4().hex, command=["python3", "job.py"],
                             files={"job.py": code.encode()})
    return job, JobLimits(**{**LIMITS.__dict__, **limits})


async def run_python(code: str, scratch_root: Path, cgroups: JobCgroups | None = None,
                     **limits: float) -> bus_pb2.SandboxResult:
    job, job_limits = python_job(code, **limits)
    return await run_job(job, job_limits, scratch_root, cgroups=cgroups)


async def still_serving(scratch_root: Path) -> None:
    result = await run_python("print(6 * 7)", scratch_root)
    assert result.exit_code == 0 and result.stdout == b"42\n" and result.limit_hit == L.SANDBOX_LIMIT_NONE


async def test_no_network_not_even_the_hosts_loopback(scratch_root: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result = await run_python(f"""
import socket
for address in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
    try:
        socket.create_connection(address, timeout=2)
        print("CONNECTED", address)
    except OSError as exc:
        print("refused", address, exc.errno)
""", scratch_root)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing came in from the job
    assert b"CONNECTED" not in result.stdout and result.stdout.count(b"refused") == 3, result
    await still_serving(scratch_root)


async def test_a_fork_bomb_hits_the_process_limit(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    result = await run_python("""
import os, time
children = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
    except BlockingIOError as exc:
        raise SystemExit(f"fork refused after {children}: {exc!r}")
""", scratch_root, cgroups, max_processes=16)
    assert result.limit_hit == L.SANDBOX_LIMIT_PROCESSES and accounted(result, cgroups), result
    refused_after = int(result.stderr.split(b"fork refused after ")[1].split(b":")[0])
    assert 8 <= refused_after <= 15 and result.wall_seconds < 9, result  # 16 at most, the job itself included
    await still_serving(scratch_root)


async def test_a_memory_bomb_hits_the_memory_limit(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    result = await run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024**2))\n",
                              scratch_root, cgroups, memory_bytes=256 * 1024**2)
    assert result.exit_code != 0 and result.limit_hit == L.SANDBOX_LIMIT_MEMORY and accounted(result, cgroups), result
    if cgroups is not None:  # the kernel's count: the job filled its memory and was OOM-killed
        assert result.exit_code in (-9, 137) and 192 * 1024**2 < result.peak_memory_bytes <= 256 * 1024**2
    await still_serving(scratch_root)


async def test_memory_in_the_jobs_tmpfs_counts_against_its_limit(scratch_root: Path, job_cgroups: JobCgroups | None
                                                                  ) -> None:
    """/tmp is memory: with a cgroup, filling it is charged to the job (rlimits cannot see it)."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    result = await run_python("for i in range(8):\n    with open(f'/tmp/fill{i}', 'wb') as f:\n"
                              "        f.write(b'x' * 8 * 1024**2)\nprint('wrote 64 MiB')\n",
                              scratch_root, job_cgroups, memory_bytes=48 * 1024**2)
    assert result.limit_hit == L.SANDBOX_LIMIT_MEMORY and b"wrote" not in result.stdout, result
    assert result.peak_memory_bytes > 40 * 1024**2, result


async def test_with_a_cgroup_address_space_is_only_a_backstop(scratch_root: Path, job_cgroups: JobCgroups | None
                                                             ) -> None:
    """Reserving address space is not using memory: with a cgroup a job may reserve more than its
    memory limit (runtimes do), up to a backstop of four times that."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    code = "import mmap\nfor gib in (1.5, 3):\n    try:\n        mmap.mmap(-1, int(gib * 1024**3))\n" \
           "        print('reserved', gib)\n    except OSError as exc:\n        print('refused', gib, exc.errno)\n"
    result = await run_python(code, scratch_root, job_cgroups, memory_bytes=512 * 1024**2)
    assert result.stdout == b"reserved 1.5\nrefused 3 12\n", result
    assert result.limit_hit == L.SANDBOX_LIMIT_NONE and result.peak_memory_bytes < 64 * 1024**2, result


async def test_a_job_cannot_fake_the_limit_that_stopped_it(scratch_root: Path, job_cgroups: JobCgroups | None
                                                            ) -> None:
    """With a cgroup, limit_hit is what the kernel counted, not what the job printed (without one,
    the memory and process limits can only be read from stderr: see sandbox/runner.py)."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    result = await run_python("import sys\nsys.stderr.write('MemoryError\\nBlockingIOError: Resource temporarily "
                              "unavailable\\n')\nsys.exit(1)\n", scratch_root, job_cgroups)
    assert result.exit_code == 1 and result.limit_hit == L.SANDBOX_LIMIT_NONE, result


async def test_an_infinite_loop_hits_the_cpu_limit(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    result = await run_python("while True:\n    pass\n", scratch_root, cgroups, cpu_seconds=1, wall_seconds=10)
    assert result.limit_hit == L.SANDBOX_LIMIT_CPU_TIME and result.exit_code != 0, result
    assert result.wall_seconds < 8 and 1.0 <= result.cpu_seconds < 3, result
    await still_serving(scratch_root)


async def test_the_cpu_limit_bounds_the_whole_job_not_each_process(scratch_root: Path,
                                                                   job_cgroups: JobCgroups | None) -> None:
    """Four processes spinning: each stays under a per-process limit, the job's total does not.
    The cgroup's watchdog ends the job when the tree as a whole has used its CPU seconds."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    result = await run_python("import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\n"
                              "while True:\n    pass\n", scratch_root, job_cgroups, cpu_seconds=2, wall_seconds=20)
    assert result.limit_hit == L.SANDBOX_LIMIT_CPU_TIME, result
    # Two cores: four spinners reach 2 CPU seconds in about 1 s of wall time, long before any
    # one of them reaches its own 2 s.
    assert 2.0 <= result.cpu_seconds < 3.5 and result.wall_seconds < 10, result
    await still_serving(scratch_root)


async def test_concurrent_jobs_are_charged_their_own_cpu_time(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    spin = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {}:\n    pass\n"
    short, long = await asyncio.gather(run_python(spin.format(0.3), scratch_root, cgroups),
                                       run_python(spin.format(1.2), scratch_root, cgroups))
    # Each job's own CPU (its spin plus the interpreter's start), not the sandbox's children's sum.
    assert 0.3 <= short.cpu_seconds < 0.8 and 1.2 <= long.cpu_seconds < 1.7, (short, long)


async def test_a_file_over_the_size_limit_is_reported(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    # Python ignores SIGXFSZ (the write fails with EFBIG); the file left at the limit tells.
    python = await run_python("with open('big', 'wb') as f:\n    f.write(b'x' * 4 * 1024**2)\n",
                              scratch_root, cgroups, max_file_bytes=1024**2)
    assert python.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and b"File too large" in python.stderr, python
    # A program that takes the signal's default is killed by SIGXFSZ.
    shell = await run_job(bus_pb2.SandboxJob(job_id="fsize", command=["sh", "-c", "head -c 4000000 /dev/zero > big"]),
                          JobLimits(**{**LIMITS.__dict__, "max_file_bytes": 1024**2}), scratch_root, cgroups=cgroups)
    assert shell.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and shell.exit_code != 0, shell
    await still_serving(scratch_root)


async def test_a_sleeping_job_hits_the_wall_clock(scratch_root: Path) -> None:
    result = await run_python("import time\ntime.sleep(60)\n", scratch_root, wall_seconds=1.5)
    assert result.limit_hit == L.SANDBOX_LIMIT_WALL_TIME and result.wall_seconds < 5, result
    await still_serving(scratch_root)


async def test_huge_output_is_capped(scratch_root: Path) -> None:
    result = await run_python("import sys\nsys.stdout.write('x' * 10**7)\nsys.stderr.write('y' * 10**6)\n",
                              scratch_root, max_output_bytes=4096)
    assert result.limit_hit == L.SANDBOX_LIMIT_OUTPUT
    assert len(result.stdout) == 4096 and result.stdout_truncated and result.stderr_truncated
    await still_serving(scratch_root)


async def test_nothing_outside_the_scratch_directory_can_be_written(scratch_root: Path) -> None:
    outside = Path(tempfile.mkdtemp(prefix="pl-outside-"))
    outside.chmod(0o777)  # writable by anyone on the host, yet not from the job
    try:
        result = await run_python(f"""
import os
for path in ("/usr/evil", "/evil", "/proc/evil", "{outside}/evil", "/job/../evil", "/etc/passwd"):
    try:
        with open(path, "w") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as exc:
        print("denied", path, exc.errno)
with open("inside.txt", "w") as f:
    f.write("ok")
print(open("inside.txt").read())
""", scratch_root)
        assert b"WROTE" not in result.stdout and result.stdout.count(b"denied") == 6, result
        assert result.stdout.endswith(b"ok\n")
        assert list(outside.iterdir()) == []
        await still_serving(scratch_root)
    finally:
        shutil.rmtree(outside, ignore_errors=True)


async def test_host_secrets_are_out_of_reach(scratch_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = uuid.uuid4().hex
    monkeypatch.setenv("POLICYLOOP_TEST_SECRET", secret)  # in the sandbox service's environment
    secret_file = Path(tempfile.mkdtemp(prefix="pl-secret-")) / "token"
    secret_file.parent.chmod(0o755)
    secret_file.write_text(secret)
    secret_file.chmod(0o644)  # readable by anyone on the host
    try:
        result = await run_python(f"""
import glob, os
found = [k for k, v in os.environ.items() if "{secret}" in v]
for path in ["{secret_file}", "/proc/1/environ", *glob.glob("/proc/*/environ"), "/etc/shadow", "/root/.bashrc"]:
    try:
        if "{secret}" in open(path, errors="replace").read():
            found.append(path)
    except OSError:
        pass
print("visible pids:", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("LEAKED" if found else "nothing", found)
print(sorted(os.environ))
""", scratch_root)
        assert b"nothing []" in result.stdout, result
        assert secret.encode() not in result.stdout + result.stderr
        assert b"POLICYLOOP" not in result.stdout  # the environment is cleared, not filtered
        await still_serving(scratch_root)
    finally:
        shutil.rmtree(secret_file.parent, ignore_errors=True)


async def test_other_processes_cannot_be_signalled(scratch_root: Path) -> None:
    # A host process of the very user the jobs run as: outside the job's pid namespace.
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"] if os.geteuid() == 0 else []
    victim = subprocess.Popen([*drop, "sleep", "60"])
    try:
        result = await run_python(f"""
import os, signal
for pid in ({victim.pid}, {os.getpid()}, 1):
    try:
        os.kill(pid, signal.SIGKILL if pid != 1 else 0)
        print("signalled", pid)
    except OSError as exc:
        print("cannot", pid, exc.errno)
""", scratch_root)
        assert victim.poll() is None, "the job killed a host process"
        # ESRCH, not EPERM: host processes do not exist in the job's pid namespace at all (its own
        # uid alone would already refuse with EPERM, which would hide a missing namespace).
        for pid in (victim.pid, os.getpid()):
            assert f"cannot {pid} {errno.ESRCH}".encode() in result.stdout, result.stdout
        await still_serving(scratch_root)
    finally:
        victim.kill()
        victim.wait()


async def test_a_background_process_does_not_outlive_its_job(scratch_root: Path) -> None:
    marker = f"{uuid.uuid4().int % 10**6 + 100}.25"  # a sleep duration no one else uses
    job = bus_pb2.SandboxJob(job_id="bg", command=["sh", "-c", f"sleep {marker} & echo started $!"])
    result = await run_job(job, LIMITS, scratch_root)
    assert result.exit_code == 0 and result.stdout.startswith(b"started") and result.wall_seconds < 5
    survivors = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert survivors.stdout == "", f"left behind: {survivors.stdout}"
    await still_serving(scratch_root)



async def test_the_sandbox_service_keeps_serving_through_hostile_jobs(bus: Bus, services: ServiceLauncher) -> None:
    """The same containment through the running service: hostile jobs requested over the SANDBOX
    stream come back with the limit that stopped them, and the replica answers the next job."""
    from policyloop.sandbox.client import run_in_sandbox

    sandbox = services.start("sandbox", env={"POLICYLOOP_CONCURRENCY": "2"})
    await services.wait_healthy(sandbox, timeout_s=60)

    def job(job_id: str, source: str, **limits: float) -> bus_pb2.SandboxJob:
        return bus_pb2.SandboxJob(job_id=job_id, run_id="hostile", files={"main.py": source.encode()},
                                  command=["python3", "-I", "main.py"],
                                  limits=bus_pb2.SandboxLimits(**{"wall_seconds": 10, "cpu_seconds": 3,
                                                                  "max_processes": 24, **limits}))

    fork_bomb, loop, output = await asyncio.gather(
        run_in_sandbox(bus, job("fork", "import os\nwhile True:\n    os.fork()\n")),
        run_in_sandbox(bus, job("loop", "while True: pass\n", cpu_seconds=1, wall_seconds=5)),
        run_in_sandbox(bus, job("output", "print('x' * 10**7)\n", max_output_bytes=1024)),
    )
    assert fork_bomb.limit_hit in (L.SANDBOX_LIMIT_PROCESSES, L.SANDBOX_LIMIT_WALL_TIME), fork_bomb
    assert loop.limit_hit == L.SANDBOX_LIMIT_CPU_TIME, loop
    assert output.limit_hit == L.SANDBOX_LIMIT_OUTPUT and len(output.stdout) == 1024
    after = await run_in_sandbox(bus, job("after", "print(6 * 7)\n"))
    assert after.exit_code == 0 and after.stdout == b"42\n" and after.limit_hit == L.SANDBOX_LIMIT_NONE
    assert sandbox.proc.poll() is None


async def test_a_job_holds_no_descriptor_but_its_own_stdio(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    """Nothing of the sandbox's leaks into the job: not the launcher's report pipe, not the
    sandbox's sockets (a job that wrote to the report could fake its result)."""
    result = await run_python("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n",
                              scratch_root, cgroups)
    assert result.stdout == b"[0, 1, 2, 3]\n", result  # 3: the listing's own directory


def test_jobs_end_with_the_sandbox_that_started_them(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    """A sandbox killed outright (SIGKILL: no cleanup) takes its running jobs with it."""
    marker = f"{uuid.uuid4().int % 10**6 + 100}.75"
    program = f"""
import asyncio, sys
from pathlib import Path
from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import JobCgroups
from policyloop.sandbox.runner import JobLimits, run_job
cgroups = JobCgroups.for_this_process() if {cgroups is not None} else None
job = bus_pb2.SandboxJob(job_id="orphan", command=["sh", "-c", "sleep {marker} & sleep {marker}"])
asyncio.run(run_job(job, JobLimits(wall_seconds=120), Path({str(scratch_root)!r}), cgroups=cgroups))
"""
    script = scratch_root / "sandbox.py"  # a file: the program's text holds the marker, its argv must not
    script.write_text(program)
    sandbox = subprocess.Popen([sys.executable, str(script)])
    try:
        for _ in range(100):
            if subprocess.run(["pgrep", "-f", f"^sleep {marker}"], capture_output=True).stdout:  # the job's own
                break
            time.sleep(0.1)
        else:
            pytest.fail("the job never started")
    finally:
        sandbox.kill()
        sandbox.wait()
    for _ in range(50):
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.1)
    assert left == "", f"outlived the sandbox: {left}"


async def test_a_job_that_cannot_be_started_says_so(scratch_root: Path, job_cgroups: JobCgroups | None) -> None:
    """A cgroup the job cannot enter (here: gone) is a result with an error, not a lost job."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")

    class Vanishing(JobCgroups):
        def create(self, job_name: str, *, memory_bytes: int, max_tasks: int):  # type: ignore[no-untyped-def]
            cgroup = super().create(job_name, memory_bytes=memory_bytes, max_tasks=max_tasks)
            cgroup.remove()
            return cgroup

    job, limits = python_job("print('ran')")
    result = await run_job(job, limits, scratch_root, cgroups=Vanishing(job_cgroups.parents))
    assert result.error.startswith("the job could not be started in its cgroup") and result.stdout == b"", result
    await still_serving(scratch_root)


async def test_a_wall_clock_that_ends_before_the_job_starts(scratch_root: Path, cgroups: JobCgroups | None) -> None:
    """A kill that comes before the launcher could pass it on is still the wall clock's."""
    for _ in range(5):
        result = await run_python("import time\ntime.sleep(30)\n", scratch_root, cgroups, wall_seconds=0.001)
        assert result.limit_hit == L.SANDBOX_LIMIT_WALL_TIME and not result.error and result.wall_seconds < 5, result
    await still_serving(scratch_root)


def test_a_new_sandbox_ends_what_a_dead_one_left_in_its_cgroups(job_cgroups: JobCgroups | None) -> None:
    """A sandbox killed while starting a job may leave the job running in its cgroup, unwatched:
    the next sandbox on the host kills it and removes the cgroups."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now: the dead sandbox's
    dead = JobCgroups({c: p.with_name(f"policyloop-sandbox-{gone.pid}") for c, p in job_cgroups.parents.items()})
    left = dead.create("job-left", memory_bytes=64 * 1024**2, max_tasks=8)
    orphan = subprocess.Popen(["sleep", "60"])
    try:
        for procs in left.procs_files:
            Path(procs).write_text(str(orphan.pid))
        sandbox_cgroups.job_cgroups("required").remove_parents()  # a new sandbox starting
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert not any(p.exists() for p in dead.parents.values())
    finally:
        orphan.kill()
        orphan.wait()
