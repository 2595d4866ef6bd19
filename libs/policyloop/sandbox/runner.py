"""Runs one job in isolation and reports how it ended.

Isolation is bubblewrap's (`bwrap` 0.8 or later, Debian package `bubblewrap`): the job gets its
own user, network (no interfaces but a down loopback), pid, mount, ipc, uts and cgroup
namespaces, and cannot make user namespaces of its own (`--disable-userns`), so it cannot mount
anything either. Its filesystem is a read-only root holding only /usr (and the /bin, /lib,
/lib64, /sbin links), its own /proc, a read-only minimal /dev, and three size-limited tmpfs, the
only places it can write: its scratch directory /job (`scratch_bytes`), /tmp (`tmp_bytes`) and
/dev/shm (`shm_bytes`). The job's files are copied into /job by bwrap from memory files, so
nothing of a job is ever on the host's disk. No host file outside /usr is visible (no /etc,
/home, /root, no other process's /proc). The environment is cleared. When the sandbox runs as
root the job runs as an unprivileged uid of its own (JobUids), so rlimits on processes bind, and
bind per job.

The job's main process is the init of its pid namespace (`--as-pid-1`): when it exits, the
kernel ends every other process of the job, and bwrap reports its exit status. (Orphans are the
main process's to reap: unreaped, they count against the process limit until it exits.) A
seccomp filter (policyloop.sandbox.seccomp) denies ptrace, other processes' memory and System V
shared memory, so no process of the job can stop the main process or take it over. A wall-clock
timeout kills bwrap, and with it (--die-with-parent) the whole job. Output is capped: a job
whose stdout or stderr passes `max_output_bytes` is ended there and reported OUTPUT.

Limits and accounting. Where the sandbox can make cgroups (policyloop.sandbox.cgroups), each job
runs in its own: memory (resident, its tmpfs included) and tasks are bounded for the whole job,
CPU time is the kernel's count for the whole process tree, and `limit_hit` reports what the
kernel counted (an OOM kill, a refused fork). Without cgroups, rlimits bound each process
(address space) and the uid's processes, CPU time is what the launcher
(policyloop.sandbox.launcher) counted of all it reaped, and memory can only be read from the
job's stderr. Either way a watchdog bounds the whole job's CPU time and processes: with a cgroup
it reads the kernel's counts, without one it walks the job's process tree in /proc and reads its
stderr as it comes. A job whose CPU time reaches the limit, or that was refused a process
(cgroup: counted; rlimits: said on its stderr) or is seen over its process limit (RLIMIT_NPROC is
one above it, so that this can show), is ended and reported so; per-process rlimits stay as
backstops. The result says which accounting it had.

Files. rlimits bound file size and open files. While bwrap holds the set-up job before starting
it (`--block-fd`), the sandbox opens the job's three filesystems through /proc/PID/root; they
stay readable after the job's namespaces are gone, so a file that reached max_file_bytes
(Python ignores SIGXFSZ, so the signal alone would miss it) or a filesystem that filled up is
reported as FILE_SIZE. Closing them frees them: there is nothing to remove after a job, whatever
it left (deep trees, files it made unreadable).

`run_job` never raises for anything a job does: a job that cannot be set up (files that clash or
do not fit), started or run is a result with `error` set.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Protocol

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import BWRAP_TASKS, CgroupUsage, JobCgroup, JobCgroups
from policyloop.sandbox.launcher import enter_job
from policyloop.sandbox.seccomp import job_filter
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)
LAUNCHER = Path(__file__).with_name("launcher.py")  # runs each job without a cgroup (standard library only)

UNPRIVILEGED_UID = 65534  # nobody: the isolation probe's user
JOB_DIR = "/job"           # the scratch directory, as the job sees it
JOB_FILESYSTEMS = (JOB_DIR, "/tmp", "/dev/shm")  # all a job can write to: a tmpfs each
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"
SECCOMP_FILTER = job_filter()
SETUP_POLL_S = 0.0002      # how often the sandbox looks whether bwrap has set a job up (a few ms)
L = bus_pb2.SandboxLimit


@dataclass(frozen=True)
class JobLimits:
    wall_seconds: float = 10.0
    cpu_seconds: float = 5.0           # the whole job's (a watchdog; per process only as a backstop)
    memory_bytes: int = 512 * 1024**2  # resident, whole job (cgroup); else address space per process
    max_processes: int = 32            # the job's own tasks (bwrap's one is not counted)
    max_file_bytes: int = 16 * 1024**2
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    scratch_bytes: int = 64 * 1024**2  # size of the job's scratch directory /job (memory)
    tmp_bytes: int = 64 * 1024**2      # size of its /tmp (memory)
    shm_bytes: int = 64 * 1024**2      # size of its /dev/shm (memory)


@dataclass
class JobFds:
    """Descriptors bwrap reads while it sets a job up; their numbers are the same in bwrap."""
    files: list[tuple[str, int]] = field(default_factory=list)  # the job's files: path below /job, memory file
    seccomp: int | None = None  # the seccomp filter
    info: int | None = None     # bwrap writes the pid of the job's main process here
    block: int | None = None    # bwrap waits for a byte here, the job set up, before starting it

    def passed(self) -> list[int]:
        return [fd for _, fd in self.files] + [fd for fd in (self.seccomp, self.info, self.block) if fd is not None]

    def close(self) -> None:
        """Closes the sandbox's copies (once bwrap has its own)."""
        for fd in self.passed():
            os.close(fd)


