"""A rollout replica's work on TASKS: admission (stopped runs, pacing), sampling a group through
the engine (single-turn, or multi-turn episodes whose tool calls run in the sandbox), and
storing the group in ROLLOUTS and LEDGER before the Task is acked.

Each Task becomes `group_size` generate requests sent together (the engine batches them); each
response becomes a Rollout stamped with the engine's weight version over its tokens and the
behaviour logprob of every token. A replica that dies mid-generation leaves its Task unacked: it
is redelivered and sampled again under the same trajectory ids, so what was already stored is
deduplicated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

from redis.exceptions import RedisError

from policyloop.bus import Delivery, PermanentError, PullWorker, rollouts_subject
from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.contracts.validate import validate_task
from policyloop.contracts.versions import oldest_version
from policyloop.engines.adapters import AdapterLease
from policyloop.engines.partial import Completion, generate_resumable, generate_resumable_batch
from policyloop.engines.protocol import GenerateRequest
from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient
from policyloop.envs.chat_env import EnvironmentFailed, NoChatTemplate, chat_template, task_reset
from policyloop.envs.chat_env import transcript as environment_transcript
from policyloop.envs.driven import Driver, driver_of, open_environment
from policyloop.envs.episode import EpisodeResult, SingleTurn, run_episodes
from policyloop.envs.tool_episodes import ToolSetupError, from_hf, transcript
from policyloop.envs.tools import ToolCall, UnknownTool, tool_formats
from policyloop.ledger import record_generated
from policyloop.models.tokenizer import unreadable_characters
from policyloop.rollout.adapters import LoraRuns, stamp_version
from policyloop.rollout.health import EngineHealth
from policyloop.rollout.records import TaskRequestError, generate_request, group_members, record_response
from policyloop.rollout.settings import RolloutSettings
from policyloop.runtime import ServiceContext
from policyloop.state.catalog import RunRegistry, StoppedRuns
from policyloop.state.outcomes import RUN_STOPPED, TaskCount, dropped
from policyloop.state.pacing import Pacer
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry import tracing
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import (
    ENVIRONMENT_FAILURES,
    EPISODE_MODEL_TURNS,
    EPISODE_STEP_REWARD,
    GENERATED_TOKENS,
    RESUBMITTED,
    TOOL_CALLS,
    run_label,
)

log = get_logger(__name__)


class RolloutReplica:
    def __init__(self, ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient, tokenizer: Any,
                 engine_health: EngineHealth, status: status_pb2.RolloutStatus,
                 ready: Callable[[], bool] | None = None, lora: LoraRuns | None = None) -> None:
        self.ctx, self.settings, self.client, self.tokenizer = ctx, settings, client, tokenizer
        self.engine_health, self.status = engine_health, status
        self.ready = ready or engine_health.ready  # whether to take a new Task now
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.episode_tokenizer = from_hf(tokenizer)
        self.progress = RunProgressStore(ctx.redis, settings.namespace)
        self.stopped_runs = StoppedRuns(RunRegistry(ctx.redis, settings.namespace))
        self.pacer = self.pacer_for(settings.model)
        self.lora = lora  # LoRA runs: each samples with its run's adapter, paced by its versions
        self.worker: PullWorker[bus_pb2.Task] | None = None

    def pacer_for(self, model: str) -> Pacer | None:
        settings = self.settings
        return None if settings.max_lag < 0 else Pacer(self.ctx.redis, settings.namespace, model,
                                                       groups_per_step=settings.groups_per_step,
                                                       max_lag=settings.max_lag)

    def pull_worker(self) -> PullWorker[bus_pb2.Task]:
        # A replica of LoRA runs takes their tasks; the others, the full model's runs'.
        consumer = self.ctx.bus.topology.consumers["rollout-lora" if self.lora is not None else "rollout"]
        self.worker = PullWorker(self.ctx.bus, consumer, bus_pb2.Task,
                                 self.handle, service="rollout", concurrency=self.settings.task_concurrency,
                                 validator=validate_task, ready=self.ready)
        return self.worker

    def serving_runs(self, count: int) -> None:
        """LoRA runs: a run's tasks that wait for its pacing hold task slots, so each run served
        gets task_concurrency of them — a paced run cannot take every slot from the others."""
        if self.worker is not None:
            self.worker.concurrency = self.settings.task_concurrency * max(1, count)

    async def handle(self, delivery: Delivery[bus_pb2.Task]) -> None:
        task = delivery.message
        if self.lora is not None:
            await self.lora.serve(task.run_id)
        if not await self._admit(task, delivery.delivery_count):
            return
        group = group_members(task, self.settings.instance_id)
        driver = driver_of(task)
        prompt_ids = [] if driver is not None else self._prompt_ids(task)
        for traj in group:
            traj.prompt_token_ids.extend([] if traj.prompt_token_ids else prompt_ids)
        async with self._adapter(task.run_id) as adapter:
            lora_path = None if adapter is None else adapter.name
            if driver is not None:
                await asyncio.gather(*(self.sample_environment(task, driver, traj, lora_path) for traj in group))
            elif task.max_turns <= 1:
                await self.sample_group(task, group, lora_path)
            else:
                await asyncio.gather(*(self.sample_episode(task, traj, lora_path) for traj in group))
        if self.lora is not None:
            for traj in group:
                stamp_version(traj, 0 if adapter is None else adapter.version)
        await self._store(task, group)

    def _adapter(self, run_id: str) -> AbstractAsyncContextManager[AdapterLease | None]:
        return nullcontext(None) if self.lora is None else self.lora.adapter(run_id)

    async def _admit(self, task: bus_pb2.Task, delivery_count: int) -> bool:
        """False for a first delivery of a stopped run's Task (acked unsampled: never generated,
        so in no ledger count; its run counts it as dropped, run_stopped; a redelivery is finished
        instead, as it may have published part of its group before a crash). Otherwise waits for a
        pacing slot: when the learner is behind, waiting beats sampling what would be dropped as stale."""
        if delivery_count == 1 and await self._run_ended(task.run_id):
            # Accounted for before the ack: a stopped run's counts add up to what it enqueued.
            await self.progress.outcomes.record(task.run_id, dropped(RUN_STOPPED), [TaskCount(task.task_id, 0)])
            self.status.tasks_skipped += 1
            return False
        lora = self.lora
        pacer = self.pacer if lora is None else lora.pacers.get(task.run_id)
        while pacer is not None:
            served = self.ctx.policy_version if lora is None else lora.served.version(task.run_id)
            if await pacer.try_admit(task.task_id, served):
                break
            self.status.paced = True
            # Only this replica's engine moving to a newer version can open a slot for it.
            if lora is None:
                await self.ctx.version_moved(served, self.settings.pacing_poll_s)
            else:
                await lora.served.version_moved(task.run_id, served, self.settings.pacing_poll_s)
                await lora.catch_up(task.run_id, every_s=self.settings.pacing_poll_s)
        self.status.paced = False
        return True

    async def _run_ended(self, run_id: str) -> bool:
        try:
            return await self.stopped_runs.ended(run_id)
        except RedisError as exc:  # unknown: sample it (a stopped run's extra groups are harmless)
            log.warning("run_state_unknown", run=run_id, error=repr(exc))
            return False

    def _prompt_ids(self, task: bus_pb2.Task) -> list[int]:
        prompt_ids = list(task.prompt_token_ids) or self.tokenizer(task.prompt_text, add_special_tokens=False).input_ids
        if not prompt_ids:
            raise PermanentError("prompt_text: the model's tokenizer gives no tokens for it (give prompt_token_ids)")
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if not task.prompt_token_ids and unk is not None and unk in prompt_ids:
            # Sampled, the model would see <unk> where the text said something else.
            unknown = ", ".join(repr(c) for c in unreadable_characters(self.tokenizer, task.prompt_text)[:20])
            raise PermanentError(f"prompt_text: the model's tokenizer has no token for {unknown} (give "
                                 "prompt_token_ids, or text the tokenizer covers)")
        return prompt_ids

    async def _store(self, task: bus_pb2.Task, group: list[bus_pb2.Trajectory]) -> None:
        """ROLLOUTS (the group as one message), then LEDGER; only then may the Task be acked."""
        await self.ctx.bus.publish(rollouts_subject(task.environment),
                                   bus_pb2.TrajectoryGroup(group_id=task.task_id, trajectories=group), task.task_id)
        await record_generated(self.ctx.bus, group, self.settings.instance_id)
        generated = sum(len(t.response_token_ids) for t in group)
        try:
            await self.progress.record_generated(task.run_id, generated)
        except RedisError as exc:  # figures only: the group is stored and recorded already
            log.warning("progress_not_recorded", error=repr(exc))
        GENERATED_TOKENS.labels(run_label(task.run_id), task.environment).inc(generated)
        self.status.tasks_done += 1
        self.status.generated_tokens += generated

    def _request(self, task: bus_pb2.Task, traj: bus_pb2.Trajectory, lora_path: str | None = None) -> GenerateRequest:
        try:
            request = generate_request(task, traj, self.stop_ids)
        except TaskRequestError as exc:
            raise PermanentError(str(exc)) from exc
        return request if lora_path is None else request.model_copy(update={"lora_path": lora_path})

    async def sample_group(self, task: bus_pb2.Task, group: list[bus_pb2.Trajectory],
                           lora_path: str | None = None) -> None:
        """A single-turn group: one engine call for its requests together (SGLang's batch form).
        Each member's `sample` span covers that call and the reading of its own answer."""
        requests = [self._request(task, traj, lora_path) for traj in group]
        parent, started_ns = tracing.current(), time.time_ns()
        episodes = await run_episodes(requests, [SingleTurn() for _ in group], generate_batch=self.counted_batch,
                                      decode=self.episode_tokenizer.decode)
        for traj, episode in zip(group, episodes, strict=True):
            record_response(traj, episode.result, episode.turns[0].text)
            traj.prompt_text = task.prompt_text
            observe_episode(task.environment, episode)
            if tracing.enabled():
                tracing.record_span("sample", parent, started_ns, time.time_ns(), self._sample_attributes(task, traj))

    async def sample_episode(self, task: bus_pb2.Task, traj: bus_pb2.Trajectory, lora_path: str | None = None
                             ) -> None:
        """One member of a multi-turn group: its episode, under its own `sample` span."""
        with tracing.span("sample", attributes={tracing.TRAJECTORY_ID: traj.trajectory_id,
                                                tracing.ENVIRONMENT: task.environment}) as made:
            await self._episode(task, traj, self._request(task, traj, lora_path))
            made.set_attributes(self._sample_attributes(task, traj))
        traj.prompt_text = task.prompt_text

    @staticmethod
    def _sample_attributes(task: bus_pb2.Task, traj: bus_pb2.Trajectory) -> dict[str, str | int]:
        return {tracing.TRAJECTORY_ID: traj.trajectory_id, tracing.ENVIRONMENT: task.environment,
                "policyloop.response_tokens": len(traj.response_token_ids),
                "policyloop.turns": max(1, len(traj.turns)),
                "policyloop.oldest_version": oldest_version([traj]),
                "policyloop.newest_version": max((v.version for v in traj.version_spans), default=0)}

    async def _episode(self, task: bus_pb2.Task, traj: bus_pb2.Trajectory, request: GenerateRequest) -> None:
        """Model turns and tool turns; a tool call runs as a job on the SANDBOX stream, and its
        result's tokens are in the response with loss_mask false."""
        settings = self.settings
        try:
            formats = tool_formats(list(task.tools))
            tools = settings.episode(self.ctx.bus, job_id=f"tool:{traj.trajectory_id}", run_id=task.run_id,
                                     tokenizer=self.episode_tokenizer, formats=formats,
                                     on_result=self._count_tool_call)
            [episode] = await run_episodes([request], [tools], generate_batch=self.counted_batch,
                                           decode=self.episode_tokenizer.decode, max_turns=task.max_turns)
        except (UnknownTool, ToolSetupError) as exc:
            raise PermanentError(str(exc)) from exc
        record_response(traj, episode.result, transcript(episode.turns, formats), episode.loss_mask)
        traj.turns.extend(episode.turns)
        observe_episode(task.environment, episode)

    async def sample_environment(self, task: bus_pb2.Task, driver: Driver, traj: bus_pb2.Trajectory,
                                 lora_path: str | None) -> None:
        """One member of the group of an environment that drives its episodes (a program in a
        sandbox session, an OpenEnv server's session): its episode, in a session of its own. A
        failed episode fails the Task (retried, then dead-lettered with the reason): no partial
        episode is trained."""
        with tracing.span("sample", attributes={tracing.TRAJECTORY_ID: traj.trajectory_id,
                                                tracing.ENVIRONMENT: task.environment}) as made:
            try:
                template = chat_template(self.tokenizer)
            except NoChatTemplate as exc:
                raise PermanentError(str(exc)) from exc
            try:
                async with open_environment(self.ctx.bus, driver, task_reset(task), template=template,
                                            job_id=f"env:{traj.trajectory_id}", run_id=task.run_id,
                                            open_timeout_s=self.settings.tool_reply_timeout_s) as (episode, prompt):
                    del traj.prompt_token_ids[:]
                    traj.prompt_token_ids.extend(prompt)
                    [result] = await run_episodes(
                        [self._request(task, traj, lora_path)], [episode], generate_batch=self.counted_batch,
                        decode=self.episode_tokenizer.decode, max_turns=max(1, task.max_turns))
            except EnvironmentFailed as exc:
                ENVIRONMENT_FAILURES.labels(task.environment).inc()
                log.warning("environment_failed", environment=task.environment, trajectory=traj.trajectory_id,
                            error=str(exc))
                raise
            record_response(traj, result.result, environment_transcript(result.turns), result.loss_mask)
            traj.turns.extend(result.turns)
            traj.prompt_text = self.episode_tokenizer.decode(traj.prompt_token_ids)
            observe_episode(task.environment, result)
            made.set_attributes(self._sample_attributes(task, traj))

    def _count_tool_call(self, call: ToolCall, status: str) -> None:
        TOOL_CALLS.labels(call.tool.name, status).inc()
        self.status.tool_calls += 1

    async def counted_batch(self, requests: list[GenerateRequest]) -> list[Completion]:
        """generate_batch, its resubmissions counted (a round of the episode loop)."""
        completions = await self.generate_batch(requests)
        for completion in completions:
            self._count_resubmits(completion)
        return completions

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[Completion]:
        """Samples in one engine call (SGLang's batch form when there are several), each resumed on
        its own across weight updates that abort it; the caller counts the resubmissions. When the
        engine goes away under them, the Task (its message still ours) waits for the engine to come
        back rather than spend one of its deliveries."""
        outage_deadline = time.monotonic() + self.settings.engine_outage_wait_s  # over all retries
        max_resubmits = self.settings.max_resubmits
        attempt = 0
        while True:
            try:
                tries = [r.model_copy(update={"rid": f"{r.rid}.e{attempt}"}) for r in requests] if attempt else requests
                if len(tries) == 1:
                    return [await generate_resumable(self.client, tries[0], max_resubmits=max_resubmits)]
                return await generate_resumable_batch(self.client, tries, max_resubmits=max_resubmits)
            except EngineUnavailable as exc:
                log.warning("engine_unavailable_mid_sample", rid=requests[0].rid, error=str(exc))
                if not await self.engine_health.wait_recovered(outage_deadline, self.ctx.stop):
                    raise
            except EngineError as exc:
                if exc.status in (400, 422):  # the engine refuses this request as such: it never will succeed
                    raise PermanentError(f"the engine refused the task's request: {exc}") from exc
                raise
            attempt += 1

    def _count_resubmits(self, completion: Completion) -> None:
        if completion.resubmits:
            RESUBMITTED.inc(completion.resubmits)
            self.status.resubmitted += completion.resubmits


def observe_episode(environment: str, episode: EpisodeResult) -> None:
    """Its model turns, and each step reward its environment gave. An environment's step rewards
    and failures are exported from its first episode on, at zero until it has any, so that "none"
    reads as 0 rather than as no data."""
    EPISODE_MODEL_TURNS.labels(environment).observe(
        sum(t.role == bus_pb2.Turn.ROLE_MODEL for t in episode.turns))
    step_rewards = EPISODE_STEP_REWARD.labels(environment)
    for reward in episode.step_rewards:
        step_rewards.observe(reward)
    ENVIRONMENT_FAILURES.labels(environment)
