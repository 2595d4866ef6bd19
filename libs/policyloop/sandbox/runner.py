"""Runs one job in isolation and reports how it ended.

Isolation is bubblewrap's (`bwrap`, Debian package `bubblewrap`): the job gets its own user,
network (no interfaces but a down loopback), pid, mount, ipc, uts and cgroup namespaces; its
filesystem is a read-only root holding only /usr (and the /bin, /lib, /lib64, /sbin links),
its own /proc and a minimal /dev, a private /tmp (a tmpfs of `tmp_bytes`) and its scratch
directory at /job, the only place on disk it can write; no host file outside /usr is visible
(no /etc, /home, /root, no other process's /proc). The environment is cleared. When the sandbox
runs as root the job runs as an unprivileged uid of its own (JobUids), so rlimits on processes
bind, and bind per job. A wall-clock timeout kills bwrap, and with it (--die-with-parent, pid
namespace) every process of the job, background ones included, which also end when the job's
main process exits. Output is capped.

Limits and accounting. Where the sandbox can make cgroups (policyloop.sandbox.cgroups), each job
runs in its own: memory (resident, /tmp included) and tasks are bounded for the whole job, CPU
time is the kernel's count for the whole process tree and is bounded for the whole job (a
watchdog ends it at the limit), and `limit_hit` reports what the kernel counted (an OOM kill, a
refused fork). Without cgroups, rlimits bound each process (address space, CPU seconds) and the
uid's processes, CPU time is what the launcher (policyloop.sandbox.launcher) counted of all it
reaped, and memory and process limits can only be read from the job's stderr. Either way rlimits
bound file size and open files; the file-size limit shows as a file in the scratch directory that
reached it (Python ignores SIGXFSZ, so the signal alone would miss it). The result says which
accounting it had.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import BWRAP_TASKS, CgroupUsage, JobCgroup, JobCgroups
from policyloop.sandbox.launcher import enter_job
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)
LAUNCHER = Path(__file__).with_name("launcher.py")  # runs each job (standard library only)

UNPRIVILEGED_UID = 65534  # nobody: the isolation probe's user
JOB_DIR = "/job"           # the scratch directory, as the job sees it
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"


def isolation_command(scratch: Path, limits: JobLimits) -> list[str]:
    """bwrap's arguments for a job whose files are in `scratch` (see the module docstring)."""
    command = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
               "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged /usr: the top-level names are links
        target = Path("/") / link
        if target.is_symlink():
            command += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.exists():
            command += ["--ro-bind", str(target), f"/{link}"]
    command += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
                "--bind", str(scratch), JOB_DIR, "--chdir", JOB_DIR, "--remount-ro", "/",
                "--clearenv", "--setenv", "PATH", JOB_PATH, "--setenv", "HOME", JOB_DIR,
                "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp", "--"]
    return command


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate jobs; the sandbox refuses to run them unisolated."""


@dataclass(frozen=True)
class JobLimits:
    wall_seconds: float = 10.0
    cpu_seconds: float = 5.0           # the whole job's with a cgroup, each process's without
    memory_bytes: int = 512 * 1024**2  # resident, whole job (cgroup); else address space per process
    max_processes: int = 32            # the job's own tasks (bwrap's two are not counted)
    max_file_bytes: int = 16 * 1024**2
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    tmp_bytes: int = 64 * 1024**2      # size of the job's private /tmp (memory)


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
    scratch = Path(tempfile.mkdtemp(prefix="pl-sandbox-probe-"))
    try:
        scratch.chmod(0o777)
        probe = subprocess.run([*_drop_privileges(), *isolation_command(scratch, JobLimits()), "true"],
                               capture_output=True, timeout=10)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"bwrap cannot create the job's namespaces: "
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
    jobs that bwrap leaves to init: where init reaps slowly (minimal container or VM inits), a
    stream of short jobs fills the budget with zombies and later jobs fail to fork. A uid per job,
    in turn over a large range, gives each job its own budget. Replicas sharing a kernel should
    use disjoint ranges."""

    def __init__(self, base: int = 200_000, count: int = 4096) -> None:
        if base <= 0 or count <= 0:
            raise ValueError("job uids: base and count must be positive")
        self.base, self.count = base, count
        self._turn = itertools.count()

    def next(self) -> int:
        return self.base + next(self._turn) % self.count


