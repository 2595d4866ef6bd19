"""The evaluator's loop: it follows WEIGHTS for every model, and for each k-th version loads it
into its own engine (nothing else is served there, so every answer comes from that version),
scores the eval splits of the runs training that policy, judges the result against the run's
best, records it, and promotes by rule when asked to. Training never waits for it: a busy
evaluator skips to the newest k-th version."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import nats.js.errors

from policyloop.bus import Bus, weights_subject
from policyloop.bus.newest import NewestPerSubject
from policyloop.bus.topology import SUBJECT_PREFIX
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.envs.chat_env import EnvironmentFailed, NoChatTemplate, chat_template, task_reset
from policyloop.envs.driven import open_environment
from policyloop.envs.episode import Episode
from policyloop.envs.tool_episodes import from_hf
from policyloop.envs.tools import tool_formats
from policyloop.evaluation.scoring import EvalItem, EvaluationError, eval_items, score_version, version_eval
from policyloop.evaluation.settings import EvaluatorSettings
from policyloop.releases.evals import EvalStore, record_eval
from policyloop.releases.promotion import Promoter, PromotionLog
from policyloop.releases.verdict import judge, rule_promotes
from policyloop.rl.settings import LoraSpec, run_policy_model
from policyloop.scorers.registry import ScorerRegistry
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import EVAL_PASS_RATE, EVAL_SECONDS, EVAL_VERSION, EVALUATIONS, run_label
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.sync import sync_weights

if TYPE_CHECKING:
    from policyloop.engines.adapters import ServedAdapters

log = get_logger(__name__)

# Runs in these states are still training: their model's new versions are theirs.
TRAINING_STATES = (loop_pb2.RUN_STATE_RUNNING, loop_pb2.RUN_STATE_STOPPING, loop_pb2.RUN_STATE_FINISHED)


def export_eval(result: loop_pb2.VersionEval, newest: dict[str, int]) -> None:
    """The result as metrics: its verdict and time always, its pass rates when it is the run's
    newest version evaluated (`newest`: by run; a version evaluated late does not move the gauges
    back)."""
    run = run_label(result.run_id)
    EVALUATIONS.labels(run, "regressed" if result.regressed else "passed").inc()
    EVAL_SECONDS.observe(result.seconds)
    if result.version < newest.get(run, 0):
        return
    newest[run] = result.version
    EVAL_VERSION.labels(run).set(result.version)
    rates = [("all", result.pass_rate, result.pass_rate_low, result.pass_rate_high)] + [
        (e.environment, e.pass_rate, e.pass_rate_low, e.pass_rate_high) for e in result.environments]
    for environment, point, low, high in rates:
        for bound, value in (("low", low), ("point", point), ("high", high)):
            EVAL_PASS_RATE.labels(run, environment, bound).set(value)


class PinnedEngine:
    """The evaluator's engine, holding exactly one version: each version is fetched (a delta
    from the one held when possible), verified, and loaded before anything is sampled. The
    engine is reached (an embedded one started) on the first version to evaluate, so an
    evaluator with nothing to evaluate costs no engine."""

    def __init__(self, connect: Callable[[], Awaitable[SGLangClient]], publisher: Callable[[str], WeightClient],
                 weights_dir: Path, model_path: Path, adapter_source: Literal["tensors", "directory"] = "tensors"
                 ) -> None:
        self.connect, self.publisher = connect, publisher
        self.weights_dir, self.model_path, self.adapter_source = weights_dir, model_path, adapter_source
        self._client: SGLangClient | None = None
        self.held: WeightSet | None = None
        self.loaded_dir: Path | None = None
        self.adapters: ServedAdapters | None = None  # LoRA runs' adapters, loaded beside the base
        self.base_loaded = False  # the engine serves model_path's weights (version 0)

    @property
    def client(self) -> SGLangClient:
        if self._client is None:
            raise RuntimeError("the engine is reached on the first pin")
        return self._client

    async def pin(self, event: bus_pb2.WeightsPublished) -> None:
        """The engine serves exactly `event.version` (0: the base weights of model_path)."""
        if self._client is None:
            self._client = await self.connect()  # it starts on the base, labelled 0
            self.base_loaded = True
        if event.version == 0:
            if not self.base_loaded:
                self.held = None
                await self.client.update_weights_from_disk(str(self.model_path), weight_version="0")
                self.base_loaded = True
            return
        if self.held is not None and self.held.version == event.version:
            return
        from policyloop.weights.torch_io import write_version_dir  # torch, which only loading needs

        weights, _ = await sync_weights(self.publisher(event.fetch_endpoint), event.model, self.held, event.version)
        directory = await asyncio.to_thread(write_version_dir, self.weights_dir, self.model_path, weights)
        self.held, self.base_loaded = None, False  # until the engine confirms it, nothing held is what it serves
        await self.client.update_weights_from_disk(str(directory), weight_version=str(weights.version))
        self.held = weights
        previous, self.loaded_dir = self.loaded_dir, directory
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)

    async def pin_adapter(self, run_id: str, spec: LoraSpec, event: bus_pb2.WeightsPublished) -> str:
        """Loads a LoRA run's adapter at the announced version beside the base (fetched as a delta
        from the one held when possible, verified) and returns its name in the engine: the
        lora_path that samples with exactly that version (the name carries it)."""
        from policyloop.engines.adapters import ServedAdapters  # torch, which only adapters need

        if self._client is None:
            self._client = await self.connect()
        if self.adapters is None:
            self.adapters = ServedAdapters(self._client, self.weights_dir / "adapters", self.publisher,
                                           self.adapter_source)
        self.adapters.serve(run_id, spec, event.model)
        await self.adapters.update(run_id, event)
        pinned = self.adapters.current(run_id)
        if pinned is None or pinned.version != event.version:
            held = pinned.version if pinned is not None else 0
            raise EvaluationError(f"run {run_id}'s adapter is at version {held}, not {event.version}: a version "
                                  f"older than the one held is not evaluated")
        return pinned.name


class Evaluator:
    def __init__(self, bus: Bus, runs: RunRegistry, environments: EnvironmentCatalog, store: EvalStore,
                 engine: PinnedEngine, tokenizer: Any, registry: ScorerRegistry, settings: EvaluatorSettings,
                 promoter: Promoter | None = None) -> None:
        self.bus, self.runs, self.environments, self.store = bus, runs, environments, store
        self.engine, self.tokenizer, self.registry, self.settings = engine, tokenizer, registry, settings
        self.promoter = promoter
        self.pending: dict[str, bus_pb2.WeightsPublished] = {}  # model → newest version due
        self.due = asyncio.Event()
        self.evaluated = 0
        self.last_version = 0
        self.exported: dict[str, int] = {}  # run label → the newest version in the pass-rate gauges
        self.seen_running: set[str] = set()  # runs seen running: their baseline is done, their end is due
        self.ended_at: dict[str, float] = {}  # runs seen to end, and when (monotonic)
        self.settled: set[str] = set()       # runs with nothing more to evaluate at their start or end
        self._definitions: dict[str, loop_pb2.StartRunRequest] = {}
        self._environments: dict[str, loop_pb2.Environment | None] = {}  # None: it has no eval split
        stop = tokenizer.eos_token_id
        self.stop_ids: tuple[int, ...] = (stop,) if stop is not None else ()

    async def on_event(self, msg) -> None:  # type: ignore[no-untyped-def]
        event = bus_pb2.WeightsPublished.FromString(msg.data)
        if event.version % self.settings.every_versions:
            return
        held = self.pending.get(event.model)
        if held is None or event.version > held.version:
            self.pending[event.model] = event
            self.due.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Evaluates versions as they are due until `stop`. The WEIGHTS subscription is made again
        after a reconnect; it then delivers each model's newest announcement."""
        announcements = NewestPerSubject(self.bus, f"{SUBJECT_PREFIX}.weights.>", self.on_event)
        try:
            while not stop.is_set():
                await announcements.ensure()
                waiter = asyncio.create_task(self.due.wait())
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
                waiter.cancel()
                stopper.cancel()
                try:
                    if self.settings.run_ends:
                        await self.follow_runs()
                except Exception as exc:  # noqa: BLE001 - a baseline failing must not end the evaluator
                    log.error("run_evaluation_failed", error=repr(exc))
                if not self.due.is_set():
                    continue
                self.due.clear()
                while self.pending and not stop.is_set():
                    model = min(self.pending, key=lambda m: self.pending[m].published_unix_ms)
                    event = self.pending.pop(model)
                    try:
                        await self.evaluate(event)
                    except Exception as exc:  # noqa: BLE001 - one version failing must not end the evaluator
                        log.error("evaluation_failed", model=event.model, version=event.version, error=repr(exc))
        finally:
            await announcements.close()

    async def follow_runs(self) -> None:
        """Each run's before and after, whatever `every_versions` says: the version it started
        from (Run.start_version) when it is first seen running, and its newest version when it is
        seen to end, and again while newer versions of it land within `end_grace_s` (samples it
        generated before it stopped). An ended run's newest version is not evaluated while another
        run trains the same policy (it may be that run's)."""
        for run_id in await self.runs.run_ids():
            if run_id in self.settled:
                continue
            run, definition = await self.runs.get(run_id), await self.definition(run_id)
            environments = await self.eval_environments(definition) if definition is not None else {}
            if run is None or definition is None or not environments:
                self.settled.add(run_id)
                continue
            model = run_policy_model(run_id, definition)
            lora = LoraSpec.from_proto(definition.lora) if definition.HasField("lora") else None
            if run.state == loop_pb2.RUN_STATE_RUNNING:
                if run_id not in self.seen_running:
                    self.seen_running.add(run_id)
                    baseline = await self.announced(model, run.start_version)
                    await self._evaluate_once(run_id, environments, baseline, lora, promote=False)
                continue
            if run_id not in self.seen_running:  # ended before this evaluator saw it: nothing of its own to do
                self.settled.add(run_id)
                continue
            ended = self.ended_at.setdefault(run_id, time.monotonic())
            if not await self.policy_in_training(model, run_id):
                newest = await self.announced(model)
                if newest is not None and newest.version > run.start_version:
                    await self._evaluate_once(run_id, environments, newest, lora)
            if time.monotonic() - ended > self.settings.end_grace_s:
                self.settled.add(run_id)

    async def _evaluate_once(self, run_id: str, environments: dict[str, loop_pb2.Environment],
                             event: bus_pb2.WeightsPublished | None, lora: LoraSpec | None,
                             promote: bool = True) -> None:
        if event is None or await self.store.get(run_id, event.version) is not None:
            return
        if lora is not None and event.version == 0:
            lora = None  # an adapter at version 0 is the base itself
        await self.evaluate_run(run_id, environments, event, lora, promote=promote)

    async def definition(self, run_id: str) -> loop_pb2.StartRunRequest | None:
        """A run's definition, read once (it never changes)."""
        if run_id not in self._definitions:
            definition = await self.runs.definition(run_id)
            if definition is None:
                return None
            self._definitions[run_id] = definition
        return self._definitions[run_id]

    async def eval_environments(self, definition: loop_pb2.StartRunRequest) -> dict[str, loop_pb2.Environment]:
        """The run's environments that carry an eval split, each read once (name@version never
        changes: the gateway refuses another definition under it)."""
        environments = {}
        for mix in definition.environments:
            if mix.environment not in self._environments:
                env = await self.environments.get(mix.environment)
                if env is None:
                    continue
                self._environments[mix.environment] = env if env.eval_tasks else None
            if self._environments[mix.environment] is not None:
                environments[mix.environment] = self._environments[mix.environment]
        return environments

    async def announced(self, model: str, version: int | None = None) -> bus_pb2.WeightsPublished | None:
        """The model's newest announcement on WEIGHTS (`version`: only if it is that one); version 0
        is the base, which needs none. None when there is none to evaluate."""
        if version == 0:
            return bus_pb2.WeightsPublished(model=model, version=0)
        subject = weights_subject(model)
        try:
            msg = await self.bus.js.get_last_msg(self.bus.topology.stream_for_subject(subject).name, subject)
        except nats.js.errors.NotFoundError:
            return None
        event = bus_pb2.WeightsPublished.FromString(msg.data)
        if version is not None and event.version != version:
            log.info("baseline_skipped", model=model, version=version, why=f"version {event.version} is the newest")
            return None
        return event

    async def policy_in_training(self, model: str, other_than: str) -> bool:
        for run_id in await self.runs.run_ids():
            if run_id == other_than or await self.runs.state(run_id) != loop_pb2.RUN_STATE_RUNNING:
                continue
            definition = await self.definition(run_id)
            if definition is not None and run_policy_model(run_id, definition) == model:
                return True
        return False

    async def runs_of(self, event: bus_pb2.WeightsPublished) -> list[tuple[str, loop_pb2.StartRunRequest]]:
        """The runs whose policy this version is: the run the learner named, else the model's training runs."""
        found = []
        for run_id in await self.runs.run_ids():
            definition = await self.definition(run_id)
            if definition is None:
                continue
            if run_policy_model(run_id, definition) != event.model:
                continue
            if run_id == event.run_id:
                return [(run_id, definition)]
            if await self.runs.state(run_id) in TRAINING_STATES:
                found.append((run_id, definition))
        return found

    async def evaluate(self, event: bus_pb2.WeightsPublished) -> list[loop_pb2.VersionEval]:
        """Scores the version for each of its runs that has an eval split; returns the results."""
        results = []
        for run_id, definition in await self.runs_of(event):
            environments = await self.eval_environments(definition)
            if not environments:
                continue
            if await self.store.get(run_id, event.version) is not None:
                continue  # evaluated before a restart
            lora = LoraSpec.from_proto(definition.lora) if definition.HasField("lora") else None
            results.append(await self.evaluate_run(run_id, environments, event, lora))
        return results

    async def evaluate_run(self, run_id: str, environments: dict[str, loop_pb2.Environment],
                           event: bus_pb2.WeightsPublished, lora: LoraSpec | None = None, *,
                           promote: bool = True) -> loop_pb2.VersionEval:
        """Scores one version of a run: the model's weights pinned to it, or for a LoRA run its
        adapter at that version beside the frozen base (which the engine's label then names).
        `promote`: the rule may promote it (not a baseline: the run did not make that version)."""
        started = time.monotonic()
        if lora is None:
            await self.engine.pin(event)
            adapter, label = None, event.version
        else:
            adapter = await self.engine.pin_adapter(run_id, lora, event)
            label = self.engine.held.version if self.engine.held is not None else 0
        items = eval_items(environments, self.encode, self.stop_ids, self.settings.max_eval_tasks)

        @asynccontextmanager
        async def open_episode(item: EvalItem, rid: str) -> AsyncIterator[tuple[Episode, list[int]]]:
            if item.driver is None:
                tools = self.settings.episode(self.bus, job_id=f"tool:{rid}", run_id=run_id,
                                              tokenizer=from_hf(self.tokenizer), formats=tool_formats(list(item.tools)))
                yield tools, list(item.template.prompt_token_ids)
                return
            try:
                async with open_environment(self.bus, item.driver, task_reset(item.template),
                                            template=chat_template(self.tokenizer), job_id=f"env:{rid}", run_id=run_id,
                                            open_timeout_s=self.settings.tool_reply_timeout_s) as (episode, prompt):
                    yield episode, prompt
            except (EnvironmentFailed, NoChatTemplate) as exc:
                raise EvaluationError(f"{item.environment} eval task {item.index}: {exc}") from exc

        scores = await score_version(self.engine.client, items, self.registry, version=label, lora_path=adapter,
                                     decode=self.decode, concurrency=self.settings.concurrency,
                                     rid_prefix=f"eval-{run_id}-{event.version}", open_episode=open_episode)
        result = version_eval(run_id, event.model, event.version, event.step, scores,
                              seconds=time.monotonic() - started, evaluator=self.settings.instance_id)
        judge(result, await self.store.all(run_id))
        await record_eval(self.store, self.bus, result)
        export_eval(result, self.exported)
        self.evaluated += 1
        self.last_version = max(self.last_version, result.version)
        log.info("version_evaluated", run=run_id, version=event.version, pass_rate=round(result.pass_rate, 4),
                 interval=[round(result.pass_rate_low, 4), round(result.pass_rate_high, 4)],
                 regressed=result.regressed, seconds=round(result.seconds, 2))
        if promote:
            await self.maybe_promote(result)
        return result

    async def maybe_promote(self, result: loop_pb2.VersionEval) -> None:
        if self.promoter is None or self.settings.promote != "rule":
            return
        _, current = await PromotionLog(self.bus).current(result.run_id)
        if not rule_promotes(result, current, self.settings.promote_every):
            return
        reason = (f"rule: pass rate {result.pass_rate:.3f} [{result.pass_rate_low:.3f}, {result.pass_rate_high:.3f}]"
                  f", not below the best version's ({result.best_version or 'none before'})")
        promotion = await self.promoter.promote(result.run_id, result.version, reason)
        log.info("version_promoted", run=result.run_id, version=result.version, sequence=promotion.sequence)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
