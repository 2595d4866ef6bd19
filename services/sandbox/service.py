"""sandbox service: SANDBOX jobs in, results out to each job's reply subject.

A job is acked only after its result was sent; a replica that dies mid-job leaves the job
unacked and it is redelivered to another replica. With `per_run_concurrency`, the jobs of one
run share that many slots across all replicas (Redis leases). A replica holds up to
`concurrency + held_jobs` jobs: `concurrency` of them run, and a job whose run is at its quota
waits among the held ones without taking a running slot, so jobs of other runs go on.
The sandbox refuses to start on a machine where it cannot isolate jobs
(policyloop.sandbox.runner.check_isolation), and, with `cgroups=required`, where it cannot give
each job a cgroup of its own (policyloop.sandbox.cgroups).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from policyloop.bus import Delivery, PullWorker
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.validate import validate_sandbox_job, validate_sandbox_session
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.sandbox.cgroups import JobCgroups, job_cgroups
from policyloop.sandbox.deps import MOUNT as DEPENDENCIES_MOUNT
from policyloop.sandbox.deps import DependenciesFailed, DependencyInstaller
from policyloop.sandbox.forked import ForkedSessions
from policyloop.sandbox.runner import (
    Conversation,
    JobLimits,
    JobUids,
    check_isolation,
    effective_limits,
    job_outcome,
    run_job,
)
from policyloop.sandbox.session import SessionChannel
from policyloop.state.quota import RunningSlots, RunQuota
from policyloop.telemetry import tracing
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import SANDBOX_JOB_SECONDS, SANDBOX_JOBS, SANDBOX_SESSIONS

log = get_logger(__name__)


class SandboxSettings(ServiceSettings):
    concurrency: int = Field(1, ge=1, description="Jobs run at once by this replica.")
    held_jobs: int = Field(4, ge=0, description="Jobs held besides the running ones: a job whose run is at its "
                                                "quota waits here without taking a running slot.")
    cgroups: Literal["auto", "required", "off"] = Field(
        "auto", description="A cgroup per job (v1 memory, pids, cpuacct), so limits bind the whole job and the "
                            "result reports what the kernel counted: auto uses them where this process can make "
                            "them, required refuses to start without them, off uses rlimits alone.")
    job_uid_base: int = Field(200_000, gt=0, description="First uid jobs run as (when the sandbox runs as root): each "
                                                        "job gets the next uid of the range, so its process limit is "
                                                        "its own. Replicas sharing a kernel: disjoint ranges.")
    job_uid_count: int = Field(4096, gt=0, description="How many uids the range holds.")
    default_wall_seconds: float = Field(10.0, description="Wall-clock limit of a job that asks for none.")
    default_cpu_seconds: float = Field(5.0, description="CPU-time limit of a job that asks for none.")
    default_memory_bytes: int = Field(512 * 1024**2, description="Memory limit of a job that asks for none (resident "
                                                                 "memory of the whole job with cgroups, else address "
                                                                 "space per process).")
    max_wall_seconds: float = Field(120.0, description="Wall-clock ceiling no job can exceed.")
    max_cpu_seconds: float = Field(60.0, description="CPU-time ceiling no job can exceed.")
    max_memory_bytes: int = Field(2 * 1024**3, description="Memory ceiling no job can exceed.")
    per_run_concurrency: int = Field(
        8, ge=0, description="Most jobs of one run that run at once across all sandbox replicas (0: no quota), so "
                             "one run cannot take every sandbox. A job over its run's quota waits among the held "
                             "jobs; slots are leases, so a dead replica's come back.")
    quota_poll_s: float = Field(0.05, gt=0, description="How often a job held for its run's quota asks again.")
    session_concurrency: int = Field(
        16, ge=0, description="Sessions (one process per episode of an environment program, mostly waiting for the "
                              "model) this replica runs at once, besides its jobs. 0: it runs no sessions.")
    default_step_seconds: float = Field(10.0, gt=0, description="A session step's limit when the session sets none.")
    session_first_step_seconds: float = Field(
        30.0, gt=0, description="A session whose caller asks no first step within this is abandoned (killed, "
                                "SANDBOX_LIMIT_ABANDONED): its caller gave up, or it is a redelivery after the sandbox "
                                "that ran it died. A live caller asks at once.")
    dependencies_dir: Path = Field(
        Path(tempfile.gettempdir()) / "policyloop-sandbox-deps",
        description="Where jobs' Python dependencies are installed, a directory per distinct set, mounted read-only "
                    "at /deps/site-packages in the jobs that name it. Every path above it must be readable by the "
                    "jobs' users.")
    package_index_url: str = Field(
        "", description="The package index requirements are resolved against (empty: pip's configuration; 'none': "
                        "only the wheels uploaded with them).")
    dependency_install_timeout_s: float = Field(600.0, gt=0,
                                                description="Most seconds one dependency set's install takes.")
    forked_sessions: bool = Field(
        True, description="Sessions that ask for it (their script defines prepare(), as the verifiers worker does) "
                          "fork from one process per environment version that prepared once: seconds of imports "
                          "paid once, not per episode. Such sessions share that process's sandbox (filesystems, pid "
                          "namespace); each is still a process with its own cgroup, limits and result. Off: each "
                          "session is a sandbox of its own.")
    prepared_process_seconds: float = Field(
        900.0, gt=0, description="How long one prepared process serves sessions (it takes none that would outlive "
                                 "it; the next session prepares a new one).")
    prepared_process_idle_seconds: float = Field(
        120.0, gt=0, description="A prepared process with no session for this long ends.")
    prepared_processes: int = Field(4, ge=1, description="Most idle prepared processes kept (the least recently "
                                                        "used ends first).")


@dataclass
class SandboxReplica:
    """What one sandbox replica holds while it runs jobs and sessions."""
    ctx: ServiceContext
    settings: SandboxSettings
    cgroups: JobCgroups | None
    status: status_pb2.SandboxStatus
    slots: RunningSlots
    installer: DependencyInstaller
    uids: JobUids
    defaults: JobLimits
    ceiling: JobLimits
    forked: ForkedSessions | None = None

    def expired(self, job: bus_pb2.SandboxJob) -> bool:
        """Its caller gave up waiting (and asks again under a new job id if it still wants it)."""
        if not job.expires_unix_ms or now_ms() <= job.expires_unix_ms:
            return False
        self.status.jobs_expired += 1
        SANDBOX_JOBS.labels("expired").inc()
        log.info("job_expired", job=job.job_id)
        return True

    async def run(self, job: bus_pb2.SandboxJob, limits: JobLimits, conversation: Conversation | None = None
                  ) -> bus_pb2.SandboxResult:
        """Runs the job (a session with `conversation`) with its dependencies mounted, installed on
        first use; a job whose dependencies cannot be had gets the reason as its result."""
        mounts: list[tuple[Path, str]] = []
        if job.HasField("dependencies"):
            try:
                mounts = [(await self.installer.directory(job.dependencies), DEPENDENCIES_MOUNT)]
            except DependenciesFailed as exc:
                return bus_pb2.SandboxResult(job_id=job.job_id, exit_code=-1, error=f"dependencies: {exc}",
                                             sandbox_instance=self.settings.instance_id)
        if conversation is not None and job.session.prepared and self.forked is not None:
            return await self.forked.run(job, limits, conversation, mounts)
        return await run_job(job, limits, instance=self.settings.instance_id, uids=self.uids, cgroups=self.cgroups,
                             conversation=conversation, read_only=mounts)

    async def reply(self, job: bus_pb2.SandboxJob, result: bus_pb2.SandboxResult) -> str:
        """The result to the job's caller; the one word its metrics and logs say of it."""
        if job.reply_subject:
            await self.ctx.bus.nc.publish(job.reply_subject, result.SerializeToString())
            await self.ctx.bus.nc.flush(timeout=5)
        return job_outcome(result)

    async def handle(self, delivery: Delivery[bus_pb2.SandboxJob]) -> None:
        job = delivery.message
        if self.expired(job):
            return
        limits = effective_limits(job.limits, self.defaults, self.ceiling)
        # The quota lease outlives the job's wall clock: it is given back when the job ends.
        async with self.slots.slot(job.run_id, f"{self.settings.instance_id}:{job.job_id}", limits.wall_seconds + 30):
            if self.expired(job):  # it may have waited for its slot
                return
            result = await self.run(job, limits)
        outcome = await self.reply(job, result)
        self.status.jobs_done += 1
        tracing.annotate({"policyloop.job_id": job.job_id, "policyloop.job_outcome": outcome,
                          "policyloop.job_wall_seconds": result.wall_seconds})
        SANDBOX_JOBS.labels(outcome).inc()
        SANDBOX_JOB_SECONDS.labels(outcome).observe(result.wall_seconds)
        log.info("job_done", job=job.job_id, exit_code=result.exit_code,
                 limit=bus_pb2.SandboxLimit.Name(result.limit_hit), wall_s=round(result.wall_seconds, 3),
                 cpu_s=round(result.cpu_seconds, 3))

    async def handle_session(self, delivery: Delivery[bus_pb2.SandboxJob]) -> None:
        """A session: the process answers steps on its channel until closed; its result goes to the
        step that closed it and to reply_subject, like a job's."""
        job = delivery.message
        if self.expired(job):
            return
        channel = SessionChannel(job.session.step_seconds or self.settings.default_step_seconds,
                                 first_step_s=self.settings.session_first_step_seconds)
        sub = await self.ctx.bus.nc.subscribe(job.session.channel_subject, cb=channel.on_step)
        try:
            result = await self.run(job, effective_limits(job.limits, self.defaults, self.ceiling), channel)
            await channel.finish(result)
        finally:
            await sub.unsubscribe()
        outcome = await self.reply(job, result)
        self.status.sessions_done += 1
        SANDBOX_SESSIONS.labels(outcome).inc()
        log.info("session_done", job=job.job_id, exit_code=result.exit_code,
                 limit=bus_pb2.SandboxLimit.Name(result.limit_hit), wall_s=round(result.wall_seconds, 3),
                 cpu_s=round(result.cpu_seconds, 3), peak_memory_bytes=result.peak_memory_bytes)