DEFAULT_UIDS = JobUids()


def check_scratch_root(root: Path) -> None:
    """The job runs as an unprivileged uid, so every directory above its scratch directory must
    let others through (o+x); otherwise no job could open its own files."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return
    for directory in [root, *root.parents]:
        if not directory.stat().st_mode & 0o001:
            raise SandboxUnavailable(
                f"scratch root {root}: {directory} is not traversable by others (chmod o+x, or "
                "choose another scratch_dir)"
            )


def job_rlimits(limits: JobLimits, cgrouped: bool) -> list[tuple[int, int, int]]:
    """The rlimits of the job's processes (resource, soft, hard)."""
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    # NPROC counts per uid and binds only for non-root: the job runs as an unprivileged uid. With
    # a cgroup it is only a backstop, above pids.max, so that the counted limit fires first.
    nproc = limits.max_processes + BWRAP_TASKS + (16 if cgrouped else 0)
    rlimits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # per process; with a cgroup the watchdog bounds the job
        (resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes),
        (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, nproc, nproc),
    ]
    # Without a memory cgroup the address space of each process is all that can be bounded. With
    # one, address space is only a backstop well above it: runtimes reserve far more address space
    # than they touch, and the cgroup bounds (and counts) what they do touch.
    address_space = limits.memory_bytes if not cgrouped else max(4 * limits.memory_bytes, 1024**3)
    rlimits.append((resource.RLIMIT_AS, address_space, address_space))
    return rlimits


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
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


@dataclass(frozen=True)
class JobEnding:
    """What is known of how a job ended, for telling which limit stopped it."""
    returncode: int
    cpu_seconds: float
    timed_out: bool = False
    cpu_watchdog: bool = False     # the whole job's CPU time reached the limit (cgroup)
    output_truncated: bool = False
    file_at_limit: bool = False    # a file in the scratch directory reached max_file_bytes
    usage: CgroupUsage | None = None  # the kernel's count, when the job had a cgroup
    stderr: bytes = b""


def classify(ending: JobEnding, limits: JobLimits) -> bus_pb2.SandboxLimit:
    """The limit that stopped the job (or that it ran into), most decisive first."""
    if ending.timed_out:
        return bus_pb2.SANDBOX_LIMIT_WALL_TIME
    # The kernel ends a process over its CPU rlimit with SIGXCPU, then SIGKILL.
    # Without a cgroup the limit is each process's: the job's total may pass it without any process
    # being stopped.
    if (ending.cpu_watchdog or ending.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
            or (ending.usage is not None and ending.cpu_seconds >= limits.cpu_seconds)):
        return bus_pb2.SANDBOX_LIMIT_CPU_TIME
    if ending.usage is not None:
        if ending.usage.oom_kills:
            return bus_pb2.SANDBOX_LIMIT_MEMORY
        if ending.usage.forks_refused:
            return bus_pb2.SANDBOX_LIMIT_PROCESSES
    else:
        if ending.returncode != 0 and any(sign in ending.stderr for sign in _MEMORY_SIGNS):
            return bus_pb2.SANDBOX_LIMIT_MEMORY
        if any(sign in ending.stderr for sign in _PROCESS_SIGNS):
            return bus_pb2.SANDBOX_LIMIT_PROCESSES
    if ending.file_at_limit or ending.returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
        return bus_pb2.SANDBOX_LIMIT_FILE_SIZE
    if ending.output_truncated:
        return bus_pb2.SANDBOX_LIMIT_OUTPUT
    return bus_pb2.SANDBOX_LIMIT_NONE


def file_reached(directory: Path, size: int, max_entries: int = 100_000) -> bool:
    """Whether a regular file below `directory` is `size` bytes or more: RLIMIT_FSIZE stops every
    write at the limit, so a file that hit it is left exactly that long. (Files in the job's /tmp
    are gone by then; a job could also make such a file on purpose, which only reports a limit
    against itself.) Looks at `max_entries` entries at most."""
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


