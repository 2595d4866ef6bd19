"""LoopService: environments and runs over gRPC. Environments and runs live in Redis, so any
gateway replica can answer for any run; the feeder (policyloop.gateway.feeder) publishes runs'
Tasks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import redis.exceptions

from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.envs.spec import group_size
from policyloop.gateway.errors import FailedPrecondition, InvalidField
from policyloop.gateway.feeding import tasks_total
from policyloop.gateway.model_context import ModelContext
from policyloop.gateway.validation import (
    MAX_ENVIRONMENT_BYTES,
    MAX_TASKS_PER_ENVIRONMENT,
    check_run_against_learner,
    environment_key,
    lora_spec,
    prepare_environment,
    validate_start_run,
)
from policyloop.releases.evals import RUN_EVALS_SHOWN, EvalStore
from policyloop.releases.promotion import Promoter, PromotionLog, PromotionRefused
from policyloop.rl.settings import run_policy_model
from policyloop.runtime.agreement import advertised_learner
from policyloop.state import HeartbeatRegistry, VersionRegistry
from policyloop.state.catalog import TERMINAL_STATES, EnvironmentCatalog, EnvironmentConflict, RunConflict, RunRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger

log = get_logger(__name__)


_REFUSALS = {"invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
             "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION, "not_found": grpc.StatusCode.NOT_FOUND}


@dataclass(frozen=True)
class GatewayStores:
    """The loop's state the gateway reads and writes (Redis)."""

    environments: EnvironmentCatalog
    runs: RunRegistry
    versions: VersionRegistry
    progress: RunProgressStore
    heartbeats: HeartbeatRegistry
    evals: EvalStore
    promotions: PromotionLog


