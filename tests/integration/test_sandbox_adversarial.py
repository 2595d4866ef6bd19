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


def python_job(code: str, files: dict[str, bytes] | None = None, **limits: float
               ) -> tuple[bus_pb2.SandboxJob, JobLimits]:
    job = bus_pb2.SandboxJob(job_id=uuid.uuid4().hex, command=["python3", "job.py"],
                             files={"job.py": code.encode(), **(files or {})})
    return job, JobLimits(**{**LIMITS.__dict__, **limits})


async def run_python(code: str, cgroups: JobCgroups | None = None, files: dict[str, bytes] | None = None,
                     **limits: float) -> bus_pb2.SandboxResult:
    job, job_limits = python_job(code, files, **limits)
    return await run_job(job, job_limits, cgroups=cgroups)


async def still_serving() -> None:
    result = await run_python("print(6 * 7)")
    assert result.exit_code == 0 and result.stdout == b"42\n" and result.limit_hit == L.SANDBOX_LIMIT_NONE


async def test_no_network_not_even_the_hosts_loopback() -> None:
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
""")
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing came in from the job
    assert b"CONNECTED" not in result.stdout and result.stdout.count(b"refused") == 3, result
    await still_serving()


async def test_a_fork_bomb_hits_the_process_limit(cgroups: JobCgroups | None) -> None:
    result = await run_python("""
import os, time
children = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
        print(children, flush=True)
    except BlockingIOError as exc:
        raise SystemExit(f"fork refused after {children}: {exc!r}")
""", cgroups, max_processes=16, wall_seconds=30)
    assert result.limit_hit == L.SANDBOX_LIMIT_PROCESSES and accounted(result, cgroups), result
    # 16 at most, the job itself included; without a cgroup the kernel lets a job have one more,
    # so that one over its limit can be seen.
    made = int(result.stdout.split()[-1])
    assert 8 <= made <= (15 if cgroups is not None else 16), result
    await still_serving()


FORK_BOMBS = {
    # Every process forks forever and shrugs off refusals: nothing on stderr, and no process ends.
    "silent": ["python3", "-c", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                "        pass\n"],
    # The classic shell bomb, its main process waiting: the bomb's processes die as forks are refused.
    "shell": ["sh", "-c", "f() { f | f & }; f; sleep 600"],
    # A main process that keeps its children and waits.
    "waiting": ["python3", "-c", "import os, time\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
                                 "            time.sleep(600)\n    except OSError:\n        pass\ntime.sleep(600)\n"],
}


@pytest.mark.parametrize("bomb", sorted(FORK_BOMBS))
async def test_a_fork_bomb_is_ended_by_the_process_limit_not_the_wall_clock(bomb: str, cgroups: JobCgroups | None
                                                                             ) -> None:
    """Whatever its processes do once forks are refused, a job that reached its process limit is
    ended and reported for it, in both modes."""
    job = bus_pb2.SandboxJob(job_id=f"bomb-{bomb}", command=FORK_BOMBS[bomb])
    limits = JobLimits(**{**LIMITS.__dict__, "max_processes": 16, "wall_seconds": 60, "cpu_seconds": 30})
    result = await run_job(job, limits, cgroups=cgroups)
    assert result.limit_hit == L.SANDBOX_LIMIT_PROCESSES and accounted(result, cgroups), result
    await still_serving()


async def test_a_memory_bomb_hits_the_memory_limit(cgroups: JobCgroups | None) -> None:
    result = await run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024**2))\n",
                              cgroups, memory_bytes=256 * 1024**2)
    assert result.exit_code != 0 and result.limit_hit == L.SANDBOX_LIMIT_MEMORY and accounted(result, cgroups), result
    if cgroups is not None:  # the kernel's count: the job filled its memory and was OOM-killed
        assert result.exit_code in (-9, 137) and 192 * 1024**2 < result.peak_memory_bytes <= 256 * 1024**2
    await still_serving()


async def test_memory_in_the_jobs_tmpfs_counts_against_its_limit(job_cgroups: JobCgroups | None) -> None:
    """/tmp is memory: with a cgroup, filling it is charged to the job (rlimits cannot see it)."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    result = await run_python("for i in range(8):\n    with open(f'/tmp/fill{i}', 'wb') as f:\n"
                              "        f.write(b'x' * 8 * 1024**2)\nprint('wrote 64 MiB')\n",
                              job_cgroups, memory_bytes=48 * 1024**2)
    assert result.limit_hit == L.SANDBOX_LIMIT_MEMORY and b"wrote" not in result.stdout, result
    assert result.peak_memory_bytes > 40 * 1024**2, result


