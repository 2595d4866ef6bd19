"""gateway service: gRPC LoopService in front of the loop; feeds runs' Tasks into TASKS.

Environments and runs live in Redis, so any gateway replica can answer for any run. Feeding a
run is owned by one replica at a time through a lease in Redis; the i-th task of a run is a
pure function of the run (policyloop.envs.feeding), so a replica that takes over re-publishes
under the same ids and nothing is enqueued twice. A full TASKS stream (backpressure) pauses
feeding; it never drops a task.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import redis.asyncio as aioredis
import redis.exceptions
from pydantic import Field

from policyloop.bus import BusError, StreamFull, tasks_subject
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.envs.feeding import nth_task, tasks_total
from policyloop.envs.validation import (
    MAX_ENVIRONMENT_BYTES,
    MAX_TASKS_PER_ENVIRONMENT,
    FailedPrecondition,
    InvalidField,
    ModelContext,
    check_run_against_learner,
    environment_key,
    load_model_context,
    validate_environment,
    validate_start_run,
)
from policyloop.runtime import ServiceContext, ServiceSettings, run_main
from policyloop.runtime.grpc_server import start_grpc_server
from policyloop.state import HeartbeatRegistry, IdempotencyKeys, VersionRegistry, connect_redis
from policyloop.state.catalog import (
    TERMINAL_STATES,
    EnvironmentCatalog,
    EnvironmentConflict,
    RunConflict,
    RunRegistry,
)
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


class GatewaySettings(ServiceSettings):
    grpc_host: str = Field("127.0.0.1", description="Interface of the LoopService gRPC server.")
    grpc_port: int = Field(50051, description="Port of the LoopService gRPC server (0: any free port).")
    bearer_token: str = Field("", description="If set, every call must carry 'authorization: Bearer <token>'.")
    feeder_lease_s: float = Field(
        10.0, description="Lease on feeding one run; another replica takes over after it lapses."
    )
    backpressure_wait_s: float = Field(
        1.0, description="Pause before retrying when TASKS is full."
    )
    watch_poll_s: float = Field(0.5, description="How often WatchRun looks for changes.")
    model_path: Path | None = Field(
        None, description="Hugging Face directory of the cluster's base model (config.json, tokenizer.json): "
                          "environments whose prompts cannot fit its context with max_new_tokens are refused. "
                          "Unset: prompts are not checked against a model.")
    max_environment_bytes: int = Field(
        MAX_ENVIRONMENT_BYTES, gt=0, description="Largest environment (serialized) SubmitEnvironment or "
                                                 "UploadEnvironment accepts; an upload is refused as soon as it "
                                                 "goes past it.")


class LoopServicer(loop_pb2_grpc.LoopServiceServicer):
    def __init__(self, ctx: ServiceContext, environments: EnvironmentCatalog, runs: RunRegistry,
                 versions: VersionRegistry, wake_feeder: asyncio.Event, watch_poll_s: float,
                 model: ModelContext | None = None, max_environment_bytes: int = MAX_ENVIRONMENT_BYTES) -> None:
        self.ctx = ctx
        self.environments = environments
        self.runs = runs
        self.versions = versions
        self.wake_feeder = wake_feeder
        self.watch_poll_s = watch_poll_s
        self.model = model
        self.max_environment_bytes = max_environment_bytes
        self.progress = RunProgressStore(ctx.redis, ctx.settings.namespace)
        self.heartbeats = HeartbeatRegistry(ctx.redis, ctx.settings.namespace)

    async def SubmitEnvironment(self, request: loop_pb2.SubmitEnvironmentRequest,
                                context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        return await self._store_environment(request.environment, context)

    async def UploadEnvironment(self, requests: AsyncIterator[loop_pb2.UploadEnvironmentRequest],
                                context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        env: loop_pb2.Environment | None = None
        i = -1
        received = 0
        async for message in requests:
            i += 1
            received += message.ByteSize()
            if received > self.max_environment_bytes:  # refused before the stream is held in memory
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"environment: larger than {self.max_environment_bytes} bytes")
            if env is None:
                if not message.HasField("environment"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "environment: the first message must carry the environment")
                env = loop_pb2.Environment()
                env.CopyFrom(message.environment)
            elif message.HasField("environment"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"messages[{i}].environment: only the first message carries the environment")
            env.tasks.extend(message.tasks)
            if len(env.tasks) > MAX_TASKS_PER_ENVIRONMENT:  # refused before the stream is held in memory
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"environment.tasks: at most {MAX_TASKS_PER_ENVIRONMENT}")
        if env is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "environment: the stream carried no message")
        log.info("environment_uploaded", messages=i + 1)
        return await self._store_environment(env, context)

    async def _store_environment(self, env: loop_pb2.Environment,
                                 context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        if env.ByteSize() > self.max_environment_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"environment: larger than {self.max_environment_bytes} bytes")
        try:
            # In a thread: tokenizing a large environment's prompts must not stall other calls.
            await asyncio.to_thread(validate_environment, env, self.model)
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        key = environment_key(env.name, env.version)
        try:
            created = await self.environments.put(key, env)
        except EnvironmentConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"environment: {exc}")
        log.info("environment_submitted", environment=key, tasks=len(env.tasks), created=created)
        return loop_pb2.SubmitEnvironmentResponse(environment=key, num_tasks=len(env.tasks), created=created)

    async def StartRun(self, request: loop_pb2.StartRunRequest,
                       context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        try:
            learner = await self._learner_config()
        except redis.exceptions.RedisError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the learner's settings: {exc}")
        try:
            validate_start_run(request)
            check_run_against_learner(request, learner)
        except FailedPrecondition as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        environments = {}
        for i, mix in enumerate(request.environments):
            env = await self.environments.get(mix.environment)
            if env is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"environments[{i}].environment: {mix.environment} was never submitted")
            environments[mix.environment] = env
        run_id = request.run_id or f"run-{uuid.uuid4().hex[:12]}"
        stored = loop_pb2.StartRunRequest()
        stored.CopyFrom(request)
        stored.run_id = run_id
        if not stored.model:
            stored.model = str((learner or {}).get("model", "policy"))
        if not stored.HasField("max_lag") and learner is not None:
            stored.max_lag = int(learner["max_lag"])  # what the run gets, for GetRun/WatchRun
        try:
            await self.runs.create(run_id, stored, tasks_total(stored, environments))
        except RunConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"run_id: {exc}")
        log.info("run_started", run=run_id, environments=list(environments))
        self.wake_feeder.set()
        return await self._run(run_id)

    async def _learner_config(self) -> dict | None:
        """The model, max_lag and objective the running learner advertises (None: none is up)."""
        for beat in await self.heartbeats.alive("learner"):
            config = beat.detail.get("config")
            if isinstance(config, dict):
                return config
        return None

    async def StopRun(self, request: loop_pb2.StopRunRequest,
                      context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        run = await self._run_or_abort(request.run_id, context)
        if run.state not in TERMINAL_STATES:
            await self.runs.set_state(run.run_id, loop_pb2.RUN_STATE_STOPPED)
            log.info("run_stopped", run=run.run_id)
        return await self._run(run.run_id)

    async def GetRun(self, request: loop_pb2.GetRunRequest,
                     context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        return await self._run_or_abort(request.run_id, context)

    async def WatchRun(self, request: loop_pb2.WatchRunRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[loop_pb2.Run]:
        run = await self._run_or_abort(request.run_id, context)
        last = None
        while True:
            snapshot = run.SerializeToString(deterministic=True)
            if snapshot != last:
                last = snapshot
                yield run
            if run.state in TERMINAL_STATES or self.ctx.stop.is_set():
                return
            await asyncio.sleep(self.watch_poll_s)
            run = await self._run(run.run_id)

    async def ListPolicies(self, request: loop_pb2.ListPoliciesRequest,
                           context: grpc.aio.ServicerContext) -> loop_pb2.ListPoliciesResponse:
        policies = [
            loop_pb2.Policy(model=model, version=version, updated_unix_ms=updated)
            for model, (version, updated) in sorted((await self.versions.all()).items())
        ]
        return loop_pb2.ListPoliciesResponse(policies=policies)

    async def _run(self, run_id: str) -> loop_pb2.Run:
        definition = await self.runs.definition(run_id)
        version = await self.versions.get(definition.model) if definition else 0
        run = await self.runs.get(run_id, policy_version=version)
        assert run is not None
        run.progress.CopyFrom(await self.progress.get(run_id))
        return run

    async def _run_or_abort(self, run_id: str, context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        if not run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id: is empty")
        if await self.runs.definition(run_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run_id: no run {run_id}")
        return await self._run(run_id)


async def feed_run(ctx: ServiceContext, run_id: str, environments: EnvironmentCatalog,
                   runs: RunRegistry, leases: IdempotencyKeys, settings: GatewaySettings) -> None:
    """Publishes the run's remaining tasks while this replica holds the run's lease."""
    lease = f"feeder:{run_id}"
    owner = settings.instance_id
    if not await leases.claim(lease, settings.feeder_lease_s, owner) and await leases.owner(lease) != owner:
        return
    try:
        request = await runs.definition(run_id)
        run = await runs.get(run_id)
        if request is None or run is None:
            return
        envs = {m.environment: await environments.get(m.environment) for m in request.environments}
        index = run.tasks_enqueued
        while index < run.tasks_total and not ctx.stop.is_set():
            if not await leases.extend(lease, settings.feeder_lease_s, owner):
                return  # another replica took over
            current = await runs.get(run_id)
            if current is None or current.state != loop_pb2.RUN_STATE_RUNNING:
                return
            task = nth_task(run_id, request, envs, index)  # type: ignore[arg-type]
            try:
                await ctx.bus.publish(tasks_subject(task.environment), task, task.task_id)
            except StreamFull:
                ctx.detail["backpressure"] = True
                await asyncio.sleep(settings.backpressure_wait_s)
                continue
            ctx.detail["backpressure"] = False
            index += 1
            await runs.set_enqueued(run_id, index)
    finally:
        await leases.release(lease, owner)


async def feeder_loop(ctx: ServiceContext, environments: EnvironmentCatalog, runs: RunRegistry,
                      leases: IdempotencyKeys, settings: GatewaySettings, wake: asyncio.Event) -> None:
    """Looks for running runs with tasks left to feed (new ones, or ones whose feeder died)."""
    while not ctx.stop.is_set():
        wake.clear()
        try:
            for run_id in await runs.run_ids():
                run = await runs.get(run_id)
                if run and run.state == loop_pb2.RUN_STATE_RUNNING and run.tasks_enqueued < run.tasks_total:
                    await feed_run(ctx, run_id, environments, runs, leases, settings)
        except (redis.exceptions.RedisError, BusError, OSError) as exc:
            log.warning("feeder_error", error=repr(exc))
        try:
            await asyncio.wait_for(wake.wait(), timeout=settings.feeder_lease_s / 2)
        except TimeoutError:
            pass


async def body(ctx: ServiceContext) -> None:
    settings: GatewaySettings = ctx.settings  # type: ignore[assignment]
    raw: aioredis.Redis = await connect_redis(settings.redis_url, decode_responses=False,
                                              connect_timeout_s=settings.connect_timeout_s)
    environments = EnvironmentCatalog(raw, settings.namespace)
    runs = RunRegistry(raw, settings.namespace)
    leases = IdempotencyKeys(ctx.redis, settings.namespace)
    wake = asyncio.Event()
    model = await asyncio.to_thread(load_model_context, settings.model_path) if settings.model_path else None
    if model is not None:
        log.info("model_context", model_path=model.path, context_tokens=model.context_tokens,
                 vocab_size=model.vocab_size, prompts_counted_by=model.measure)
    servicer = LoopServicer(ctx, environments, runs, ctx.versions, wake, settings.watch_poll_s, model,
                            settings.max_environment_bytes)
    server, _health, port = await start_grpc_server(
        [lambda s: loop_pb2_grpc.add_LoopServiceServicer_to_server(servicer, s)],
        [loop_pb2.DESCRIPTOR.services_by_name["LoopService"].full_name],
        host=settings.grpc_host, port=settings.grpc_port, bearer_token=settings.bearer_token,
    )
    ctx.detail["grpc"] = f"{settings.advertise_host}:{port}"
    ctx.ready = True
    feeder = asyncio.create_task(feeder_loop(ctx, environments, runs, leases, settings, wake))
    try:
        await ctx.stop.wait()
    finally:
        await server.stop(settings.shutdown_grace_s)
        wake.set()
        await asyncio.wait({feeder}, timeout=settings.shutdown_grace_s)
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await raw.aclose()


def main(argv: list[str] | None = None) -> int:
    return run_main("gateway", GatewaySettings, body, argv)
