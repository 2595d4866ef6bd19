"""sandbox service: SANDBOX jobs in, results out to each job's reply subject.

A job is acked only after its result was sent; a replica that dies mid-job leaves the job
unacked and it is redelivered to another replica. The sandbox refuses to start on a machine
where it cannot isolate jobs (policyloop.sandbox.runner.check_isolation).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import Field

from policyloop.bus import Delivery, PullWorker
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_sandbox_job
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.sandbox.runner import (
    JobLimits,
    check_isolation,
    check_scratch_root,
    effective_limits,
    run_job,
)
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


class SandboxSettings(ServiceSettings):
    concurrency: int = Field(1, description="Jobs run at once by this replica.")
    scratch_dir: Path = Field(
        Path("/tmp/policyloop-sandbox"),
        description="Where each job's private scratch directory is made; others need o+x on every parent.",
    )
    default_wall_seconds: float = Field(10.0, description="Wall-clock limit of a job that asks for none.")
    default_cpu_seconds: float = Field(5.0, description="CPU-time limit of a job that asks for none.")
    default_memory_bytes: int = Field(512 * 1024**2, description="Address-space limit of a job that asks for none.")
    max_wall_seconds: float = Field(120.0, description="Wall-clock ceiling no job can exceed.")
    max_cpu_seconds: float = Field(60.0, description="CPU-time ceiling no job can exceed.")
    max_memory_bytes: int = Field(2 * 1024**3, description="Address-space ceiling no job can exceed.")


async def body(ctx: ServiceContext) -> None:
    settings: SandboxSettings = ctx.settings  # type: ignore[assignment]
    await asyncio.to_thread(check_isolation)
    check_scratch_root(settings.scratch_dir)
    defaults = JobLimits(wall_seconds=settings.default_wall_seconds, cpu_seconds=settings.default_cpu_seconds,
                         memory_bytes=settings.default_memory_bytes)
    ceiling = JobLimits(wall_seconds=settings.max_wall_seconds, cpu_seconds=settings.max_cpu_seconds,
                        memory_bytes=settings.max_memory_bytes, max_processes=256,
                        max_file_bytes=256 * 1024**2, max_open_files=1024, max_output_bytes=4 * 1024**2)
    ctx.detail["jobs_done"] = 0

    async def handle(delivery: Delivery[bus_pb2.SandboxJob]) -> None:
        job = delivery.message
        limits = effective_limits(job.limits, defaults, ceiling)
        result = await run_job(job, limits, settings.scratch_dir, settings.instance_id)
        if job.reply_subject:
            await ctx.bus.nc.publish(job.reply_subject, result.SerializeToString())
            await ctx.bus.nc.flush(timeout=5)
        ctx.detail["jobs_done"] = int(ctx.detail["jobs_done"]) + 1
        log.info("job_done", job=job.job_id, exit_code=result.exit_code,
                 limit=bus_pb2.SandboxLimit.Name(result.limit_hit), wall_s=round(result.wall_seconds, 3))

    worker = PullWorker(
        ctx.bus, ctx.bus.topology.consumers["sandbox"], bus_pb2.SandboxJob, handle,
        service="sandbox", concurrency=settings.concurrency, validator=validate_sandbox_job,
    )
    await run_pull_workers(ctx, worker)


def main(argv: list[str] | None = None) -> int:
    return run_main("sandbox", SandboxSettings, body, argv)