def isolation_command(limits: JobLimits, fds: JobFds, read_only: Sequence[tuple[Path, str]] = ()) -> list[str]:
    """bwrap's arguments for a job (see the module docstring); `read_only` host directories are
    bound read-only where the job sees them (its dependencies)."""
    command = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
               "--new-session", "--ro-bind", "/usr", "/usr"]
    for host, seen_at in read_only:
        command += ["--ro-bind", str(host), seen_at]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged /usr: the top-level names are links
        target = Path("/") / link
        if target.is_symlink():
            command += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.exists():
            command += ["--ro-bind", str(target), f"/{link}"]
    # /dev is a tmpfs of bwrap's, unbounded: read-only, with a bounded /dev/shm of its own.
    command += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.shm_bytes), "--tmpfs", "/dev/shm",
                "--remount-ro", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
                "--size", str(limits.scratch_bytes), "--tmpfs", JOB_DIR]
    for path, fd in fds.files:
        command += ["--file", str(fd), f"{JOB_DIR}/{path}"]
    for option, fd in (("--seccomp", fds.seccomp), ("--info-fd", fds.info), ("--block-fd", fds.block)):
        if fd is not None:
            command += [option, str(fd)]
    command += ["--chdir", JOB_DIR, "--remount-ro", "/", "--clearenv", "--setenv", "PATH", JOB_PATH,
                "--setenv", "HOME", JOB_DIR, "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp", "--"]
    return command


def _memory_file(data: bytes) -> int:
    """A memory file holding `data`, read from its start (bwrap copies it into the job)."""
    fd = os.memfd_create("policyloop-sandbox", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate jobs; the sandbox refuses to run them unisolated."""


def effective_limits(requested: bus_pb2.SandboxLimits, defaults: JobLimits, ceiling: JobLimits) -> JobLimits:
    """The job's requested limits, defaults where it asked for none, never above the ceiling."""
    merged = {}
    for name in requested.DESCRIPTOR.fields_by_name:
        asked = getattr(requested, name)
        value = asked if asked else getattr(defaults, name)
        merged[name] = min(value, getattr(ceiling, name))
    return replace(defaults, **merged)


def check_isolation() -> None:
    """Raises SandboxUnavailable unless bubblewrap can isolate a job here (as the job's user)."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("bubblewrap is not installed (Debian: apt-get install bubblewrap)")
    if SECCOMP_FILTER is None:
        log.warning("sandbox_without_seccomp", reason="no syscall numbers for this machine's ABI",
                    consequence="a job's processes can ptrace its main process")
    fds = JobFds(seccomp=_memory_file(SECCOMP_FILTER) if SECCOMP_FILTER is not None else None)
    try:
        probe = subprocess.run([*_drop_privileges(), *isolation_command(JobLimits(), fds), "true"],
                               capture_output=True, timeout=10, pass_fds=fds.passed())
    finally:
        fds.close()
    if probe.returncode != 0:
        raise SandboxUnavailable(f"bwrap (0.8 or later) cannot create the job's namespaces: "
                                 f"{probe.stderr.decode(errors='replace').strip()}")


def _drop_privileges(uid: int = UNPRIVILEGED_UID) -> list[str]:
    """Namespaces are created by bwrap as the job's own unprivileged user (user namespaces)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


class JobUids:
    """The uids jobs run as, taken in turn from [base, base + count).

    RLIMIT_NPROC counts the processes of a uid, zombies included. Were every job the same user,
    concurrent jobs would share one process budget, and so would the exited processes of earlier
    jobs that are not reaped yet. A uid per job, in turn over a large range, gives each job its
    own budget (and the sandbox's process-limit watchdog a count that is the job's alone).
    Replicas sharing a kernel should use disjoint ranges."""

    def __init__(self, base: int = 200_000, count: int = 4096) -> None:
        if base <= 0 or count <= 0:
            raise ValueError("job uids: base and count must be positive")
        self.base, self.count = base, count
        self._turn = itertools.count()

    def next(self) -> int:
        return self.base + next(self._turn) % self.count


DEFAULT_UIDS = JobUids()


def job_rlimits(limits: JobLimits, cgrouped: bool, passed_fds: int = 0) -> list[tuple[int, int, int]]:
    """The rlimits of the job's processes (resource, soft, hard); bwrap runs under them too, with
    `passed_fds` descriptors to read while it sets the job up."""
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    # NPROC counts per uid and binds only for non-root: the job runs as an unprivileged uid. With
    # a cgroup it is only a backstop, above pids.max, so that the counted limit fires first;
    # without one it is one above the job's limit, so that the watchdog can see a job over it.
    nproc = limits.max_processes + BWRAP_TASKS + (16 if cgrouped else 1)
    open_files = max(limits.max_open_files, passed_fds + 16)
    rlimits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # per process: the watchdog bounds the job
        (resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes),
        (resource.RLIMIT_NOFILE, open_files, open_files),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, nproc, nproc),
    ]
    # Without a memory cgroup the address space of each process is all that can be bounded. With
    # one, address space is only a backstop well above it: runtimes reserve far more address space
    # than they touch, and the cgroup bounds (and counts) what they do touch.
    address_space = limits.memory_bytes if not cgrouped else max(4 * limits.memory_bytes, 1024**3)
    rlimits.append((resource.RLIMIT_AS, address_space, address_space))
    return rlimits