async def test_with_a_cgroup_address_space_is_only_a_backstop(job_cgroups: JobCgroups | None) -> None:
    """Reserving address space is not using memory: with a cgroup a job may reserve more than its
    memory limit (runtimes do), up to a backstop of four times that."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    code = "import mmap\nfor gib in (1.5, 3):\n    try:\n        mmap.mmap(-1, int(gib * 1024**3))\n" \
           "        print('reserved', gib)\n    except OSError as exc:\n        print('refused', gib, exc.errno)\n"
    result = await run_python(code, job_cgroups, memory_bytes=512 * 1024**2)
    assert result.stdout == b"reserved 1.5\nrefused 3 12\n", result
    assert result.limit_hit == L.SANDBOX_LIMIT_NONE and result.peak_memory_bytes < 64 * 1024**2, result


async def test_a_job_cannot_fake_the_limit_that_stopped_it(job_cgroups: JobCgroups | None) -> None:
    """With a cgroup, limit_hit is what the kernel counted, not what the job printed (without one,
    the memory and process limits can only be read from stderr: see sandbox/runner.py)."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")
    result = await run_python("import sys\nsys.stderr.write('MemoryError\\nBlockingIOError: Resource temporarily "
                              "unavailable\\n')\nsys.exit(1)\n", job_cgroups)
    assert result.exit_code == 1 and result.limit_hit == L.SANDBOX_LIMIT_NONE, result


async def test_an_infinite_loop_hits_the_cpu_limit(cgroups: JobCgroups | None) -> None:
    result = await run_python("while True:\n    pass\n", cgroups, cpu_seconds=1.5, wall_seconds=30)
    assert result.limit_hit == L.SANDBOX_LIMIT_CPU_TIME and result.exit_code != 0, result
    assert 1.5 <= result.cpu_seconds < 3, result  # not stopped before the job's total reached the limit
    await still_serving()


async def test_the_cpu_limit_bounds_the_whole_job_not_each_process(cgroups: JobCgroups | None) -> None:
    """Four processes spinning: the job is ended when the tree as a whole has used its CPU
    seconds, whether or not any one process reached them (a watchdog, in both modes)."""
    result = await run_python("import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\n"
                              "while True:\n    pass\n", cgroups, cpu_seconds=1, wall_seconds=30)
    assert result.limit_hit == L.SANDBOX_LIMIT_CPU_TIME and accounted(result, cgroups), result
    assert 1.0 <= result.cpu_seconds < 2.5, result
    await still_serving()


async def test_processes_that_each_stay_under_the_cpu_limit_are_stopped_at_the_jobs_total(
        cgroups: JobCgroups | None) -> None:
    """Three processes each spin less than the limit, then wait: their total reaches it."""
    result = await run_python("""
import os, time
for _ in range(2):
    if os.fork() == 0:
        break
start = time.process_time()
while time.process_time() - start < 0.45:
    pass
time.sleep(600)
""", cgroups, cpu_seconds=1, wall_seconds=60)
    assert result.limit_hit == L.SANDBOX_LIMIT_CPU_TIME and accounted(result, cgroups), result
    assert 1.0 <= result.cpu_seconds < 2, result
    await still_serving()


async def test_concurrent_jobs_are_charged_their_own_cpu_time(cgroups: JobCgroups | None) -> None:
    spin = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {}:\n    pass\n"
    short, long = await asyncio.gather(run_python(spin.format(0.3), cgroups),
                                       run_python(spin.format(1.2), cgroups))
    # Each job's own CPU (its spin plus the interpreter's start), not the sandbox's children's sum.
    assert 0.3 <= short.cpu_seconds < 0.8 and 1.2 <= long.cpu_seconds < 1.7, (short, long)