async def body(ctx: ServiceContext) -> None:
    settings: SandboxSettings = ctx.settings  # type: ignore[assignment]
    await asyncio.to_thread(check_isolation)
    cgroups = job_cgroups(settings.cgroups)
    status = status_pb2.SandboxStatus(accounting="cgroup" if cgroups is not None else "rlimit")
    ctx.status = lambda: status
    quota = RunQuota(ctx.redis, settings.namespace, settings.per_run_concurrency) \
        if settings.per_run_concurrency > 0 else None
    SANDBOX_SESSIONS.labels("ok")  # exported at zero from the start: no sessions reads as 0, not as no data
    replica = SandboxReplica(
        ctx, settings, cgroups, status, RunningSlots(settings.concurrency, quota, settings.quota_poll_s),
        DependencyInstaller(settings.dependencies_dir, index_url=settings.package_index_url,
                            timeout_s=settings.dependency_install_timeout_s),
        JobUids(settings.job_uid_base, settings.job_uid_count),
        defaults=JobLimits(wall_seconds=settings.default_wall_seconds, cpu_seconds=settings.default_cpu_seconds,
                           memory_bytes=settings.default_memory_bytes),
        ceiling=JobLimits(wall_seconds=settings.max_wall_seconds, cpu_seconds=settings.max_cpu_seconds,
                          memory_bytes=settings.max_memory_bytes, max_processes=256,
                          max_file_bytes=256 * 1024**2, max_open_files=1024, max_output_bytes=4 * 1024**2))
    workers = [PullWorker(
        ctx.bus, ctx.bus.topology.consumers["sandbox"], bus_pb2.SandboxJob, replica.handle,
        service="sandbox", concurrency=settings.concurrency + settings.held_jobs, validator=validate_sandbox_job,
    )]
    if settings.session_concurrency:
        workers.append(PullWorker(
            ctx.bus, ctx.bus.topology.consumers["sandbox-sessions"], bus_pb2.SandboxJob, replica.handle_session,
            service="sandbox", concurrency=settings.session_concurrency, validator=validate_sandbox_session,
        ))
    if settings.forked_sessions:
        replica.forked = ForkedSessions(
            instance=settings.instance_id, uids=replica.uids, cgroups=cgroups,
            lifetime_s=settings.prepared_process_seconds, idle_s=settings.prepared_process_idle_seconds,
            max_parents=settings.prepared_processes, sessions_at_once=settings.session_concurrency)
    try:
        await run_pull_workers(ctx, *workers)
    finally:
        if replica.forked is not None:
            await replica.forked.close()
        if cgroups is not None:
            cgroups.remove_parents()


def main(argv: list[str] | None = None) -> int:
    return run_main("sandbox", SandboxSettings, body, argv)