async def _read_capped(stream: asyncio.StreamReader, cap: int, watch: Callable[[bytes], None] | None = None,
                       overflow: asyncio.Event | None = None) -> tuple[bytes, bool]:
    """Keeps the first `cap` bytes; sets `overflow` once there were more (the job is then ended),
    and reads on until the stream closes so that the job never blocks on a full pipe meanwhile."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        if watch is not None:
            watch(chunk)
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
            if overflow is not None:
                overflow.set()
        kept += chunk[: max(0, room)]
    return bytes(kept), truncated


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the job did not read all of its stdin: its business


# What a job's stderr says when the kernel refused it memory or a process (the rlimits answer
# ENOMEM / EAGAIN: the job sees the error, there is no signal to read). Only used without cgroups.
_MEMORY_SIGNS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_PROCESS_SIGNS = (b"Resource temporarily unavailable", b"Cannot fork", b"can't fork", b"fork: retry",
                  b"BlockingIOError")


class RefusedForkSigns:
    """Whether a job's stderr has shown a refused fork so far (read as it arrives; without a
    cgroup, nothing else says a fork was refused)."""

    def __init__(self) -> None:
        self.seen = False
        self._tail = b""  # a sign may be split between two reads

    def feed(self, chunk: bytes) -> None:
        window = self._tail + chunk
        self.seen = self.seen or any(sign in window for sign in _PROCESS_SIGNS)
        self._tail = window[-64:]


@dataclass(frozen=True)
class JobEnding:
    """What is known of how a job ended, for telling which limit stopped it."""
    returncode: int
    cpu_seconds: float             # the whole job's
    timed_out: bool = False
    watchdog: int = L.SANDBOX_LIMIT_NONE  # the job-wide limit it was ended for (CPU, processes, output)
    output_truncated: bool = False
    file_at_limit: bool = False    # a file of the job reached max_file_bytes
    filesystem_full: bool = False  # its scratch directory, /tmp or /dev/shm filled up
    usage: CgroupUsage | None = None  # the kernel's count, when the job had a cgroup
    stderr: bytes = b""


def job_outcome(result: bus_pb2.SandboxResult) -> str:
    """One word for how a job ended (the label of policyloop_sandbox_jobs_total)."""
    if result.error:
        return "error"
    if result.limit_hit != bus_pb2.SANDBOX_LIMIT_NONE:
        return bus_pb2.SandboxLimit.Name(result.limit_hit).removeprefix("SANDBOX_LIMIT_").lower()
    return "ok" if result.exit_code == 0 else "failed"


def classify(ending: JobEnding, limits: JobLimits) -> bus_pb2.SandboxLimit:
    """The limit that stopped the job (or that it ran into), most decisive first."""
    if ending.timed_out:
        return L.SANDBOX_LIMIT_WALL_TIME
    if ending.watchdog in (L.SANDBOX_LIMIT_STEP_TIME, L.SANDBOX_LIMIT_ABANDONED, L.SANDBOX_LIMIT_CLOSE_GRACE):
        return ending.watchdog
    if ending.watchdog == L.SANDBOX_LIMIT_OUTPUT:  # ended for its output: what it used meanwhile is moot
        return L.SANDBOX_LIMIT_OUTPUT
    # The kernel ends a process over its CPU rlimit (the backstop) with SIGXCPU, then SIGKILL.
    if (ending.watchdog == L.SANDBOX_LIMIT_CPU_TIME or ending.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
            or ending.cpu_seconds >= limits.cpu_seconds):
        return L.SANDBOX_LIMIT_CPU_TIME
    if ending.watchdog == L.SANDBOX_LIMIT_PROCESSES:
        return L.SANDBOX_LIMIT_PROCESSES
    if ending.usage is not None:
        if ending.usage.oom_kills:
            return L.SANDBOX_LIMIT_MEMORY
        if ending.usage.forks_refused:
            return L.SANDBOX_LIMIT_PROCESSES
    else:
        if ending.returncode != 0 and any(sign in ending.stderr for sign in _MEMORY_SIGNS):
            return L.SANDBOX_LIMIT_MEMORY
        if any(sign in ending.stderr for sign in _PROCESS_SIGNS):
            return L.SANDBOX_LIMIT_PROCESSES
    if (ending.file_at_limit or ending.filesystem_full
            or ending.returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ)):
        return L.SANDBOX_LIMIT_FILE_SIZE
    if ending.output_truncated:
        return L.SANDBOX_LIMIT_OUTPUT
    return L.SANDBOX_LIMIT_NONE


def file_reached(directory: Path, size: int, max_entries: int = 100_000) -> bool:
    """Whether a regular file below `directory` is `size` bytes or more: RLIMIT_FSIZE stops every
    write at the limit, so a file that hit it is left exactly that long. (A job could also make
    such a file on purpose, which only reports a limit against itself.) Looks at `max_entries`
    entries at most, iteratively, skipping what it cannot read (paths too deep included)."""
    pending = [directory]
    while pending and max_entries > 0:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        max_entries -= len(entries)
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size >= size:
                    return True
            except OSError:
                continue
    return False


@dataclass
class JobSetup:
    """What the sandbox learnt while bwrap set a job up."""
    filesystems: dict[str, int] = field(default_factory=dict)  # the job's JOB_FILESYSTEMS, held open
    failed: bool = False  # bwrap ended before the job was set up (it never started)

    def release(self) -> None:
        for fd in self.filesystems.values():
            os.close(fd)
        self.filesystems = {}


def hold_job_filesystems(info_fd: int, block_fd: int, deadline: float) -> JobSetup:
    """Opens the filesystems of a job that bwrap has set up and holds before starting it, then
    lets it start. Opened through /proc/PID/root, they stay readable after the job's namespaces
    are gone, until released. Takes and closes both descriptors; the job always starts (a job
    the sandbox cannot look into runs unobserved)."""
    setup = JobSetup()
    try:
        pid = _child_pid(info_fd)
        setup = JobSetup(failed=True) if pid is None else _open_when_set_up(pid, deadline)
    except OSError as exc:
        log.warning("sandbox_cannot_look_into_job", error=repr(exc),
                    consequence="files at the size limit and full filesystems go unreported")
    finally:
        try:
            os.write(block_fd, b"\0")
        except OSError:
            pass  # bwrap is gone
        os.close(block_fd)
        os.close(info_fd)
    return setup


def _child_pid(info_fd: int) -> int | None:
    """The pid of the job's main process from bwrap's --info-fd JSON; None if bwrap ended first."""
    data = b""
    while chunk := os.read(info_fd, 4096):
        data += chunk
        if data.rstrip().endswith(b"}"):
            break
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _open_when_set_up(pid: int, deadline: float) -> JobSetup:
    try:
        ended = os.pidfd_open(pid)
    except ProcessLookupError:
        return JobSetup(failed=True)
    root = f"/proc/{pid}/root"
    try:
        while not _is_set_up(root):
            gone, _, _ = select.select([ended], [], [], SETUP_POLL_S)
            if gone or time.monotonic() > deadline:
                return JobSetup(failed=bool(gone))
        opened: dict[str, int] = {}
        try:
            for path in JOB_FILESYSTEMS:
                opened[path] = os.open(root + path, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            JobSetup(opened).release()
            raise
        return JobSetup(opened)
    finally:
        os.close(ended)


def _is_set_up(root: str) -> bool:
    """Whether bwrap has moved the job into its own root (the end of its setup), /job mounted there."""
    try:
        top, host = os.stat(root), os.stat("/")
        return (top.st_dev, top.st_ino) != (host.st_dev, host.st_ino) and os.stat(root + JOB_DIR).st_dev != top.st_dev
    except FileNotFoundError:
        return False


def filesystems_ending(filesystems: dict[str, int], max_file_bytes: int) -> tuple[bool, bool]:
    """(a file reached max_file_bytes, a filesystem filled up) for a job's held filesystems."""
    full = any(_is_full(fd) for fd in filesystems.values())
    at_limit = any(file_reached(Path(f"/proc/self/fd/{fd}"), max_file_bytes) for fd in filesystems.values())
    return at_limit, full