async def test_a_file_over_the_size_limit_is_reported(cgroups: JobCgroups | None) -> None:
    # Anywhere the job can write, the error swallowed.
    for path in ("/tmp/big", "/dev/shm/big", "deep/er/big"):
        quiet = await run_python(f"import os\nos.makedirs('deep/er')\ntry:\n    with open('{path}', 'wb') as f:\n"
                                 "        f.write(b'x' * 4 * 1024**2)\nexcept OSError:\n    pass\n",
                                 cgroups, max_file_bytes=1024**2)
        assert quiet.exit_code == 0 and quiet.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE, (path, quiet)
    # Python ignores SIGXFSZ (the write fails with EFBIG); the file left at the limit tells.
    python = await run_python("with open('big', 'wb') as f:\n    f.write(b'x' * 4 * 1024**2)\n",
                              cgroups, max_file_bytes=1024**2)
    assert python.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and b"File too large" in python.stderr, python
    # A program that takes the signal's default is killed by SIGXFSZ.
    shell = await run_job(bus_pb2.SandboxJob(job_id="fsize", command=["sh", "-c", "head -c 4000000 /dev/zero > big"]),
                          JobLimits(**{**LIMITS.__dict__, "max_file_bytes": 1024**2}), cgroups=cgroups)
    assert shell.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and shell.exit_code != 0, shell
    await still_serving()


async def test_a_sleeping_job_hits_the_wall_clock() -> None:
    result = await run_python("import time\ntime.sleep(60)\n", wall_seconds=1.5)
    assert result.limit_hit == L.SANDBOX_LIMIT_WALL_TIME and result.wall_seconds < 5, result
    await still_serving()


async def test_huge_output_is_capped(cgroups: JobCgroups | None) -> None:
    for stream in ("stdout", "stderr"):
        result = await run_python(f"import sys\nsys.{stream}.write('x' * 10**7)\n", cgroups, max_output_bytes=4096)
        assert result.limit_hit == L.SANDBOX_LIMIT_OUTPUT and accounted(result, cgroups), result
        assert len(getattr(result, stream)) == 4096 and getattr(result, f"{stream}_truncated")
    await still_serving()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_a_job_that_floods_its_output_is_ended_at_the_cap(cgroups: JobCgroups | None, stream: str) -> None:
    """Output that never stops is ended at max_output_bytes, not at the wall clock (which would
    report WALL_TIME), with a cgroup or without."""
    result = await run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)\n", cgroups,
                              wall_seconds=60, cpu_seconds=60, max_output_bytes=4096)
    assert result.limit_hit == L.SANDBOX_LIMIT_OUTPUT and result.exit_code == -signal.SIGKILL, result
    assert accounted(result, cgroups)
    assert len(getattr(result, stream)) == 4096 and getattr(result, f"{stream}_truncated")
    await still_serving()


async def test_nothing_outside_the_scratch_directory_can_be_written() -> None:
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
""")
        assert b"WROTE" not in result.stdout and result.stdout.count(b"denied") == 6, result
        assert result.stdout.endswith(b"ok\n")
        assert list(outside.iterdir()) == []
        await still_serving()
    finally:
        shutil.rmtree(outside, ignore_errors=True)


async def test_host_secrets_are_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
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
""")
        assert b"nothing []" in result.stdout, result
        assert secret.encode() not in result.stdout + result.stderr
        assert b"POLICYLOOP" not in result.stdout  # the environment is cleared, not filtered
        await still_serving()
    finally:
        shutil.rmtree(secret_file.parent, ignore_errors=True)


async def test_other_processes_cannot_be_signalled() -> None:
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
""")
        assert victim.poll() is None, "the job killed a host process"
        # ESRCH, not EPERM: host processes do not exist in the job's pid namespace at all (its own
        # uid alone would already refuse with EPERM, which would hide a missing namespace).
        for pid in (victim.pid, os.getpid()):
            assert f"cannot {pid} {errno.ESRCH}".encode() in result.stdout, result.stdout
        await still_serving()
    finally:
        victim.kill()
        victim.wait()


def fill(directory: str) -> str:
    """Job code writing 1 MiB files into `directory` until refused; prints the errno and the total."""
    return f"""
written = 0
try:
    for i in range(24):
        with open(f"{directory}fill{{i}}", "wb") as f:
            f.write(b"x" * 1024**2)
        written += 1024**2
except OSError as exc:
    print("stopped", exc.errno)
