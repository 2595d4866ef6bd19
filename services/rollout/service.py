"""rollout service: TASKS → sampled groups → ROLLOUTS; follows WEIGHTS into its engine.

The replica talks to its engine only through the SGLang client (SGLang's native HTTP API): a
real SGLang server at `engine_url`, or the embedded engine, which this service starts as a
child process when `engine = embedded` and no URL is given. Each Task becomes `group_size`
generate requests sent together (the engine batches them); each response becomes a Rollout
stamped with the engine's weight version over its tokens and the behaviour logprob of every
token. The Task is acked only when every Rollout of its group is stored in ROLLOUTS and the
group is recorded as generated in LEDGER. A replica that dies mid-generation leaves its Task
unacked: it is redelivered and sampled again under the same trajectory ids, so what it had
already stored is deduplicated.

Multi-turn tasks (`max_turns` > 1 with tools): each sample is an episode of model turns and
tool turns (envs/multiturn.py); a tool call runs as a job on the SANDBOX stream, never in this
process, and its result's tokens are in the response with loss_mask false.

New versions: on a WeightsPublished event the replica fetches from the publisher the delta from
the version it holds (a keyframe the first time, or when a delta cannot be applied), rebuilds
the new version and checks every tensor's hash, writes it as a Hugging Face directory and asks
the engine to load it with `update_weights_from_disk`, then reports the version it serves. Only the newest announced
version is loaded; versions announced meanwhile are skipped, never applied out of order.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import nats.errors
from nats.js import api
from pydantic import Field
from redis.exceptions import RedisError

from policyloop.bus import Delivery, PermanentError, PullWorker, rollouts_subject, weights_subject
from policyloop.cluster.local import free_port
from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.validate import validate_task
from policyloop.engines.partial import Completion, generate_resumable
from policyloop.engines.protocol import GenerateRequest, ModelInfo
from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient
from policyloop.envs.multiturn import ToolSetupError, from_hf, run_episode, sandbox_tools, transcript
from policyloop.envs.tools import ToolCall, UnknownTool, tool_formats
from policyloop.ledger import record_generated
from policyloop.runtime import ServiceContext, ServiceSettings, run_main, run_pull_workers
from policyloop.state.catalog import RunRegistry, StoppedRuns
from policyloop.state.pacing import Pacer
from policyloop.state.progress import RunProgressStore
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import (
    GENERATED_TOKENS,
    RESUBMITTED,
    TOOL_CALLS,
    WEIGHT_PAYLOAD_BYTES,
    WEIGHT_SYNC_FALLBACKS,
    WEIGHT_SYNC_SECONDS,
)
from policyloop.trajectories import generate_request, group_members, record_response
from policyloop.weights.client import WeightClient, sync_weights
from policyloop.weights.codec import WeightSet

log = get_logger(__name__)

class RolloutSettings(ServiceSettings):
    concurrency: int = Field(8, description="Tasks (groups) this replica samples at once.")
    model: str = Field("policy", description="Model whose WeightsPublished events this replica follows.")
    model_path: Path = Field(
        Path("model"), description="Hugging Face directory of the base policy (tokenizer, config)."
    )
    engine: Literal["embedded", "sglang"] = Field("embedded", description="Which engine serves the policy.")
    engine_url: str = Field(
        "", description="Base URL of the engine's HTTP API; empty with engine=embedded starts one as a child process."
    )
    engine_max_batch: int = Field(64, description="Most sequences the embedded engine decodes together.")
    engine_threads: int = Field(1, description="torch threads of the embedded engine process.")
    engine_start_timeout_s: float = Field(120.0, description="How long the engine may take to answer /health.")
    generate_timeout_s: float = Field(300.0, description="Deadline of one generate request.")
    weights_dir: Path = Field(
        Path("runs/local/rollout-weights"),
        description="Where fetched versions are written for the engine to load (one directory per version).",
    )
    publisher_token: str = Field("", description="Bearer token for the publisher, if it wants one.")
    weight_source: Literal["publisher", "colocated"] = Field(
        "publisher", description="publisher: fetch each version (a delta) and load it into the engine. colocated: "
                                 "the learner broadcasts it into the engine (its colocated_engines lists engine_url); "
                                 "the replica waits for the engine to report it, and fetches from the publisher "
                                 "only if that takes longer than colocated_wait_s.")
    colocated_wait_s: float = Field(30.0, description="How long a colocated replica waits for the broadcast.")
    weight_update_mode: Literal["in_place", "retract", "abort"] = Field(
        "in_place", description="How a new version reaches requests in flight (SGLang's pause modes around "
                                "update_weights_from_disk): in_place — paused between two steps, they go on with the "
                                "new weights and keep their KV cache; retract — the same, their cache recomputed with "
                                "the new weights; abort — they end, and the replica resubmits prompt + tokens so far "
                                "with the rest of the budget (partial rollouts). The cache is flushed only with abort "
                                "(SGLang cannot flush while requests are held).")
    max_resubmits: int = Field(8, description="Most resubmissions of one sample cut short by weight updates.")
    engine_health_interval_s: float = Field(
        2.0, description="How often the engine's /health is checked; the replica reports unhealthy while it fails, "
                         "and takes no new Task until it answers again.")
    engine_outage_wait_s: float = Field(
        600.0, description="How long a Task whose engine went away mid-sample waits (holding its message) for the "
                           "engine to answer again before it is handed back; an outage uses up none of its deliveries.")
    groups_per_step: int = Field(32, description="The learner's groups per step (pacing needs it; cluster-wide).")
    max_lag: int = Field(
        1, description="Versions a group may lag when trained; groups beyond it are not started (-1: no pacing)."
    )
    pacing_poll_s: float = Field(0.05, description="How often a paced replica asks again for a slot.")
    tool_timeout_s: float = Field(10.0, description="Wall and CPU seconds of one tool call's sandbox job.")
    tool_reply_timeout_s: float = Field(
        120.0, description="How long a tool call waits for a sandbox's result (queueing included) before the task "
                           "is given back to be sampled again.")
    max_tool_tokens: int = Field(64, ge=3, description="Most tokens of one tool turn (its result is cut to fit).")
    max_tool_chars: int = Field(2000, description="Most characters of a tool's result kept before tokenizing.")


def _die_with_parent() -> None:
    """Runs in the engine child before exec: the kernel sends it SIGTERM when the rollout
    process dies, even by SIGKILL, so no engine outlives its replica."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_embedded_engine(settings: RolloutSettings, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "policyloop.engines.embedded", "--model-path", str(settings.model_path),
         "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(settings.engine_max_batch),
         "--threads", str(settings.engine_threads)],
        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


