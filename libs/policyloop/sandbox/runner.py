"""Runs one job in isolation and reports how it ended.

Isolation is bubblewrap's (`bwrap`, Debian package `bubblewrap`): the job gets its own user,
network (no interfaces but a down loopback), pid, mount, ipc, uts and cgroup namespaces; its
filesystem is a read-only root holding only /usr (and the /bin, /lib, /lib64, /sbin links),
its own /proc and a minimal /dev, a private /tmp (a tmpfs of `tmp_bytes`) and its scratch
directory at /job, the only place on disk it can write; no host file outside /usr is visible
(no /etc, /home, /root, no other process's /proc). The environment is cleared. When the sandbox
runs as root the job runs as an unprivileged uid of its own (JobUids), so rlimits on processes
bind, and bind per job; rlimits bound CPU
seconds, address space, processes, file size and open files; a wall-clock timeout kills bwrap,
and with it (--die-with-parent, pid namespace) every process of the job, background ones
included, which also end when the job's main process exits. Output is capped.
CPU seconds are read from the sandbox's children as a whole, so they are exact only when one
job runs at a time (the default concurrency).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2

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
    cpu_seconds: float = 5.0
    memory_bytes: int = 512 * 1024**2
    max_processes: int = 32
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


def _preexec(limits: JobLimits) -> None:
    os.setsid()
    cpu = max(1, int(limits.cpu_seconds + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # NPROC counts per uid and binds only for non-root: the job runs as an unprivileged uid.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[: max(0, room)]
    return bytes(kept), truncated


# What a job's stderr says when the kernel refused it memory or a process (the rlimits answer
# ENOMEM / EAGAIN: the job sees the error, there is no signal to read).
_MEMORY_SIGNS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_PROCESS_SIGNS = (b"Resource temporarily unavailable", b"Cannot fork", b"can't fork", b"fork: retry",
                  b"BlockingIOError")


def _classify(returncode: int, limits: JobLimits, cpu_s: float, timed_out: bool,
              truncated: bool, stderr: bytes = b"") -> bus_pb2.SandboxLimit:
    if timed_out:
        return bus_pb2.SANDBOX_LIMIT_WALL_TIME
    # The kernel ends a job over its CPU limit with SIGXCPU, then SIGKILL; the CPU time used is
    # the reliable sign.
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or cpu_s >= limits.cpu_seconds:
        return bus_pb2.SANDBOX_LIMIT_CPU_TIME
    if returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
        return bus_pb2.SANDBOX_LIMIT_FILE_SIZE
    if returncode != 0 and any(sign in stderr for sign in _MEMORY_SIGNS):
        return bus_pb2.SANDBOX_LIMIT_MEMORY
    if any(sign in stderr for sign in _PROCESS_SIGNS):
        return bus_pb2.SANDBOX_LIMIT_PROCESSES
    if truncated:
        return bus_pb2.SANDBOX_LIMIT_OUTPUT
    return bus_pb2.SANDBOX_LIMIT_NONE


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """bwrap runs in its own session; killing it ends the job's pid namespace (--die-with-parent)
    and with it every process of the job."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await proc.wait()


async def run_job(job: bus_pb2.SandboxJob, limits: JobLimits, scratch_root: Path,
                  instance: str = "", uids: JobUids = DEFAULT_UIDS) -> bus_pb2.SandboxResult:
    scratch = Path(tempfile.mkdtemp(prefix="job-", dir=scratch_root))
    scratch.chmod(0o700)
    drop_to = uids.next() if os.geteuid() == 0 else None
    try:
        for rel, content in job.files.items():
            target = (scratch / rel).resolve()
            if not target.is_relative_to(scratch.resolve()):
                return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-1, sandbox_instance=instance,
                                             error=f"files: {rel!r} leaves the scratch directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        if drop_to is not None:
            for path in [scratch, *scratch.rglob("*")]:
                os.chown(path, drop_to, drop_to)
        started = time.monotonic()
        usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = await asyncio.create_subprocess_exec(
            *([] if drop_to is None else _drop_privileges(drop_to)), *isolation_command(scratch, limits), *job.command,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=scratch, env={"PATH": JOB_PATH},
            preexec_fn=lambda: _preexec(limits),
        )
        assert proc.stdin and proc.stdout and proc.stderr
        readers = asyncio.gather(
            _read_capped(proc.stdout, limits.max_output_bytes),
            _read_capped(proc.stderr, limits.max_output_bytes),
        )
        try:
            proc.stdin.write(job.stdin)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_seconds)
        except TimeoutError:
            timed_out = True
            await _kill(proc)
        except BaseException:
            # Cancelled (the sandbox is stopping and hands the job back): no orphans.
            await _kill(proc)
            readers.cancel()
            await asyncio.gather(readers, return_exceptions=True)
            raise
        (stdout, out_trunc), (stderr, err_trunc) = await readers
        wall = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return bus_pb2.SandboxResult(
            job_id=job.job_id, exit_code=code, stdout=stdout, stderr=stderr,
            stdout_truncated=out_trunc, stderr_truncated=err_trunc, wall_seconds=wall,
            cpu_seconds=max(0.0, cpu),
            limit_hit=_classify(code, limits, cpu, timed_out, out_trunc or err_trunc, stderr),
            sandbox_instance=instance,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