def _is_full(fd: int) -> bool:
    stats = os.fstatvfs(fd)
    return stats.f_bavail == 0 or stats.f_favail == 0


@dataclass(frozen=True)
class TreeUsage:
    cpu_seconds: float  # of the processes below the root and of the children they reaped
    tasks: int          # their threads, zombies as one each: what RLIMIT_NPROC counts


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_usage(root: int, stop_above: int | None = None, proc: Path = Path("/proc")) -> TreeUsage:
    """What the processes below `root` (not `root` itself) used, from /proc. Each process is read
    before the list of its children, so that a child reaped while the tree is read counts once at
    most (in its parent's reaped time or on its own), never twice. Stops counting tasks once they
    are over `stop_above`."""
    ticks = tasks = 0
    pending = _children(proc, root)
    while pending and (stop_above is None or tasks <= stop_above):
        pid = pending.pop()
        try:
            fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
            children = _children(proc, pid)
        except OSError:
            continue  # it ended meanwhile
        ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
        tasks += max(1, int(fields[17]))                     # num_threads (0 for a zombie)
        pending += children
    return TreeUsage(ticks / CLOCK_TICKS, tasks)


def _children(proc: Path, pid: int) -> list[int]:
    try:
        threads = os.listdir(proc / str(pid) / "task")
    except FileNotFoundError:
        return []
    children: list[int] = []
    for tid in threads:
        try:
            children += [int(child) for child in (proc / str(pid) / "task" / tid / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return children


@functools.cache
def children_listed() -> bool:
    """Whether /proc lists a thread's children (CONFIG_PROC_CHILDREN): needed to watch a job
    without a cgroup. Said once in the log when not."""
    listed = Path(f"/proc/self/task/{os.getpid()}/children").exists()
    if not listed:
        log.warning("sandbox_watchdog_blind", reason="this kernel does not list children in /proc",
                    consequence="without cgroups, CPU time and processes are bounded per process only")
    return listed


class Meter(Protocol):
    def read(self) -> tuple[float, bool]:
        """(the job's CPU seconds so far, whether it is over its process limit)."""
        ...


@dataclass(frozen=True)
class CgroupMeter:
    """The kernel's counts: every fork refused for pids.max is the process limit reached."""
    cgroup: JobCgroup

    def read(self) -> tuple[float, bool]:
        return self.cgroup.cpu_seconds(), self.cgroup.forks_refused() > 0


@dataclass(frozen=True)
class TreeMeter:
    """The job's process tree below the launcher, for a job without a cgroup. The kernel counts
    no refused fork there: a job is over its process limit when its tree holds more than
    `max_tasks` (RLIMIT_NPROC allows one more, so that a job that keeps forking shows), or when its
    stderr says a fork was refused (the processes whose forks failed may be gone by the next look)."""
    launcher: int
    max_tasks: int
    refused: RefusedForkSigns

    def read(self) -> tuple[float, bool]:
        usage = tree_usage(self.launcher, stop_above=self.max_tasks)
        return usage.cpu_seconds, usage.tasks > self.max_tasks or self.refused.seen


class Watchdog:
    """Ends a job at its limits for the whole job: CPU time and processes."""

    def __init__(self, meter: Meter, cpu_limit_s: float, poll_s: float = 0.05) -> None:
        self.meter, self.cpu_limit_s, self.poll_s = meter, cpu_limit_s, poll_s
        self.cpu_seconds = 0.0  # the most it has seen

    async def run(self) -> bus_pb2.SandboxLimit:
        """Returns the limit once the job reaches it; never, when the counts cannot be read (the
        wall clock and the per-process rlimits still bound the job)."""
        try:
            while True:
                cpu, over_processes = self.meter.read()
                self.cpu_seconds = max(self.cpu_seconds, cpu)
                if cpu >= self.cpu_limit_s:
                    return L.SANDBOX_LIMIT_CPU_TIME
                if over_processes:
                    return L.SANDBOX_LIMIT_PROCESSES
                await asyncio.sleep(self.poll_s)
        except (OSError, ValueError, IndexError) as exc:
            log.warning("sandbox_watchdog_blind", meter=repr(self.meter), error=repr(exc))
        await asyncio.Event().wait()
        return L.SANDBOX_LIMIT_NONE  # not reached: the job ends first


def _failed(job: bus_pb2.SandboxJob, instance: str, error: str, **fields: object) -> bus_pb2.SandboxResult:
    """The result of a job that could not be run (or whose ending could not be learnt)."""
    return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-1, sandbox_instance=instance, error=error,
                                 **fields)  # type: ignore[arg-type]


class BadJob(ValueError):
    """A job the sandbox cannot set up as asked (said in its result)."""


def job_files(job: bus_pb2.SandboxJob) -> list[tuple[str, bytes]]:
    """The job's files as (path below the scratch directory, content); raises BadJob for a path
    that leaves it."""
    files = []
    for rel, content in sorted(job.files.items()):
        parts = PurePosixPath(rel).parts
        if not parts or rel.startswith("/") or ".." in parts or "\0" in rel:
            raise BadJob(f"files: {rel!r} leaves the scratch directory")
        files.append(("/".join(parts), content))
    return files


_JOB_NUMBERS = itertools.count()  # names the jobs' cgroups (below this process's own directory)


class Conversation(Protocol):
    """A session's exchange with its process (sandbox/session.py): lines to its stdin, answered by
    lines of its stdout, until the caller closes it."""

    async def run(self, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> bus_pb2.SandboxLimit:
        """Returns once the session is over: SANDBOX_LIMIT_NONE when the caller closed it (its
        stdin is closed), or the limit that ends it (a step not answered in time, a line too long)."""
        ...


CLOSE_GRACE_S = 5.0  # a closed session's process has this long to exit on its own


async def run_job(job: bus_pb2.SandboxJob, limits: JobLimits, *, instance: str = "", uids: JobUids = DEFAULT_UIDS,
                  cgroups: JobCgroups | None = None, conversation: Conversation | None = None,
                  read_only: Sequence[tuple[Path, str]] = ()) -> bus_pb2.SandboxResult:
    """Runs `job` under `limits`, in a cgroup of its own when `cgroups` is given, and returns its
    result. Never raises for anything the job does: a job that cannot be run is a result with
    `error`. A job's files live in its own tmpfs, never on the host's disk. With `conversation`
    the job is a session: its stdin and stdout are the conversation's, not the job's."""
    started = time.monotonic()
    cgroup: JobCgroup | None = None
    try:
        files = job_files(job)
        if cgroups is not None:
            cgroup = cgroups.create(f"job-{next(_JOB_NUMBERS)}", memory_bytes=limits.memory_bytes,
                                    max_tasks=limits.max_processes + BWRAP_TASKS)
        return await _run(job, files, limits, uids.next() if os.geteuid() == 0 else None, cgroup, instance,
                          conversation, read_only)
    except BadJob as exc:
        return _failed(job, instance, str(exc))
    except Exception as exc:  # the sandbox's own trouble (no memory file, no cgroup): the job still gets a result
        log.exception("sandbox_job_not_run", job=job.job_id)
        return _failed(job, instance, f"the sandbox could not run the job: {exc!r}",
                       wall_seconds=time.monotonic() - started)
    finally:
        if cgroup is not None:  # off the event loop: a cgroup's removal may wait a little
            await asyncio.shield(asyncio.to_thread(_remove_cgroup, cgroup))


def _remove_cgroup(cgroup: JobCgroup) -> None:
    try:
        cgroup.remove()
    except OSError as exc:
        log.warning("cgroup_not_removed", cgroup=str(cgroup.dirs), error=repr(exc))


@dataclass
class _Started:
    process: asyncio.subprocess.Process
    report_fd: int | None  # the launcher's report (None: started directly, the cgroup counts the CPU)

    def kill(self) -> None:
        """Ends the job: bwrap's death ends the job's main process (--die-with-parent) and with it
        the job's pid namespace. Started directly, bwrap leads its own session; through the
        launcher, the launcher kills it."""
        if self.process.returncode is not None:
            return  # reaped: its pid may be another process's by now
        try:
            if self.report_fd is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def ended(self) -> tuple[int, float | None]:
        """(exit code, CPU seconds the launcher counted, or None) once the process has exited."""
        assert self.process.returncode is not None
        if self.report_fd is None:
            return self.process.returncode, None
        try:
            status, user_s, system_s = _read_report(self.report_fd).split()
            return os.waitstatus_to_exitcode(int(status)), float(user_s) + float(system_s)
        except ValueError as exc:
            raise LauncherFailed(f"the sandbox launcher failed (exit {self.process.returncode})") from exc


class CannotStart(RuntimeError):
    """The job's first process could not be made (no fork, no cgroup): said in the result."""


class LauncherFailed(RuntimeError):
    pass


async def _start(command: list[str], limits: JobLimits, cgroup: JobCgroup | None, passed: list[int]) -> _Started:
    """Starts the job's command (bwrap), handing it the descriptors `passed`: directly into its
    cgroup, or without one through the launcher, which reaps all the job leaves and so can say
    what CPU time it used."""
    rlimits = job_rlimits(limits, cgroup is not None, len(passed))
    pipe = asyncio.subprocess.PIPE
    if cgroup is not None:
        procs = cgroup.procs_files
        try:
            process = await asyncio.create_subprocess_exec(
                *command, cwd="/", env={"PATH": JOB_PATH}, start_new_session=True, pass_fds=passed,
                preexec_fn=lambda: enter_job(procs, rlimits), stdin=pipe, stdout=pipe, stderr=pipe)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CannotStart(f"the job could not be started in its cgroup: {exc!r}") from exc
        return _Started(process, None)
    report_read, report_write = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(LAUNCHER), str(report_write), str(os.getpid()),
            ",".join(":".join(map(str, triple)) for triple in rlimits), "--", *command,
            cwd="/", env={"PATH": JOB_PATH}, pass_fds=(report_write, *passed), start_new_session=True,
            stdin=pipe, stdout=pipe, stderr=pipe)
    except BaseException as exc:
        os.close(report_read)
        if isinstance(exc, OSError | subprocess.SubprocessError):
            raise CannotStart(f"the sandbox launcher could not be started: {exc!r}") from exc
        raise
    finally:
        os.close(report_write)
    return _Started(process, report_read)


def _job_fds(files: list[tuple[str, bytes]]) -> tuple[JobFds, int, int]:
    """The descriptors for bwrap, and the sandbox's ends of the info and block pipes."""
    fds = JobFds()
    ours: list[int] = []
    try:
        for path, content in files:
            fds.files.append((path, _memory_file(content)))
        if SECCOMP_FILTER is not None:
            fds.seccomp = _memory_file(SECCOMP_FILTER)
        info_read, fds.info = os.pipe()
        ours.append(info_read)
        fds.block, block_write = os.pipe()
        ours.append(block_write)
    except BaseException:
        fds.close()
        for fd in ours:
            os.close(fd)
        raise
    return fds, info_read, block_write


async def _run(job: bus_pb2.SandboxJob, files: list[tuple[str, bytes]], limits: JobLimits, drop_to: int | None,
               cgroup: JobCgroup | None, instance: str, conversation: Conversation | None,
               read_only: Sequence[tuple[Path, str]]) -> bus_pb2.SandboxResult:
    started = time.monotonic()
    fds, info_read, block_write = _job_fds(files)
    command = [*([] if drop_to is None else _drop_privileges(drop_to)), *isolation_command(limits, fds, read_only),
               *job.command]
    try:
        job_process = await _start(command, limits, cgroup, fds.passed())
    except BaseException as exc:
        os.close(info_read)
        os.close(block_write)
        if isinstance(exc, CannotStart):
            return _failed(job, instance, str(exc), wall_seconds=time.monotonic() - started)
        raise
    finally:
        fds.close()
    # Never cancelled (awaited through shield): its thread's descriptors are always released.
    setup = asyncio.ensure_future(asyncio.to_thread(hold_job_filesystems, info_read, block_write,
                                                    started + limits.wall_seconds))
    try:
        return await _supervise(job, job_process, setup, limits, cgroup, instance, started, conversation)
    finally:
        _release_when_done(setup)


def _release_when_done(setup: asyncio.Future[JobSetup]) -> None:
    """Closes what the job's setup holds now, or as soon as the setup is done."""
    def release(done: asyncio.Future[JobSetup]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().release()

    if setup.done():
        release(setup)
    else:
        setup.add_done_callback(release)


async def _nothing() -> tuple[bytes, bool]:
    return b"", False


async def _supervise(job: bus_pb2.SandboxJob, job_process: _Started, setup: asyncio.Future[JobSetup],
                     limits: JobLimits, cgroup: JobCgroup | None, instance: str, started: float,
                     conversation: Conversation | None = None) -> bus_pb2.SandboxResult:
    """Waits for the job to end (its main process's exit, the wall clock, the watchdog, or a
    session's end) and tells how it ended."""
    process = job_process.process
    assert process.stdin and process.stdout and process.stderr
    refused = RefusedForkSigns()
    # Output past the cap ends the job (OUTPUT) in either mode: a job that floods its pipes would
    # otherwise run on to the wall clock with nothing more of it kept.
    overflow = asyncio.Event()
    outputs = asyncio.gather(_read_capped(process.stdout, limits.max_output_bytes, overflow=overflow)
                             if conversation is None else _nothing(),
                             _read_capped(process.stderr, limits.max_output_bytes,
                                          refused.feed if cgroup is None else None, overflow))
    feeding = asyncio.ensure_future(_feed(process.stdin, job.stdin) if conversation is None
                                    else conversation.run(process.stdin, process.stdout))
    exited = asyncio.ensure_future(process.wait())
    flooded = asyncio.ensure_future(overflow.wait())
    watchdog = _watchdog(job_process, limits, cgroup, refused)
    watching = asyncio.ensure_future(watchdog.run()) if watchdog is not None else None
    timed_out, stopped_by = False, L.SANDBOX_LIMIT_NONE
    try:
        kill, timed_out, stopped_by = await _until_ending(
            exited, flooded, watching, feeding if conversation is not None else None, limits, started)
        if kill:
            job_process.kill()
        await exited
        (stdout, out_trunc), (stderr, err_trunc) = await outputs
        code, reaped_cpu = job_process.ended()
    except LauncherFailed as exc:
        if timed_out:  # a kill that reached the launcher before it could pass it on: still the wall clock
            return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-signal.SIGKILL, stderr=stderr,
                                         wall_seconds=time.monotonic() - started, sandbox_instance=instance,
                                         limit_hit=L.SANDBOX_LIMIT_WALL_TIME,
                                         accounting=bus_pb2.SANDBOX_ACCOUNTING_RLIMIT)
        return _failed(job, instance, str(exc), stderr=stderr, wall_seconds=time.monotonic() - started)
    except BaseException:
        # Cancelled (the sandbox is stopping and hands the job back): no orphans.
        job_process.kill()
        await asyncio.gather(exited, outputs, return_exceptions=True)
        raise
    finally:
        feeding.cancel()
        flooded.cancel()
        if watching is not None:
            watching.cancel()
        if job_process.report_fd is not None:
            os.close(job_process.report_fd)
    wall = time.monotonic() - started
    prepared = await asyncio.shield(setup)
    if prepared.failed and not timed_out:
        return _failed(job, instance, "the job could not be set up: " + stderr.decode(errors="replace").strip(),
                       stderr=stderr, wall_seconds=wall)
    file_at_limit, full = await asyncio.to_thread(filesystems_ending, prepared.filesystems, limits.max_file_bytes)
    usage = cgroup.usage() if cgroup is not None else None
    seen_cpu = watchdog.cpu_seconds if watchdog is not None else 0.0
    # Without a cgroup the launcher misses processes the kernel killed as the namespace ended:
    # the watchdog may have seen more of them.
    cpu = usage.cpu_seconds if usage is not None else max(reaped_cpu or 0.0, seen_cpu)
    ending = JobEnding(returncode=code, cpu_seconds=cpu, timed_out=timed_out, watchdog=stopped_by,
                       output_truncated=out_trunc or err_trunc, usage=usage, stderr=stderr,
                       file_at_limit=file_at_limit, filesystem_full=full)
    return bus_pb2.SandboxResult(
        job_id=job.job_id, exit_code=code, stdout=stdout, stderr=stderr,
        stdout_truncated=out_trunc, stderr_truncated=err_trunc, wall_seconds=wall, cpu_seconds=cpu,
        limit_hit=classify(ending, limits), sandbox_instance=instance,
        accounting=bus_pb2.SANDBOX_ACCOUNTING_RLIMIT if usage is None else bus_pb2.SANDBOX_ACCOUNTING_CGROUP,
        peak_memory_bytes=0 if usage is None else usage.peak_memory_bytes,
    )


async def _until_ending(exited: asyncio.Future[int], flooded: asyncio.Future[bool],
                        watching: asyncio.Future[bus_pb2.SandboxLimit] | None,
                        talking: asyncio.Future[bus_pb2.SandboxLimit] | None, limits: JobLimits, started: float
                        ) -> tuple[bool, bool, bus_pb2.SandboxLimit]:
    """Waits for what ends the job first — its exit, its output past the cap, the watchdog, a
    session's end, the wall clock — and says (whether to kill it, whether the wall clock ended
    it, the limit that ended it). A session closed by its caller has a moment to exit on its own."""
    waited = {f for f in (exited, flooded, watching, talking) if f is not None}
    done, _ = await asyncio.wait(waited, timeout=limits.wall_seconds, return_when=asyncio.FIRST_COMPLETED)
    if exited in done:
        return False, False, L.SANDBOX_LIMIT_NONE
    if talking is not None and talking in done:
        ended = talking.result()
        if ended != L.SANDBOX_LIMIT_NONE:
            return True, False, ended
        left = limits.wall_seconds - (time.monotonic() - started)
        closed, _ = await asyncio.wait({exited}, timeout=max(0.0, min(CLOSE_GRACE_S, left)))
        if exited in closed:
            return False, False, L.SANDBOX_LIMIT_NONE
        if left <= CLOSE_GRACE_S:
            return True, True, L.SANDBOX_LIMIT_NONE
        return True, False, L.SANDBOX_LIMIT_CLOSE_GRACE
    if watching is not None and watching in done:
        return True, False, watching.result()
    if flooded in done:
        return True, False, L.SANDBOX_LIMIT_OUTPUT
    return True, True, L.SANDBOX_LIMIT_NONE


def _watchdog(job_process: _Started, limits: JobLimits, cgroup: JobCgroup | None, refused: RefusedForkSigns
              ) -> Watchdog | None:
    if cgroup is not None:
        return Watchdog(CgroupMeter(cgroup), limits.cpu_seconds)
    if not children_listed():
        return None
    meter = TreeMeter(job_process.process.pid, limits.max_processes + BWRAP_TASKS, refused)
    return Watchdog(meter, limits.cpu_seconds)


def _read_report(fd: int, cap: int = 4096) -> bytes:
    """The launcher's one line, written before it exited (only the launcher holds the pipe: it is
    closed in the job)."""
    return os.read(fd, cap)