async def wait_for_engine(client: SGLangClient, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the embedded engine exited with {proc.returncode}")
        if await client.health(timeout_s=2):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine at {client.base_url} did not become healthy within {timeout_s}s")
        await asyncio.sleep(0.25)


def write_version_dir(root: Path, base: Path, weights: WeightSet) -> Path:
    """A Hugging Face directory for the held weights: the base config plus model.safetensors."""
    from policyloop.weights.torch_io import save_safetensors

    target = root / f"v{weights.version:09d}"
    tmp = root / f".v{weights.version:09d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    save_safetensors(weights, tmp / "model.safetensors")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


class WeightFollower:
    """Loads the newest announced version into the engine, one load at a time."""

    def __init__(self, ctx: ServiceContext, settings: RolloutSettings, client: SGLangClient) -> None:
        self.ctx, self.settings, self.client = ctx, settings, client
        self.latest: bus_pb2.WeightsPublished | None = None
        self.announced = asyncio.Event()
        self.loaded_dir: Path | None = None
        self.held: WeightSet | None = None  # the served version's bytes: the base of the next delta
        self._publishers: dict[str, WeightClient] = {}

    def publisher(self, endpoint: str) -> WeightClient:
        """One channel per publisher endpoint, kept across versions (one fetch per step)."""
        if endpoint not in self._publishers:
            self._publishers[endpoint] = WeightClient(endpoint, bearer_token=self.settings.publisher_token)
        return self._publishers[endpoint]

    async def on_event(self, msg) -> None:  # type: ignore[no-untyped-def]
        event = bus_pb2.WeightsPublished()
        event.ParseFromString(msg.data)
        if self.latest is None or event.version > self.latest.version:
            self.latest = event
            self.ctx.detail["announced_version"] = event.version
            log.info("weights_announced", version=event.version, endpoint=event.fetch_endpoint)
            self.announced.set()

    async def resubscribe(self, old):  # type: ignore[no-untyped-def]
        """(Re)makes the ordered consumer of WEIGHTS; None when it cannot be made now (a server
        restarting; in a cluster, making a consumer needs the meta leader). Meanwhile the newest
        announcement is read directly, which needs only the stream's leader: a replica that
        missed its subscription would otherwise never see a new version, and pacing would
        keep it idle."""
        if old is not None:
            try:
                await old.unsubscribe()
            except (TimeoutError, nats.errors.Error):
                pass
        subject = weights_subject(self.settings.model)
        try:
            return await self.ctx.bus.js.subscribe(
                subject, cb=self.on_event, ordered_consumer=True, deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("weights_subscribe_failed", error=repr(exc))
        try:
            stream = self.ctx.bus.topology.stream_for_subject(subject).name
            await self.on_event(await self.ctx.bus.js.get_last_msg(stream, subject))
        except (TimeoutError, nats.errors.Error):
            pass
        return None

    async def run(self) -> None:
        sub = None
        generation = -1
        try:
            while not self.ctx.stop.is_set():
                if sub is None or generation != self.ctx.bus.reconnects:
                    # First, after a failed attempt, or reconnected (maybe to another server of
                    # a cluster): a fresh consumer rather than trusting the old one's recovery.
                    generation = self.ctx.bus.reconnects
                    sub = await self.resubscribe(sub)
                waiter = asyncio.create_task(self.announced.wait())
                stopper = asyncio.create_task(self.ctx.stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                waiter.cancel()
                stopper.cancel()
                if not self.announced.is_set():
                    continue
                self.announced.clear()
                event = self.latest
                if event is None or event.version <= self.ctx.policy_version or self.ctx.stop.is_set():
                    continue
                try:
                    await self.load(event)
                except Exception as exc:  # noqa: BLE001 - keep serving the current version, retry
                    log.error("weights_load_failed", version=event.version, error=repr(exc))
                    await asyncio.sleep(1.0)
                    self.announced.set()
        finally:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except nats.errors.Error:
                    pass
            for client in self._publishers.values():
                await client.close()

    async def load(self, event: bus_pb2.WeightsPublished) -> None:
        if self.settings.weight_source == "colocated":
            if await self.wait_for_broadcast(event.version):
                return
            log.warning("weights_broadcast_missing", version=event.version, waited_s=self.settings.colocated_wait_s)
            await self.fetch_and_load(event)
            await self.client.continue_generation()  # a failed broadcast leaves the engine paused
            return
        await self.fetch_and_load(event)

    async def wait_for_broadcast(self, version: int) -> bool:
        """Whether the engine reports `version` (or a later one) within colocated_wait_s."""
        started = time.monotonic()
        while time.monotonic() - started < self.settings.colocated_wait_s and not self.ctx.stop.is_set():
            served = engine_version(await self.client.model_info())
            if served >= version:
                self.held = None  # the engine's bytes came by broadcast: a later fetch starts from a keyframe
                self.ctx.policy_version = served
                log.info("weights_loaded", version=served, kind="colocated",
                         seconds=round(time.monotonic() - started, 3))
                return True
            await asyncio.sleep(0.05)
        return False

    async def fetch_and_load(self, event: bus_pb2.WeightsPublished) -> None:
        """Fetch (a delta from the held version when possible), verify every tensor, load into
        the engine. Until the engine confirms the new version, the old one keeps serving."""
        started = time.monotonic()
        if self.held is not None and self.held.version == event.version:
            # The engine lost a version this replica still holds verified (it restarted on its
            # base weights): load it again, nothing to fetch.
            weights, report = self.held, None
        else:
            client = self.publisher(event.fetch_endpoint)
            weights, report = await sync_weights(client, event.model, self.held, event.version)
            self.held = weights  # verified: the next delta applies to these bytes
            if report.fallback_reason:
                WEIGHT_SYNC_FALLBACKS.inc()
        loading = time.monotonic()
        directory = await asyncio.to_thread(write_version_dir, self.settings.weights_dir / self.settings.instance_id,
                                            self.settings.model_path, weights)
        # pause → update → continue, as SGLang wants it; the update checks /model_info afterwards.
        mode = self.settings.weight_update_mode
        await self.client.pause_generation(mode)
        try:
            await self.client.update_weights_from_disk(str(directory), weight_version=str(weights.version),
                                                       flush_cache=mode == "abort")
        finally:
            await self.client.continue_generation()
        previous, self.loaded_dir = self.loaded_dir, directory
        self.ctx.policy_version = weights.version
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)
        if report is None:
            log.info("weights_loaded", version=weights.version, kind="held",
                     seconds=round(time.monotonic() - started, 3))
            return
        WEIGHT_SYNC_SECONDS.labels("fetch").observe(report.transfer_s)
        WEIGHT_SYNC_SECONDS.labels("apply").observe(report.apply_s + time.monotonic() - loading)
        WEIGHT_PAYLOAD_BYTES.labels(report.kind).inc(report.payload_bytes)
        self.ctx.detail["weights_fetched"] = {"kind": report.kind, "bytes": report.payload_bytes,
                                              "raw_bytes": report.raw_bytes}
        log.info("weights_loaded", version=weights.version, kind=report.kind, bytes=report.payload_bytes,
                 fallback=report.fallback_reason or None, seconds=round(time.monotonic() - started, 3))


class EngineHealth:
    """Whether the engine answers /health (and, when this replica started it, still runs). While
    it does not, the replica reports unhealthy and takes no new Task; a sample whose engine went
    away waits for it (`wait_recovered`). An engine that comes back is brought to a policy
    version again (`resync`): a restarted SGLang serves its base weights as "default"."""

    def __init__(self, client: SGLangClient, interval_s: float, proc: subprocess.Popen | None,
                 resync: Callable[[], Awaitable[None]]) -> None:
        self.client, self.interval_s, self.proc, self.resync = client, interval_s, proc, resync
        self.answering = True
        self.recovered = asyncio.Event()
        self.recovered.set()

    def probe(self) -> tuple[bool, str]:
        if self.proc is not None and self.proc.poll() is not None:
            return False, f"the embedded engine exited with {self.proc.returncode}"
        return self.answering, f"the engine at {self.client.base_url} does not answer /health"

    def ready(self) -> bool:
        return self.recovered.is_set() and self.probe()[0]

    async def check(self) -> None:
        answering = await self.client.health(timeout_s=max(1.0, self.interval_s))
        if answering != self.answering:
            log.warning("engine_health_changed", healthy=answering, engine=self.client.base_url)
        if not answering:
            self.recovered.clear()
        elif self.recovered.is_set() and not await self._has_a_version():
            # Restarted between two probes (or behind a load balancer): back at "default".
            log.warning("engine_restart_seen", engine=self.client.base_url)
            self.recovered.clear()
        if answering and not self.recovered.is_set():
            try:
                await self.resync()
            except EngineError as exc:
                log.warning("engine_resync_failed", error=repr(exc))
                answering = False
            else:
                self.recovered.set()
        self.answering = answering

    async def _has_a_version(self) -> bool:
        try:
            version = (await self.client.model_info()).weight_version
        except EngineError:
            return True  # unknown: /health answered, the next probe asks again
        return bool(version) and version.isdigit()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.proc is not None and self.proc.poll() is not None:
                # The replica's own engine died: the replica fails (and is restarted with a new one).
                stop.set()
                raise EngineUnavailable(f"the embedded engine exited with {self.proc.returncode}")
            await self.check()
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def wait_recovered(self, deadline: float, stop: asyncio.Event) -> bool:
        """After a call failed because the engine went away: whether it answers again (and was
        resynced) before `deadline` (monotonic). False at once when the engine still answers:
        then the request itself failed (e.g. timed out), which waiting does not mend."""
        if await self.client.health(timeout_s=max(1.0, self.interval_s)) and await self._has_a_version():
            return False
        self.recovered.clear()
        while not stop.is_set() and time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False  # the replica's own engine died: the replica fails and restarts
            await self.check()
            if self.recovered.is_set():
                return True
            await asyncio.sleep(self.interval_s)
        return False


def engine_version(info: ModelInfo) -> int:
    """The engine's weight version as a policy version (0 for SGLang's "default" and the like)."""
    try:
        return int(info.weight_version or 0)
    except ValueError:
        return 0


async def name_base_version(client: SGLangClient) -> int:
    """The policy version the engine serves. An engine that has not been told one (SGLang boots
    at "default") serves the base weights it was started with: it is relabelled "0", so that
    every sample it makes carries a policy version."""
    info = await client.model_info()
    if info.weight_version and info.weight_version.isdigit():
        return int(info.weight_version)
    log.info("engine_version_named", was=info.weight_version, now="0")
    await client.update_weight_version("0", abort_all_requests=False)
    return 0


def check_engine_settings(settings: RolloutSettings) -> None:
    """Refuses engine settings that cannot work, before anything starts."""
    if settings.weight_source == "colocated" and not settings.engine_url:
        raise ValueError("weight_source=colocated needs engine_url: the learner must reach the same engine")
    if settings.engine == "sglang" and not settings.engine_url:
        raise ValueError("engine=sglang needs engine_url (the SGLang server's address, e.g. http://sglang:30000)")


async def body(ctx: ServiceContext) -> None:
    settings: RolloutSettings = ctx.settings  # type: ignore[assignment]
    from transformers import AutoTokenizer

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(settings.model_path))
    engine_proc = None
    url = settings.engine_url
    check_engine_settings(settings)
    if not url:
        port = free_port()
        engine_proc = start_embedded_engine(settings, port)
        url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, timeout_s=settings.generate_timeout_s)
    try:
        await wait_for_engine(client, engine_proc, settings.engine_start_timeout_s)
        ctx.policy_version = await name_base_version(client)
        follower = WeightFollower(ctx, settings, client)

        resyncing = asyncio.Lock()  # the health loop and waiting samples may all ask at once

        async def resync() -> None:
            async with resyncing:
                served = await name_base_version(client)
                if served != ctx.policy_version:
                    # The engine restarted on its base weights: the newest version is loaded
                    # again before the engine counts as recovered (below), so nothing is
                    # sampled on stale weights.
                    log.warning("engine_version_lost", was=ctx.policy_version, now=served)
                    ctx.policy_version = served
                    follower.announced.set()
                newest = follower.latest.version if follower.latest is not None else 0
                deadline = time.monotonic() + settings.engine_start_timeout_s
                while ctx.policy_version < newest and time.monotonic() < deadline and not ctx.stop.is_set():
                    await asyncio.sleep(0.1)
                if ctx.policy_version < newest:
                    raise EngineUnavailable(f"the restarted engine did not load version {newest} in time")

        engine_health = EngineHealth(client, settings.engine_health_interval_s, engine_proc, resync)
        ctx.add_health_probe("engine", engine_health.probe)
        watch_engine = asyncio.create_task(engine_health.run(ctx.stop))
        ctx.detail.update(tasks_done=0, generated_tokens=0, engine=url)
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

        episode_tokenizer = from_hf(tokenizer)

        async def generate(request: GenerateRequest) -> Completion:
            outage_deadline = time.monotonic() + settings.engine_outage_wait_s  # over all retries
            for attempt in itertools.count():
                try:
                    completion = await generate_resumable(
                        client, request if not attempt else replace(request, rid=f"{request.rid}.e{attempt}"),
                        max_resubmits=settings.max_resubmits)
                    break
                except EngineUnavailable as exc:
                    # The engine went away under this sample: hold the Task (its message stays
                    # ours) until the engine is back, rather than spend one of its deliveries.
                    log.warning("engine_unavailable_mid_sample", rid=request.rid, error=str(exc))
                    if not await engine_health.wait_recovered(outage_deadline, ctx.stop):
                        raise
                except EngineError as exc:
                    if exc.status in (400, 422):  # the engine refuses this request as such: it never will succeed
                        raise PermanentError(f"the engine refused the task's request: {exc}") from exc
                    raise
            if completion.resubmits:
                RESUBMITTED.inc(completion.resubmits)
                ctx.detail["resubmitted"] = int(ctx.detail.get("resubmitted", 0)) + completion.resubmits
            return completion

        def count_tool_call(call: ToolCall, status: str) -> None:
            TOOL_CALLS.labels(call.tool.name, status).inc()
            ctx.detail["tool_calls"] = int(ctx.detail.get("tool_calls", 0)) + 1

        async def sample(task: bus_pb2.Task, traj: bus_pb2.Trajectory) -> None:
            request = generate_request(task, traj, stop_ids)
            if task.max_turns > 1:
                try:
                    formats = tool_formats(list(task.tools))
                    episode = await run_episode(
                        request, generate=generate,
                        run_tool=sandbox_tools(ctx.bus, job_id=f"tool:{traj.trajectory_id}", run_id=task.run_id,
                                               timeout_s=settings.tool_timeout_s,
                                               reply_timeout_s=settings.tool_reply_timeout_s,
                                               max_chars=settings.max_tool_chars, on_result=count_tool_call),
                        tokenizer=episode_tokenizer, formats=formats, max_turns=task.max_turns,
                        max_tool_tokens=settings.max_tool_tokens)
                except (UnknownTool, ToolSetupError) as exc:
                    raise PermanentError(str(exc)) from exc
                record_response(traj, episode.result, transcript(episode.turns, formats), episode.loss_mask)
                traj.turns.extend(episode.turns)
            else:
                result = (await generate(request)).result
                text = episode_tokenizer.decode([t for t in result.output_ids if t not in stop_ids])
                record_response(traj, result, text)
            traj.prompt_text = task.prompt_text

        progress = RunProgressStore(ctx.redis, settings.namespace)
        stopped_runs = StoppedRuns(RunRegistry(ctx.redis, settings.namespace))

        async def run_ended(run_id: str) -> bool:
            try:
                return await stopped_runs.ended(run_id)
            except RedisError as exc:  # unknown: sample it (a stopped run's extra groups are harmless)
                log.warning("run_state_unknown", run=run_id, error=repr(exc))
                return False
        pacer = None if settings.max_lag < 0 else Pacer(
            ctx.redis, settings.namespace, settings.model, groups_per_step=settings.groups_per_step,
            max_lag=settings.max_lag,
        )

        async def handle(delivery: Delivery[bus_pb2.Task]) -> None:
            task = delivery.message
            if delivery.delivery_count == 1 and await run_ended(task.run_id):
                # StopRun: what is still queued of the run is acked unsampled (never generated,
                # so it is in no ledger count). A redelivery is finished instead: it may have
                # published part of its group before a crash.
                ctx.detail["tasks_skipped"] = int(ctx.detail.get("tasks_skipped", 0)) + 1
                return
            while pacer is not None and not await pacer.try_admit(task.task_id, ctx.policy_version):
                ctx.detail["paced"] = True  # the learner is behind: wait rather than sample stale
                await asyncio.sleep(settings.pacing_poll_s)
            ctx.detail["paced"] = False
            prompt_ids = list(task.prompt_token_ids) or tokenizer(task.prompt_text, add_special_tokens=False).input_ids
            if not prompt_ids:
                raise PermanentError("prompt_text: the model's tokenizer gives no tokens for it "
                                     "(give prompt_token_ids)")
            group = group_members(task, settings.instance_id)
            for traj in group:
                traj.prompt_token_ids.extend([] if traj.prompt_token_ids else prompt_ids)
            await asyncio.gather(*(sample(task, traj) for traj in group))
            for traj in group:
                await ctx.bus.publish(rollouts_subject(task.environment), traj, traj.trajectory_id)
            await record_generated(ctx.bus, group, settings.instance_id)
            generated = sum(len(t.response_token_ids) for t in group)
            try:
                await progress.record_generated(task.run_id, generated)
            except RedisError as exc:  # figures only: the group is stored and recorded already
                log.warning("progress_not_recorded", error=repr(exc))
            GENERATED_TOKENS.labels(task.environment).inc(generated)
            ctx.detail["tasks_done"] = int(ctx.detail["tasks_done"]) + 1
            ctx.detail["generated_tokens"] = int(ctx.detail["generated_tokens"]) + generated

        worker = PullWorker(
            ctx.bus, ctx.bus.topology.consumers["rollout"], bus_pb2.Task, handle,
            service="rollout", concurrency=settings.concurrency, validator=validate_task, ready=engine_health.ready,
        )
        follow = asyncio.create_task(follower.run())
        try:
            await run_pull_workers(ctx, worker)
        finally:
            await asyncio.gather(follow, watch_engine, return_exceptions=True)
        if watch_engine.done() and not watch_engine.cancelled() and watch_engine.exception() is not None:
            raise RuntimeError("the engine is gone") from watch_engine.exception()
    finally:
        await client.close()
        if engine_proc is not None:
            engine_proc.terminate()
            try:
                await asyncio.to_thread(engine_proc.wait, 15)
            except subprocess.TimeoutExpired:
                engine_proc.kill()


def main(argv: list[str] | None = None) -> int:
    return run_main("rollout", RolloutSettings, body, argv)