async def _cpu_watchdog(cgroup: JobCgroup, limit_s: float, poll_s: float = 0.05) -> None:
    """Returns once the job's whole process tree has used `limit_s` CPU seconds (never, when the
    count cannot be read: the wall clock still bounds the job)."""
    try:
        while cgroup.cpu_seconds() < limit_s:
            await asyncio.sleep(poll_s)
    except (OSError, ValueError) as exc:
        log.warning("cpu_watchdog_blind", cgroup=str(cgroup.dirs["cpuacct"]), error=repr(exc))
        await asyncio.Event().wait()


def _failed(job: bus_pb2.SandboxJob, instance: str, error: str, **fields: object) -> bus_pb2.SandboxResult:
    """The result of a job that could not be run (or whose ending could not be learnt)."""
    return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-1, sandbox_instance=instance, error=error,
                                 **fields)  # type: ignore[arg-type]


async def run_job(job: bus_pb2.SandboxJob, limits: JobLimits, scratch_root: Path,
                  instance: str = "", uids: JobUids = DEFAULT_UIDS, cgroups: JobCgroups | None = None
                  ) -> bus_pb2.SandboxResult:
    """Runs `job` under `limits` in a scratch directory below `scratch_root`, in a cgroup of its
    own when `cgroups` is given, and returns its result."""
    scratch = Path(tempfile.mkdtemp(prefix="job-", dir=scratch_root))
    scratch.chmod(0o700)
    drop_to = uids.next() if os.geteuid() == 0 else None
    cgroup: JobCgroup | None = None
    try:
        for rel, content in job.files.items():
            target = (scratch / rel).resolve()
            if not target.is_relative_to(scratch.resolve()):
                return _failed(job, instance, f"files: {rel!r} leaves the scratch directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        if drop_to is not None:
            for path in [scratch, *scratch.rglob("*")]:
                os.chown(path, drop_to, drop_to)
        if cgroups is not None:
            cgroup = cgroups.create(scratch.name, memory_bytes=limits.memory_bytes,
                                    max_tasks=limits.max_processes + BWRAP_TASKS)
        return await _run(job, limits, scratch, drop_to, cgroup, instance)
    finally:
        # Off the event loop: a job can leave many files, and a cgroup's removal may wait a little.
        await asyncio.shield(asyncio.to_thread(_clean_up, scratch, cgroup))


def _clean_up(scratch: Path, cgroup: JobCgroup | None) -> None:
    if cgroup is not None:
        try:
            cgroup.remove()
        except OSError as exc:
            log.warning("cgroup_not_removed", cgroup=str(cgroup.dirs), error=repr(exc))
    shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class _Started:
    process: asyncio.subprocess.Process
    report_fd: int | None  # the launcher's report (None: started directly, the cgroup counts the CPU)

    def kill(self) -> None:
        """Ends the job: bwrap's death ends its pid namespace (--die-with-parent) and with it every
        process of the job. Started directly, bwrap leads its own session; through the launcher,
        the launcher kills it."""
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


async def _start(command: list[str], scratch: Path, limits: JobLimits, cgroup: JobCgroup | None) -> _Started:
    """Starts the job's command (bwrap): directly into its cgroup, or without one through the
    launcher, which reaps all the job leaves and so can say what CPU time it used."""
    rlimits = job_rlimits(limits, cgroup is not None)
    pipe = asyncio.subprocess.PIPE
    if cgroup is not None:
        procs = cgroup.procs_files
        try:
            process = await asyncio.create_subprocess_exec(
                *command, cwd=scratch, env={"PATH": JOB_PATH}, start_new_session=True,
                preexec_fn=lambda: enter_job(procs, rlimits), stdin=pipe, stdout=pipe, stderr=pipe)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CannotStart(f"the job could not be started in its cgroup: {exc!r}") from exc
        return _Started(process, None)
    report_read, report_write = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(LAUNCHER), str(report_write), str(os.getpid()),
            ",".join(":".join(map(str, triple)) for triple in rlimits), "--", *command,
            cwd=scratch, env={"PATH": JOB_PATH}, pass_fds=(report_write,), start_new_session=True,
            stdin=pipe, stdout=pipe, stderr=pipe)
    except BaseException as exc:
        os.close(report_read)
        if isinstance(exc, OSError | subprocess.SubprocessError):
            raise CannotStart(f"the sandbox launcher could not be started: {exc!r}") from exc
        raise
    finally:
        os.close(report_write)
    return _Started(process, report_read)


