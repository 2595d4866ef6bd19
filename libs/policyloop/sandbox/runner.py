"""Runs one job in isolation and reports how it ended.

Isolation (first version): `unshare` gives the job its own network (no interfaces but a down
loopback), pid, mount, ipc and uts namespaces; when the sandbox runs as root the job drops to
an unprivileged uid so that rlimits on processes bind; rlimits bound CPU seconds, address
space, processes, file size and open files; a wall-clock timeout kills the job's whole pid
namespace; output is capped. The job's files live in a private scratch directory removed
afterwards. Read-only system paths and per-run quotas come with the sandbox issue.
CPU seconds are read from the sandbox's children as a whole, so they are exact only when one
job runs at a time (the default concurrency).
"""

from __future__ import annotations

import asyncio
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

UNPRIVILEGED_UID = 65534  # nobody
ISOLATION = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
             "--ipc", "--uts"]


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


def effective_limits(requested: bus_pb2.SandboxLimits, defaults: JobLimits, ceiling: JobLimits) -> JobLimits:
    """The job's requested limits, defaults where it asked for none, never above the ceiling."""
    merged = {}
    for name in JobLimits.__dataclass_fields__:
        asked = getattr(requested, name)
        value = asked if asked else getattr(defaults, name)
        merged[name] = min(value, getattr(ceiling, name))
    return replace(defaults, **merged)


def check_isolation() -> None:
    """Raises SandboxUnavailable unless namespaces can be created here."""
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("the unshare command (util-linux) is not installed")
    probe = subprocess.run([*ISOLATION, "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"cannot create namespaces: {probe.stderr.decode(errors='replace').strip()}")


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


def _classify(returncode: int, limits: JobLimits, cpu_s: float, timed_out: bool,
              truncated: bool) -> bus_pb2.SandboxLimit:
    if timed_out:
        return bus_pb2.SANDBOX_LIMIT_WALL_TIME
    # The kernel ends a job over its CPU limit with SIGXCPU, then SIGKILL; unshare reports
    # that in different ways, so the CPU time used is the reliable sign.
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or cpu_s >= limits.cpu_seconds:
        return bus_pb2.SANDBOX_LIMIT_CPU_TIME
    if returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
        return bus_pb2.SANDBOX_LIMIT_FILE_SIZE
    if truncated:
        return bus_pb2.SANDBOX_LIMIT_OUTPUT
    return bus_pb2.SANDBOX_LIMIT_NONE


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """unshare runs in its own session; killing the group ends the pid namespace's init and
    with it every process of the job."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await proc.wait()


async def run_job(job: bus_pb2.SandboxJob, limits: JobLimits, scratch_root: Path,
                  instance: str = "") -> bus_pb2.SandboxResult:
    scratch = Path(tempfile.mkdtemp(prefix="job-", dir=scratch_root))
    drop_to = UNPRIVILEGED_UID if os.geteuid() == 0 else None
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
        # Namespaces need root (or CAP_SYS_ADMIN) to create; the job itself runs without it.
        drop = ["setpriv", f"--reuid={drop_to}", f"--regid={drop_to}", "--clear-groups", "--"] if drop_to else []
        proc = await asyncio.create_subprocess_exec(
            *ISOLATION, *drop, *job.command,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=scratch,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8"},
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
            limit_hit=_classify(code, limits, cpu, timed_out, out_trunc or err_trunc),
            sandbox_instance=instance,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
