"""Sessions forked from a prepared process: for sessions that spend their time getting ready.

A session whose job sets `session.prepared` (its command `python3 -I SCRIPT ARGS...`, the script
defining `prepare`) may run as a fork of a process that ran SCRIPT's `prepare(*ARGS)` once (see
sandbox/forkserver.py): a verifiers environment's imports and `load_environment` take seconds of
CPU, its episode milliseconds. One prepared process ("parent") serves every session of the same
command, files, dependencies and limits; it is a job of its own, under the same namespaces,
seccomp filter and limits as any (sandbox/runner.py), so the sessions forked from it share its
filesystems (/job, /tmp) and pid namespace: isolation between episodes of one environment version
is that of processes, not of sandboxes. Each forked session is still a process of its own, in a
cgroup of its own where there are cgroups (the kernel's count of its CPU and memory, its memory
and task limits, and its kill), with its own step, episode and CPU limits and its own result.

The sandbox learns a forked session's pid as the host sees it from the kernel: the child sends
its credentials on its socket first (SCM_CREDENTIALS, translated between pid namespaces and
checked: a process without privileges cannot claim another's pid). A parent lives until
`lifetime_s` (it takes no session that would outlive it) or `idle_s` without sessions; a parent
that fails to prepare fails the sessions waiting for it with its reason, and the next session
tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import os
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import BWRAP_TASKS, JobCgroup, JobCgroups
from policyloop.sandbox.runner import (
    JOB_DIR,
    CgroupMeter,
    Conversation,
    JobEnding,
    JobLimits,
    JobUids,
    Watchdog,
    _failed,
    _read_capped,
    _remove_cgroup,
    _until_ending,
    classify,
    run_job,
)
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)
L = bus_pb2.SandboxLimit
FORKSERVER = ".policyloop-forkserver.py"  # the forkserver's file in the parent's /job
CONTROL_DIR = "/fork"                      # where the parent sees the sandbox's control socket
CREDENTIALS = struct.Struct("3i")
GO = b"g"                                  # the child starts its episode on this (forkserver.GO)
PARENT_CPU_SECONDS = 600.0                 # the parent's own CPU (its prepare; its children are counted apart)
_NUMBERS = itertools.count()


class ParentFailed(RuntimeError):
    """The prepared process could not be had (its prepare failed, it ended, it did not answer)."""


@functools.cache
def forkserver_source() -> bytes:
    return resources.files("policyloop.sandbox").joinpath("forkserver.py").read_bytes()


def parent_key(job: bus_pb2.SandboxJob, limits: JobLimits, read_only: Sequence[tuple[Path, str]]) -> str:
    """What makes two sessions forks of one parent: command, files, dependencies, limits."""
    digest = hashlib.sha256()
    for part in (*job.command, repr(limits), repr(sorted(map(str, read_only)))):
        digest.update(part.encode() + b"\0")
    for path, content in sorted(job.files.items()):
        digest.update(path.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class ExitReport:
    status: int          # the wait status
    cpu_seconds: float   # the child's and all it reaped
    maxrss_bytes: int


@dataclass
class Parent:
    """One prepared process and the sandbox's end of its control socket."""
    key: str
    directory: Path
    control: socket.socket              # fork requests are sent on it directly (they carry descriptors)
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    started: float
    wall_seconds: float
    conversation: ParentConversation    # its job's: done ends it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    forked: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    exits: dict[int, asyncio.Future[ExitReport]] = field(default_factory=dict)
    live: int = 0
    last_used: float = field(default_factory=time.monotonic)
    reading: asyncio.Task[None] | None = None
    ended: bool = False

    def room_for(self, wall_seconds: float) -> bool:
        return not self.ended and time.monotonic() + wall_seconds + 1.0 < self.started + self.wall_seconds

    async def read_reports(self) -> None:
        """The parent's lines: `forked PID` answers the fork in flight, `exited ...` ends a child."""
        try:
            while line := await self.reader.readline():
                word, *rest = line.decode(errors="replace").split() or [""]
                if word != "exited":
                    await self.forked.put(line.decode(errors="replace").strip())
                    continue
                pid, status, cpu, maxrss = rest
                waiter = self.exits.get(int(pid))  # orphans of the namespace it reaped are no session's
                if waiter is not None and not waiter.done():
                    waiter.set_result(ExitReport(int(status), float(cpu), int(maxrss) * 1024))
        except ValueError as exc:  # it runs the environment's code: a line out of protocol ends it
            log.warning("prepared_process_out_of_protocol", key=self.key, error=repr(exc))
        finally:
            self.ended = True
            await self.forked.put("ended")
            for waiter in self.exits.values():
                if not waiter.done():
                    waiter.set_exception(ParentFailed("the prepared process ended"))

    async def fork(self, cpu_seconds: float) -> tuple[socket.socket, int, int]:
        """A new child: (the sandbox's end of its socket, the read end of its stderr, its pid in
        the parent's namespace)."""
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        err_read, err_write = os.pipe()
        try:
            async with self.lock:
                if self.ended:
                    raise ParentFailed("the prepared process ended")
                # A few bytes on an idle socket: sent at once, never blocking.
                socket.send_fds(self.control, [f"fork {cpu_seconds!r}\n".encode()], [theirs.fileno(), err_write])
                answer = await asyncio.wait_for(self.forked.get(), 30)
        except BaseException:
            ours.close()
            os.close(err_read)
            raise
        finally:
            theirs.close()
            os.close(err_write)
        word, _, pid = answer.partition(" ")
        if word != "forked":
            ours.close()
            os.close(err_read)
            raise ParentFailed(f"the prepared process did not fork: {answer}")
        self.exits.setdefault(int(pid), asyncio.get_running_loop().create_future())
        return ours, err_read, int(pid)

    def close(self) -> None:
        """Ends it: its control socket closed (the forkserver exits, its namespace with it), its job's
        conversation done (what is left of it is the runner's to end)."""
        self.ended = True
        self.writer.close()
        self.conversation.done.set()