class EnvironmentUpload:
    """Assembles an UploadEnvironment stream: the first message carries the environment, every
    later one more tasks. Refuses the stream as soon as it goes past the bounds, before it is held
    in memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.env: loop_pb2.Environment | None = None
        self.messages = 0
        self.received = 0

    def add(self, message: loop_pb2.UploadEnvironmentRequest) -> None:
        i = self.messages
        self.messages += 1
        self.received += message.ByteSize()
        if self.received > self.max_bytes:
            raise InvalidField("environment", f"larger than {self.max_bytes} bytes")
        if self.env is None:
            if not message.HasField("environment"):
                raise InvalidField("environment", "the first message must carry the environment")
            self.env = loop_pb2.Environment()
            self.env.CopyFrom(message.environment)
        elif message.HasField("environment"):
            raise InvalidField(f"messages[{i}].environment", "only the first message carries the environment")
        self.env.tasks.extend(message.tasks)
        self.env.eval_tasks.extend(message.eval_tasks)
        if len(self.env.tasks) > MAX_TASKS_PER_ENVIRONMENT:
            raise InvalidField("environment.tasks", f"at most {MAX_TASKS_PER_ENVIRONMENT}")
        if len(self.env.eval_tasks) > MAX_TASKS_PER_ENVIRONMENT:
            raise InvalidField("environment.eval_tasks", f"at most {MAX_TASKS_PER_ENVIRONMENT}")

    def environment(self) -> loop_pb2.Environment:
        if self.env is None:
            raise InvalidField("environment", "the stream carried no message")
        return self.env


class LoopServicer(loop_pb2_grpc.LoopServiceServicer):
    def __init__(self, stores: GatewayStores, *, wake_feeder: asyncio.Event, stop: asyncio.Event,
                 watch_poll_s: float, model: ModelContext | None = None,
                 max_environment_bytes: int = MAX_ENVIRONMENT_BYTES, promoter: Promoter | None = None) -> None:
        self.stores = stores
        self.promoter = promoter
        self.wake_feeder = wake_feeder
        self.stop = stop
        self.watch_poll_s = watch_poll_s
        self.model = model
        self.max_environment_bytes = max_environment_bytes

    async def SubmitEnvironment(self, request: loop_pb2.SubmitEnvironmentRequest,
                                context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        return await self._store_environment(request.environment, context)

    async def UploadEnvironment(self, requests: AsyncIterator[loop_pb2.UploadEnvironmentRequest],
                                context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        upload = EnvironmentUpload(self.max_environment_bytes)
        try:
            async for message in requests:
                upload.add(message)
            env = upload.environment()
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("environment_uploaded", messages=upload.messages)
        return await self._store_environment(env, context)

    async def _store_environment(self, env: loop_pb2.Environment,
                                 context: grpc.aio.ServicerContext) -> loop_pb2.SubmitEnvironmentResponse:
        if env.ByteSize() > self.max_environment_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"environment: larger than {self.max_environment_bytes} bytes")
        try:
            # In a thread: tokenizing a large environment's prompts must not stall other calls.
            await asyncio.to_thread(prepare_environment, env, self.model)
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        key = environment_key(env.name, env.version)
        try:
            created = await self.stores.environments.put(key, env)
        except EnvironmentConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"environment: {exc}")
        log.info("environment_submitted", environment=key, tasks=len(env.tasks), created=created)
        return loop_pb2.SubmitEnvironmentResponse(environment=key, num_tasks=len(env.tasks), created=created,
                                                  group_size=group_size(env))

    async def StartRun(self, request: loop_pb2.StartRunRequest,
                       context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        try:
            learner = await advertised_learner(self.stores.heartbeats)
        except redis.exceptions.RedisError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the learner's settings: {exc}")
        try:
            validate_start_run(request)
            check_run_against_learner(request, learner)
        except FailedPrecondition as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        environments = await self._run_environments(request, context)
        run_id = request.run_id or f"run-{uuid.uuid4().hex[:12]}"
        stored = loop_pb2.StartRunRequest()
        stored.CopyFrom(request)
        stored.run_id = run_id
        if not stored.model:
            stored.model = learner.loop.model if learner is not None else "policy"
        if not stored.HasField("max_lag") and learner is not None:
            stored.max_lag = learner.loop.max_lag  # what the run gets, for GetRun/WatchRun
        if stored.HasField("lora"):
            stored.lora.CopyFrom(lora_spec(request.lora).to_proto())  # its defaults, spelled out
        try:
            batch = learner.loop.groups_per_step if learner is not None else 1
            # The version it starts from: the evaluator's baseline (a LoRA run's adapter starts as the base).
            start = 0 if stored.HasField("lora") else await self.stores.versions.get(stored.model)
            await self.stores.runs.create(run_id, stored, tasks_total(stored, environments, batch), start)
        except RunConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"run_id: {exc}")
        log.info("run_started", run=run_id, environments=list(environments))
        self.wake_feeder.set()
        return await self._run(run_id)

    async def _run_environments(self, request: loop_pb2.StartRunRequest,
                                context: grpc.aio.ServicerContext) -> dict[str, loop_pb2.Environment]:
        environments = {}
        for i, mix in enumerate(request.environments):
            env = await self.stores.environments.get(mix.environment)
            if env is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"environments[{i}].environment: {mix.environment} was never submitted")
            environments[mix.environment] = env
        return environments

    async def StopRun(self, request: loop_pb2.StopRunRequest,
                      context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        run = await self._run_or_abort(request.run_id, context)
        if run.state not in TERMINAL_STATES:
            await self.stores.runs.set_state(run.run_id, loop_pb2.RUN_STATE_STOPPED)
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
            if run.state in TERMINAL_STATES or self.stop.is_set():
                return
            await asyncio.sleep(self.watch_poll_s)
            run = await self._run(run.run_id)

    async def ListPolicies(self, request: loop_pb2.ListPoliciesRequest,
                           context: grpc.aio.ServicerContext) -> loop_pb2.ListPoliciesResponse:
        policies = [
            loop_pb2.Policy(model=model, version=version, updated_unix_ms=updated)
            for model, (version, updated) in sorted((await self.stores.versions.all()).items())
        ]
        return loop_pb2.ListPoliciesResponse(policies=policies)

    async def PromoteVersion(self, request: loop_pb2.PromoteVersionRequest,
                             context: grpc.aio.ServicerContext) -> loop_pb2.Promotion:
        promoter = await self._promoter_or_abort(request.run_id, context)
        try:
            promotion = await promoter.promote(request.run_id, request.version, request.reason, force=request.force)
        except PromotionRefused as exc:
            await self._refuse(exc, context)
        log.info("version_promoted", run=request.run_id, version=promotion.version, sequence=promotion.sequence)
        return promotion

    async def RollbackVersion(self, request: loop_pb2.RollbackVersionRequest,
                              context: grpc.aio.ServicerContext) -> loop_pb2.Promotion:
        promoter = await self._promoter_or_abort(request.run_id, context)
        try:
            promotion = await promoter.rollback(request.run_id, request.version, request.reason)
        except PromotionRefused as exc:
            await self._refuse(exc, context)
        log.info("version_rolled_back", run=request.run_id, version=promotion.version, sequence=promotion.sequence)
        return promotion

    async def ListVersions(self, request: loop_pb2.ListRunVersionsRequest,
                           context: grpc.aio.ServicerContext) -> loop_pb2.ListRunVersionsResponse:
        promoter = await self._promoter_or_abort(request.run_id, context)
        model = await promoter.policy_model(request.run_id)
        try:
            held = await promoter.held_versions(model)
        except PromotionRefused:
            held = []
        evals = {e.version: e for e in await self.stores.evals.all(request.run_id)}
        history = await self.stores.promotions.history(request.run_id)
        current = history[-1] if history else None
        rows: dict[int, loop_pb2.RunVersion] = {}
        for info in held:
            rows[info.version] = loop_pb2.RunVersion(version=info.version, step=info.step,
                                                     created_unix_ms=info.created_unix_ms, kept=True)
        for version, result in evals.items():
            rows.setdefault(version, loop_pb2.RunVersion(version=version, step=result.step)).eval.CopyFrom(result)
        for promotion in history:
            rows.setdefault(promotion.version, loop_pb2.RunVersion(version=promotion.version)) \
                .promotions.append(promotion.sequence)
        if current is not None:
            rows[current.version].serving = True
        response = loop_pb2.ListRunVersionsResponse(versions=[rows[v] for v in sorted(rows)])
        if current is not None:
            response.promotion.CopyFrom(current)
        return response

    async def _promoter_or_abort(self, run_id: str, context: grpc.aio.ServicerContext) -> Promoter:
        if not run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id: is empty")
        if await self.stores.runs.definition(run_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run_id: no run {run_id}")
        if self.promoter is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this gateway cannot reach a publisher to keep versions")
        return self.promoter

    async def _refuse(self, exc: PromotionRefused, context: grpc.aio.ServicerContext) -> None:
        await context.abort(_REFUSALS[exc.kind], str(exc))

    async def _run(self, run_id: str) -> loop_pb2.Run:
        definition = await self.stores.runs.definition(run_id)
        version = 0
        if definition is not None:
            # A LoRA run's policy is its own adapter, with a version sequence of its own.
            model = run_policy_model(run_id, definition)
            version = await self.stores.versions.get(model)
        run = await self.stores.runs.get(run_id, policy_version=version)
        assert run is not None
        run.progress.CopyFrom(await self.stores.progress.get(run_id))
        progress = run.progress
        accounted = progress.tasks_trained + progress.tasks_dropped + progress.tasks_dead_lettered
        # The feeder records its count every so often: a task accounted for was certainly enqueued.
        run.tasks_enqueued = max(run.tasks_enqueued, accounted)
        progress.tasks_in_flight = run.tasks_enqueued - accounted
        run.evals.extend(await self.stores.evals.newest(run_id, RUN_EVALS_SHOWN))
        _, promotion = await self.stores.promotions.current(run_id)
        if promotion is not None:
            run.promotion.CopyFrom(promotion)
        return run

    async def _run_or_abort(self, run_id: str, context: grpc.aio.ServicerContext) -> loop_pb2.Run:
        if not run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id: is empty")
        if await self.stores.runs.definition(run_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run_id: no run {run_id}")
        return await self._run(run_id)