print("written", written)
"""


async def test_the_scratch_directory_is_bounded_and_a_full_one_is_reported(cgroups: JobCgroups | None) -> None:
    """The scratch directory is a tmpfs of scratch_bytes, the job's files in it: filling it stops
    at its size (no job writes to the host's disk), and is reported as the file-size limit."""
    result = await run_python("""
import os
print(sorted(os.listdir()), open("data/in.txt").read())
""" + fill(""), cgroups, scratch_bytes=8 * 1024**2, max_file_bytes=2 * 1024**2, files={"data/in.txt": b"input"})
    assert result.stdout.startswith(b"['data', 'job.py'] input\n"), result
    assert f"stopped {errno.ENOSPC}\n".encode() in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 8 * 1024**2, result
    assert result.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and accounted(result, cgroups), result
    await still_serving()


async def test_dev_shm_is_bounded_and_the_rest_of_dev_cannot_be_written(cgroups: JobCgroups | None) -> None:
    """Without a cgroup nothing else bounds memory-backed files: /dev/shm is a tmpfs of
    shm_bytes, /dev read-only, System V shared memory refused, and no user namespace can be made
    (in which a job could mount a tmpfs of its own)."""
    result = await run_python("""
import ctypes, multiprocessing, os
libc = ctypes.CDLL(None, use_errno=True)
multiprocessing.Lock()  # POSIX semaphores live in /dev/shm: it works
for path in ("/dev/evil", "/dev/pts/evil", "/evil"):
    try:
        open(path, "w")
        print("WROTE", path)
    except OSError as exc:
        print("denied", path)
print("unshare", libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
print("shmget", libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())
""" + fill("/dev/shm/"), cgroups, shm_bytes=8 * 1024**2, max_file_bytes=2 * 1024**2)
    assert b"WROTE" not in result.stdout and result.stdout.count(b"denied") == 3, result
    assert b"unshare -1" in result.stdout and f"shmget -1 {errno.EPERM}".encode() in result.stdout, result
    assert f"stopped {errno.ENOSPC}\n".encode() in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 8 * 1024**2, result
    assert result.limit_hit == L.SANDBOX_LIMIT_FILE_SIZE and accounted(result, cgroups), result
    await still_serving()


async def test_whatever_a_job_leaves_behind_it_gets_a_result(cgroups: JobCgroups | None) -> None:
    """Deep trees, files and directories it made unreadable or unwritable, a FIFO, a symlink
    loop: the job gets its result, the next job runs, and the sandbox holds nothing of it after."""
    held = len(os.listdir("/proc/self/fd"))
    result = await run_python("""
import os
os.mkfifo("fifo")
os.symlink("loop", "loop")
for name, mode in (("locked", 0o000), ("readonly", 0o500)):
    os.mkdir(name)
    with open(f"{name}/f", "w") as f:
        f.write("x")
    os.chmod(name, mode)
with open("unreadable", "w") as f:
    f.write("x")
os.chmod("unreadable", 0)
for base in ("/job", "/tmp", "/dev/shm"):
    os.chdir(base)
    for _ in range(3000):
        os.mkdir("d")
        os.chdir("d")
os.chmod("/job/d", 0)
print("left it all")
""", cgroups, wall_seconds=60)
    assert result.exit_code == 0 and not result.error and result.stdout == b"left it all\n", result
    assert result.limit_hit == L.SANDBOX_LIMIT_NONE and accounted(result, cgroups), result
    await still_serving()
    assert len(os.listdir("/proc/self/fd")) == held  # nothing of the jobs' filesystems kept open


async def test_the_main_process_ends_the_job_whatever_its_other_processes_do(cgroups: JobCgroups | None) -> None:
    """A background process tries to take over or stop the job's main process, the init of its pid
    namespace (ptrace, its memory, SIGSTOP, SIGKILL), and starts a daemon: the job still ends when
    its main process exits, with its exit status, and leaves no process behind."""
    marker = f"{uuid.uuid4().int % 10**6 + 100}.5"
    result = await run_python(f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
read, write = os.pipe()
if os.fork() == 0:
    os.dup2(write, 1)
    for name, call in (("attach", lambda: libc.ptrace(16, 1, 0, 0)), ("seize", lambda: libc.ptrace(0x4206, 1, 0, 0)),
                       ("vm_write", lambda: libc.process_vm_writev(1, 0, 0, 0, 0, 0)),
                       ("stop", lambda: libc.kill(1, signal.SIGSTOP)), ("kill", lambda: libc.kill(1, signal.SIGKILL))):
        answer = call()
        print(name, answer, ctypes.get_errno() if answer == -1 else 0, flush=True)
    if os.fork() == 0:
        os.setsid()
        os.execvp("sh", ["sh", "-c", "echo daemon; exec sleep {marker}"])
    os.execvp("sh", ["sh", "-c", "echo background; exec sleep {marker}"])
with os.fdopen(read) as reports:
    for _ in range(7):
        print(reports.readline(), end="", flush=True)
raise SystemExit(7)
""", cgroups, wall_seconds=60)
    assert result.exit_code == 7 and result.limit_hit == L.SANDBOX_LIMIT_NONE, result
    for attempt in (b"attach", b"seize", b"vm_write"):
        assert attempt + f" -1 {errno.EPERM}\n".encode() in result.stdout, result
    assert b"daemon\n" in result.stdout and b"background\n" in result.stdout, result
    survivors = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert survivors.stdout == "", f"left behind: {survivors.stdout}"
    await still_serving()


async def test_a_background_process_does_not_outlive_its_job() -> None:
    marker = f"{uuid.uuid4().int % 10**6 + 100}.25"  # a sleep duration no one else uses
    job = bus_pb2.SandboxJob(job_id="bg", command=["sh", "-c", f"sleep {marker} & echo started $!"])
    result = await run_job(job, LIMITS)
    assert result.exit_code == 0 and result.stdout.startswith(b"started") and result.wall_seconds < 5
    survivors = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert survivors.stdout == "", f"left behind: {survivors.stdout}"
    await still_serving()



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
    assert fork_bomb.limit_hit == L.SANDBOX_LIMIT_PROCESSES, fork_bomb
    assert loop.limit_hit == L.SANDBOX_LIMIT_CPU_TIME, loop
    assert output.limit_hit == L.SANDBOX_LIMIT_OUTPUT and len(output.stdout) == 1024
    after = await run_in_sandbox(bus, job("after", "print(6 * 7)\n"))
    assert after.exit_code == 0 and after.stdout == b"42\n" and after.limit_hit == L.SANDBOX_LIMIT_NONE
    assert sandbox.proc.poll() is None


async def test_a_job_holds_no_descriptor_but_its_own_stdio(cgroups: JobCgroups | None) -> None:
    """Nothing of the sandbox's leaks into the job: not the launcher's report pipe, not the
    sandbox's sockets (a job that wrote to the report could fake its result)."""
    result = await run_python("import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n",
                              cgroups)
    assert result.stdout == b"[0, 1, 2, 3]\n", result  # 3: the listing's own directory


def test_jobs_end_with_the_sandbox_that_started_them(tmp_path: Path, cgroups: JobCgroups | None) -> None:
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
asyncio.run(run_job(job, JobLimits(wall_seconds=120), cgroups=cgroups))
"""
    script = tmp_path / "sandbox.py"  # a file: the program's text holds the marker, its argv must not
    script.write_text(program)
    sandbox = subprocess.Popen([sys.executable, str(script)])
    try:
        for _ in range(600):
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


async def test_a_job_that_cannot_be_started_says_so(job_cgroups: JobCgroups | None) -> None:
    """A cgroup the job cannot enter (here: gone) is a result with an error, not a lost job."""
    if job_cgroups is None:
        pytest.skip("this process cannot make cgroups")

    class Vanishing(JobCgroups):
        def create(self, job_name: str, *, memory_bytes: int, max_tasks: int):  # type: ignore[no-untyped-def]
            cgroup = super().create(job_name, memory_bytes=memory_bytes, max_tasks=max_tasks)
            cgroup.remove()
            return cgroup

    job, limits = python_job("print('ran')")
    result = await run_job(job, limits, cgroups=Vanishing(job_cgroups.parents))
    assert result.error.startswith("the job could not be started in its cgroup") and result.stdout == b"", result
    await still_serving()


async def test_a_wall_clock_that_ends_before_the_job_starts(cgroups: JobCgroups | None) -> None:
    """A kill that comes before the launcher could pass it on is still the wall clock's."""
    for _ in range(5):
        result = await run_python("import time\ntime.sleep(30)\n", cgroups, wall_seconds=0.001)
        assert result.limit_hit == L.SANDBOX_LIMIT_WALL_TIME and not result.error and result.wall_seconds < 5, result
    await still_serving()


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
