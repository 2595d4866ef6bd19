"""The evaluator's loop: it follows WEIGHTS for every model, and for each k-th version loads it
into its own engine (nothing else is served there, so every answer comes from that version),
scores the eval splits of the runs training that policy, judges the result against the run's
best, records it, and promotes by rule when asked to. Training never waits for it: a busy
evaluator skips to the newest k-th version."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from policyloop.bus import Bus
from policyloop.bus.newest import NewestPerSubject
from policyloop.bus.topology import SUBJECT_PREFIX
from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.evaluation.scoring import EvaluationError, eval_items, score_version, version_eval
from policyloop.evaluation.settings import EvaluatorSettings
from policyloop.releases.evals import EvalStore, record_eval
from policyloop.releases.promotion import Promoter, PromotionLog
from policyloop.releases.verdict import judge, rule_promotes
from policyloop.rl.settings import LoraSpec, adapter_model_name
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

    @property
    def client(self) -> SGLangClient:
        if self._client is None:
            raise RuntimeError("the engine is reached on the first pin")
        return self._client

    async def pin(self, event: bus_pb2.WeightsPublished) -> None:
        if self._client is None:
            self._client = await self.connect()
        if self.held is not None and self.held.version == event.version:
            return
        from policyloop.weights.torch_io import write_version_dir  # torch, which only loading needs

        weights, _ = await sync_weights(self.publisher(event.fetch_endpoint), event.model, self.held, event.version)
        directory = await asyncio.to_thread(write_version_dir, self.weights_dir, self.model_path, weights)
        self.held = None  # until the engine confirms it, the held bytes are not what it serves
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

    async def runs_of(self, event: bus_pb2.WeightsPublished) -> list[tuple[str, loop_pb2.StartRunRequest]]:
        """The runs whose policy this version is: the run the learner named, else the model's training runs."""
        found = []
        for run_id in await self.runs.run_ids():
            definition = await self.runs.definition(run_id)
            if definition is None:
                continue
            model = adapter_model_name(definition.model, run_id) if definition.HasField("lora") else definition.model
            if model != event.model:
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
            environments = {}
            for mix in definition.environments:
                env = await self.environments.get(mix.environment)
                if env is not None and env.eval_tasks:
                    environments[mix.environment] = env
            if not environments:
                continue
            if await self.store.get(run_id, event.version) is not None:
                continue  # evaluated before a restart
            lora = LoraSpec.from_proto(definition.lora) if definition.HasField("lora") else None
            results.append(await self.evaluate_run(run_id, environments, event, lora))
        return results

    async def evaluate_run(self, run_id: str, environments: dict[str, loop_pb2.Environment],
                           event: bus_pb2.WeightsPublished, lora: LoraSpec | None = None) -> loop_pb2.VersionEval:
        """Scores one version of a run: the model's weights pinned to it, or for a LoRA run its
        adapter at that version beside the frozen base (which the engine's label then names)."""
        started = time.monotonic()
        if lora is None:
            await self.engine.pin(event)
            adapter, label = None, event.version
        else:
            adapter = await self.engine.pin_adapter(run_id, lora, event)
            label = self.engine.held.version if self.engine.held is not None else 0
        items = eval_items(environments, self.encode, self.stop_ids, self.settings.max_eval_tasks)
        scores = await score_version(self.engine.client, items, self.registry, version=label, lora_path=adapter,
                                     decode=self.decode, concurrency=self.settings.concurrency,
                                     rid_prefix=f"eval-{run_id}-{event.version}")
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