async def _run(job: bus_pb2.SandboxJob, limits: JobLimits, scratch: Path, drop_to: int | None,
               cgroup: JobCgroup | None, instance: str) -> bus_pb2.SandboxResult:
    started = time.monotonic()
    command = [*([] if drop_to is None else _drop_privileges(drop_to)), *isolation_command(scratch, limits),
               *job.command]
    try:
        job_process = await _start(command, scratch, limits, cgroup)
    except CannotStart as exc:
        return _failed(job, instance, str(exc), wall_seconds=time.monotonic() - started)
    process = job_process.process
    assert process.stdin and process.stdout and process.stderr
    outputs = asyncio.gather(_read_capped(process.stdout, limits.max_output_bytes),
                             _read_capped(process.stderr, limits.max_output_bytes))
    feeding = asyncio.ensure_future(_feed(process.stdin, job.stdin))
    exited = asyncio.ensure_future(process.wait())
    watchdog = asyncio.ensure_future(_cpu_watchdog(cgroup, limits.cpu_seconds)) if cgroup is not None else None
    timed_out = cpu_watchdog = False
    try:
        waited = {exited} if watchdog is None else {exited, watchdog}
        done, _ = await asyncio.wait(waited, timeout=limits.wall_seconds, return_when=asyncio.FIRST_COMPLETED)
        if exited not in done:
            cpu_watchdog = watchdog is not None and watchdog in done
            timed_out = not cpu_watchdog
            job_process.kill()
        await exited
        (stdout, out_trunc), (stderr, err_trunc) = await outputs
        code, reaped_cpu = job_process.ended()
    except LauncherFailed as exc:
        if timed_out:  # a kill that reached the launcher before it could pass it on: still the wall clock
            return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-signal.SIGKILL, stderr=stderr,
                                         wall_seconds=time.monotonic() - started, sandbox_instance=instance,
                                         limit_hit=bus_pb2.SANDBOX_LIMIT_WALL_TIME,
                                         accounting=bus_pb2.SANDBOX_ACCOUNTING_RLIMIT)
        return _failed(job, instance, str(exc), stderr=stderr, wall_seconds=time.monotonic() - started)
    except BaseException:
        # Cancelled (the sandbox is stopping and hands the job back): no orphans.
        job_process.kill()
        await asyncio.gather(exited, outputs, return_exceptions=True)
        raise
    finally:
        feeding.cancel()
        if watchdog is not None:
            watchdog.cancel()
        if job_process.report_fd is not None:
            os.close(job_process.report_fd)
    wall = time.monotonic() - started
    usage = cgroup.usage() if cgroup is not None else None
    cpu = usage.cpu_seconds if usage is not None else reaped_cpu or 0.0
    ending = JobEnding(returncode=code, cpu_seconds=cpu, timed_out=timed_out, cpu_watchdog=cpu_watchdog,
                       output_truncated=out_trunc or err_trunc, usage=usage, stderr=stderr,
                       file_at_limit=await asyncio.to_thread(file_reached, scratch, limits.max_file_bytes))
    return bus_pb2.SandboxResult(
        job_id=job.job_id, exit_code=code, stdout=stdout, stderr=stderr,
        stdout_truncated=out_trunc, stderr_truncated=err_trunc, wall_seconds=wall, cpu_seconds=cpu,
        limit_hit=classify(ending, limits), sandbox_instance=instance,
        accounting=bus_pb2.SANDBOX_ACCOUNTING_RLIMIT if usage is None else bus_pb2.SANDBOX_ACCOUNTING_CGROUP,
        peak_memory_bytes=0 if usage is None else usage.peak_memory_bytes,
    )


def _read_report(fd: int, cap: int = 4096) -> bytes:
    """The launcher's one line, written before it exited (only the launcher holds the pipe: it is
    closed in the job)."""
    return os.read(fd, cap)