class ParentConversation:
    """The parent job's stdin and stdout: unused; it lives until the sandbox closes its control socket."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def run(self, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> bus_pb2.SandboxLimit:
        await self.done.wait()
        stdin.close()
        return L.SANDBOX_LIMIT_NONE


class ForkedSessions:
    """The prepared processes of one sandbox replica and the sessions forked from them."""

    def __init__(self, *, instance: str, uids: JobUids, cgroups: JobCgroups | None, lifetime_s: float = 900.0,
                 idle_s: float = 120.0, max_parents: int = 4, prepare_timeout_s: float = 120.0,
                 sessions_at_once: int = 16, directory: Path | None = None) -> None:
        self.instance, self.uids, self.cgroups = instance, uids, cgroups
        self.sessions_at_once = sessions_at_once  # the sandbox's: a parent's uid must have room for their processes
        self.lifetime_s, self.idle_s, self.max_parents = lifetime_s, idle_s, max_parents
        self.prepare_timeout_s = prepare_timeout_s
        self.directory = directory or Path(tempfile.gettempdir()) / f"policyloop-forks-{os.getpid()}"
        self.parents: dict[str, Parent] = {}
        self._jobs: set[asyncio.Future[bus_pb2.SandboxResult]] = set()  # every parent's job, until it ends
        self._starting: dict[str, asyncio.Lock] = {}

    async def run(self, job: bus_pb2.SandboxJob, limits: JobLimits, conversation: Conversation,
                  read_only: Sequence[tuple[Path, str]] = ()) -> bus_pb2.SandboxResult:
        """The session `job`, forked from its parent (started, and prepared, when there is none)."""
        started = time.monotonic()
        key = parent_key(job, limits, read_only)
        try:
            parent = await self._parent(key, job, limits, read_only)
        except ParentFailed as exc:
            return _failed(job, self.instance, str(exc), wall_seconds=time.monotonic() - started)
        parent.live += 1
        try:
            return await self._session(parent, job, limits, conversation)
        finally:
            parent.live -= 1
            parent.last_used = time.monotonic()
            if parent.ended and parent.live == 0:  # retired while this session ran
                parent.close()
            self._retire_idle()
            if parent.live == 0:
                asyncio.get_running_loop().call_later(self.idle_s + 0.1, self._retire_idle)

    async def _parent(self, key: str, job: bus_pb2.SandboxJob, limits: JobLimits,
                      read_only: Sequence[tuple[Path, str]]) -> Parent:
        async with self._starting.setdefault(key, asyncio.Lock()):
            parent = self.parents.get(key)
            if parent is not None and parent.room_for(limits.wall_seconds):
                return parent
            if parent is not None:
                self._retire(parent)  # its sessions run on; it takes no more
            parent = await self._start(key, job, limits, read_only)
            self.parents[key] = parent
            self._retire_idle()
            return parent

    async def _start(self, key: str, job: bus_pb2.SandboxJob, limits: JobLimits,
                     read_only: Sequence[tuple[Path, str]]) -> Parent:
        directory = self.directory / f"{key}-{next(_NUMBERS)}"
        directory.mkdir(parents=True, mode=0o755)
        self.directory.chmod(0o755)
        path = directory / "control.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        path.chmod(0o777)  # the job's own uid connects to it
        listener.listen(1)
        listener.setblocking(False)
        wall = max(self.lifetime_s, 2 * limits.wall_seconds + 10)
        parent_job = bus_pb2.SandboxJob()
        parent_job.CopyFrom(job)
        parent_job.ClearField("session")
        parent_job.job_id = f"{job.job_id.split('#')[0]}#prepared-{key}"
        parent_job.files[FORKSERVER] = forkserver_source()
        python, _, script, *args = job.command
        parent_job.ClearField("command")
        parent_job.command.extend([python, "-I", FORKSERVER, f"{CONTROL_DIR}/control.sock", f"{JOB_DIR}/{script}",
                                   *args])
        conversation = ParentConversation()
        # Its children are born in its cgroup and under its uid's process limit (then moved to their own).
        parent_limits = replace(limits, wall_seconds=wall, cpu_seconds=max(limits.cpu_seconds, PARENT_CPU_SECONDS),
                                max_processes=limits.max_processes * self.sessions_at_once + 64)
        begun = time.monotonic()  # its wall clock runs from here, its preparation included
        running = asyncio.ensure_future(run_job(parent_job, parent_limits, instance=self.instance, uids=self.uids,
                                                cgroups=self.cgroups, conversation=conversation,
                                                read_only=[*read_only, (directory, CONTROL_DIR)]))
        self._jobs.add(running)
        running.add_done_callback(self._jobs.discard)
        loop = asyncio.get_running_loop()
        try:
            accepting = asyncio.ensure_future(loop.sock_accept(listener))
            timeout = job.session.step_seconds or self.prepare_timeout_s  # as the first step's, loading included
            done, _ = await asyncio.wait({accepting, running}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if accepting not in done:
                accepting.cancel()
                raise ParentFailed(self._why_not(running, "did not connect"))
            connection, _ = accepting.result()
            reader, writer = await asyncio.open_unix_connection(sock=connection)
            ready = asyncio.ensure_future(reader.readline())
            done, _ = await asyncio.wait({ready, running}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            line = ready.result().decode().strip() if ready in done else ""
            if line != "ready":
                ready.cancel()
                writer.close()
                raise ParentFailed(line.removeprefix("failed ") if line.startswith("failed ")
                                   else self._why_not(running, "did not get ready"))
        except BaseException:
            conversation.done.set()
            running.add_done_callback(lambda _: shutil.rmtree(directory, ignore_errors=True))
            raise
        finally:
            listener.close()
        parent = Parent(key, directory, connection, reader, writer, begun, wall, conversation)
        parent.reading = asyncio.ensure_future(parent.read_reports())
        running.add_done_callback(functools.partial(self._parent_ended, parent))
        log.info("prepared_process_ready", key=key, job=parent_job.job_id)
        return parent

    @staticmethod
    def _why_not(running: asyncio.Future[bus_pb2.SandboxResult], what: str) -> str:
        if not running.done():
            return f"the prepared process {what} in time"
        result = running.result()
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:]
        how = result.error or f"exit code {result.exit_code}, limit {bus_pb2.SandboxLimit.Name(result.limit_hit)}"
        return f"the prepared process ended ({how})" + (f": {tail[0]}" if tail else "")

    def _parent_ended(self, parent: Parent, running: asyncio.Future[bus_pb2.SandboxResult]) -> None:
        parent.close()
        if self.parents.get(parent.key) is parent:
            del self.parents[parent.key]
        shutil.rmtree(parent.directory, ignore_errors=True)
        if not running.cancelled() and running.exception() is None:
            result = running.result()
            log.info("prepared_process_ended", key=parent.key, exit_code=result.exit_code,
                     limit=bus_pb2.SandboxLimit.Name(result.limit_hit), cpu_s=round(result.cpu_seconds, 3),
                     error=result.error, stderr=result.stderr.decode(errors="replace")[-2000:])

    def _retire(self, parent: Parent) -> None:
        """No more sessions for `parent`; it ends once its last session has."""
        parent.ended = True
        if self.parents.get(parent.key) is parent:
            del self.parents[parent.key]
        if parent.live == 0:
            parent.close()

    def _retire_idle(self) -> None:
        now = time.monotonic()
        for parent in list(self.parents.values()):
            if parent.live == 0 and now - parent.last_used > self.idle_s:
                self._retire(parent)
        while len(self.parents) > self.max_parents:
            idle = [p for p in self.parents.values() if p.live == 0]
            if not idle:
                break
            self._retire(min(idle, key=lambda p: p.last_used))

    async def close(self) -> None:
        """Ends every parent (the sandbox is stopping) and waits for their jobs."""
        for parent in list(self.parents.values()):
            parent.close()
        self.parents.clear()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)

    async def _session(self, parent: Parent, job: bus_pb2.SandboxJob, limits: JobLimits,
                       conversation: Conversation) -> bus_pb2.SandboxResult:
        started = time.monotonic()
        try:
            ours, err_read, pid = await parent.fork(limits.cpu_seconds)
        except (ParentFailed, TimeoutError, OSError) as exc:
            return _failed(job, self.instance, f"no session from the prepared process: {exc}",
                           wall_seconds=time.monotonic() - started)
        exited = parent.exits[pid]
        cgroup: JobCgroup | None = None
        pidfd = -1
        try:
            host_pid = await asyncio.wait_for(asyncio.to_thread(_peer_pid, ours), 30)
            pidfd = os.pidfd_open(host_pid)  # signals reach this process, never one that reuses its pid
            if self.cgroups is not None:
                cgroup = self.cgroups.create(f"fork-{next(_NUMBERS)}", memory_bytes=limits.memory_bytes,
                                             max_tasks=limits.max_processes + BWRAP_TASKS)
                for procs in cgroup.procs_files:
                    Path(procs).write_text(str(host_pid))
            ours.sendall(GO)
            return await self._supervise(job, limits, conversation, ours, err_read, pidfd, exited, cgroup, started)
        except (OSError, TimeoutError, ValueError) as exc:
            return _failed(job, self.instance, f"the forked session could not be set up: {exc!r}",
                           wall_seconds=time.monotonic() - started)
        finally:
            _kill(pidfd, cgroup)  # gone already, unless it was set up wrong or its exit was misreported
            if pidfd >= 0:
                os.close(pidfd)
            parent.exits.pop(pid, None)
            if cgroup is not None:
                await asyncio.shield(asyncio.to_thread(_remove_cgroup, cgroup))

    async def _supervise(self, job: bus_pb2.SandboxJob, limits: JobLimits, conversation: Conversation,
                         ours: socket.socket, err_read: int, pidfd: int, exited: asyncio.Future[ExitReport],
                         cgroup: JobCgroup | None, started: float) -> bus_pb2.SandboxResult:
        loop = asyncio.get_running_loop()
        ours.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        stderr = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr),
                                                    os.fdopen(err_read, "rb", buffering=0))
        overflow = asyncio.Event()
        errors = asyncio.ensure_future(_read_capped(stderr, limits.max_output_bytes, overflow=overflow))
        talking = asyncio.ensure_future(conversation.run(writer, reader))
        flooded = asyncio.ensure_future(overflow.wait())
        watchdog = Watchdog(CgroupMeter(cgroup), limits.cpu_seconds) if cgroup is not None else None
        watching = asyncio.ensure_future(watchdog.run()) if watchdog is not None else None
        try:
            kill, timed_out, stopped_by = await _until_ending(exited, flooded, watching, talking, limits, started)
            if kill:
                _kill(pidfd, cgroup)
            try:
                report = await asyncio.wait_for(asyncio.shield(exited), 10)
            except ParentFailed as exc:
                return _failed(job, self.instance, f"{exc} during the session", wall_seconds=time.monotonic() - started)
            except TimeoutError:
                report = ExitReport(-1, 0.0, 0)
            stderr_bytes, truncated = await asyncio.wait_for(errors, 10)
        finally:
            for task in (talking, flooded, watching, errors):
                if task is not None:
                    task.cancel()
            writer.close()
            transport.close()
        usage = cgroup.usage() if cgroup is not None else None
        code = os.waitstatus_to_exitcode(report.status) if report.status >= 0 else -signal.SIGKILL
        cpu = usage.cpu_seconds if usage is not None else report.cpu_seconds
        ending = JobEnding(returncode=code, cpu_seconds=cpu, timed_out=timed_out, watchdog=stopped_by,
                           output_truncated=truncated, usage=usage, stderr=stderr_bytes)
        return bus_pb2.SandboxResult(
            job_id=job.job_id, exit_code=code, stderr=stderr_bytes, stderr_truncated=truncated,
            wall_seconds=time.monotonic() - started, cpu_seconds=cpu, limit_hit=classify(ending, limits),
            sandbox_instance=self.instance,
            accounting=bus_pb2.SANDBOX_ACCOUNTING_RLIMIT if usage is None else bus_pb2.SANDBOX_ACCOUNTING_CGROUP,
            peak_memory_bytes=usage.peak_memory_bytes if usage is not None else report.maxrss_bytes)


def _peer_pid(sock: socket.socket) -> int:
    """The child's pid as this process sees it, from the credentials it sent first (the kernel's)."""
    sock.settimeout(30)
    _, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(CREDENTIALS.size))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = CREDENTIALS.unpack(data[:CREDENTIALS.size])
            return pid
    raise ValueError("the forked session sent no credentials")


def _kill(pidfd: int, cgroup: JobCgroup | None) -> None:
    """Ends a forked session: its cgroup's every process, or the process itself (without a cgroup
    what it started is its prepared process's to end)."""
    if cgroup is not None:
        with contextlib.suppress(OSError):
            cgroup.kill()
    if pidfd >= 0:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
