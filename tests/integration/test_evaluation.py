"""Evals pinned to versions and promotion to serving, with the real parts in one process: NATS,
Redis, a publisher on loopback gRPC announcing on WEIGHTS, two embedded engines (the evaluator's
own and a serving replica's), the gateway's LoopService over gRPC and the official openai client.

Versions are evaluated every k-th one on the run's eval split, with exactly what the engine
produced for that version; the results are in Redis, on EVALS and in GetRun while versions keep
coming; passing versions are promoted by rule; promotion and rollback change which version the
serving endpoint answers with; the publisher keeps promoted versions past its retention."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc, status_pb2
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.envs import arithmetic
from policyloop.evaluation.evaluator import Evaluator, PinnedEngine
from policyloop.evaluation.settings import EvaluatorSettings
from policyloop.gateway.servicer import GatewayStores, LoopServicer
from policyloop.publisher.announcer import Announcer
from policyloop.releases.evals import EvalStore
from policyloop.releases.promotion import Promoter, PromotionLog
from policyloop.rollout.engine_process import engine_client
from policyloop.rollout.follower import WeightFollower, promoted_versions
from policyloop.rollout.settings import RolloutSettings
from policyloop.runtime import ServiceContext
from policyloop.runtime.grpc_server import start_grpc_server
from policyloop.scorers.registry import default_registry
from policyloop.serving.openai_api import OpenAIApi
from policyloop.state import HeartbeatRegistry, VersionRegistry, connect_redis
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.state.progress import RunProgressStore
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.torch_io import weight_set
from tests.helpers import eventually, greedy_ids, serving_http, stored, until

openai = pytest.importorskip("openai")

RUN, ENV, MODEL = "run-eval", "arith@v1", "policy"
EVAL_TASKS = 24


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from policyloop.models.bootstrap import bootstrap

    return bootstrap()


def version(model_dir: Path, number: int) -> WeightSet:
    """The bootstrapped model's parameters with a little noise of their own per version (it keeps
    answering some of the eval split right, so the counts compared below are not all zero)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(number)
    return weight_set(number, {name: (p.detach() + 0.002 * torch.randn(p.shape, generator=generator)).contiguous()
                               for name, p in model.named_parameters()})


def environment() -> loop_pb2.Environment:
    problems = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), EVAL_TASKS, seed=3)
    train = arithmetic.train_problems(arithmetic.ArithmeticConfig(), 4, seed=3)
    return loop_pb2.Environment(
        name="arith", version="v1", builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
        tasks=[loop_pb2.TaskSpec(prompt_text=p.prompt, answer=p.answer) for p in train],
        eval_tasks=[loop_pb2.TaskSpec(prompt_text=p.prompt, answer=p.answer) for p in problems],
        sampling=bus_pb2.SamplingParams(max_new_tokens=8), group_size=2)


@dataclass
class Loop:
    pusher: VersionPusher
    publisher: WeightClient
    evals: EvalStore
    stub: loop_pb2_grpc.LoopServiceStub
    evaluator_engine: EmbeddedEngine
    serving_engine: EmbeddedEngine
    serving_ctx: ServiceContext
    openai_url: str
    gateway: str
    evaluator: Evaluator


@asynccontextmanager
async def weights_publisher(bus: Bus, root: Path) -> AsyncIterator[str]:
    """A publisher on loopback gRPC, announcing on WEIGHTS (retention 3): its endpoint."""
    library = WeightLibrary(VersionStore(root, retention=3), snapshot_every=4)
    announcer = Announcer(bus)
    server, port = await start_weight_server(WeightServicer(library, on_stored=announcer.announce),
                                             host="127.0.0.1", port=0)
    announcer.endpoint = f"127.0.0.1:{port}"
    try:
        yield announcer.endpoint
    finally:
        await server.stop(None)
        await library.drain()


@pytest.fixture
async def loop(bus: Bus, redis_server, redis_client, model_dir: Path,  # type: ignore[no-untyped-def]
               tmp_path: Path) -> AsyncIterator[Loop]:
    from transformers import AutoTokenizer

    raw = await connect_redis(redis_server.url, decode_responses=False)
    stack = AsyncExitStack()
    endpoint = await stack.enter_async_context(weights_publisher(bus, tmp_path / "store"))
    clients: dict[str, WeightClient] = {}

    def publisher(endpoint: str) -> WeightClient:
        return clients.setdefault(endpoint, WeightClient(endpoint, deadline_s=60))

    runs, envs, evals = RunRegistry(raw, "t"), EnvironmentCatalog(raw, "t"), EvalStore(raw, "t")
    await envs.put(ENV, environment())
    await runs.create(RUN, loop_pb2.StartRunRequest(run_id=RUN, model=MODEL, environments=[
        loop_pb2.EnvironmentMix(environment=ENV, weight=1.0)]), 4)
    promoter = Promoter(bus, runs, evals, publisher)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    evaluator_engine = await start_engine(model_dir, threads=1)
    evaluator_client = SGLangClient(evaluator_engine.base_url, timeout_s=60)
    settings = EvaluatorSettings(every_versions=2, promote="rule", model_path=model_dir, instance_id="eval-t",
                                 run_ends=False)  # a run's ends have their own test

    async def connect() -> SGLangClient:
        return evaluator_client

    evaluator = Evaluator(bus, runs, envs, evals, PinnedEngine(connect, publisher, tmp_path / "eval", model_dir),
                          tokenizer, default_registry(_no_sandbox), settings, promoter=promoter)
    stop = asyncio.Event()
    evaluating = asyncio.create_task(evaluator.run(stop))

    servicer = LoopServicer(
        GatewayStores(environments=envs, runs=runs, versions=VersionRegistry(redis_client, "t"),
                      progress=RunProgressStore(redis_client, "t"), heartbeats=HeartbeatRegistry(redis_client, "t"),
                      evals=evals, promotions=PromotionLog(bus)),
        wake_feeder=asyncio.Event(), stop=stop, watch_poll_s=0.2, promoter=promoter)
    grpc_server, _, grpc_port = await start_grpc_server(
        [lambda s: loop_pb2_grpc.add_LoopServiceServicer_to_server(servicer, s)],
        [loop_pb2.DESCRIPTOR.services_by_name["LoopService"].full_name], host="127.0.0.1", port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")

    # A serving replica of the run: its engine follows the run's promotions, the OpenAI API in front.
    serving_engine = await start_engine(model_dir, threads=1, weight_version="0")
    serving_settings = RolloutSettings(role="serving", serve_run=RUN, model_path=model_dir,
                                       weights_dir=tmp_path / "serving", instance_id="serving-t")
    serving_client = engine_client(serving_settings, serving_engine.base_url)
    serving_ctx = ServiceContext(name="rollout", settings=serving_settings, bus=bus, redis=redis_client)
    follower = WeightFollower(serving_ctx, serving_settings, serving_client, status_pb2.RolloutStatus(),
                              promoted_versions(RUN))
    following = asyncio.create_task(follower.run())
    serving = OpenAIApi(serving_client, tokenizer, bus, RUN).app()
    openai_url = f"{await stack.enter_async_context(serving_http(serving))}/v1"
    try:
        yield Loop(VersionPusher(publisher(endpoint), MODEL), publisher(endpoint), evals,
                   loop_pb2_grpc.LoopServiceStub(channel), evaluator_engine, serving_engine, serving_ctx, openai_url,
                   f"127.0.0.1:{grpc_port}", evaluator)
    finally:
        stop.set()
        serving_ctx.stop.set()
        await asyncio.wait_for(asyncio.gather(evaluating, following, return_exceptions=True), 60)
        await channel.close()
        await grpc_server.stop(None)
        for client in (evaluator_client, serving_client, *clients.values()):
            await client.close()
        await evaluator_engine.stop()
        await serving_engine.stop()
        await stack.aclose()
        await raw.aclose()


async def passed_by_hand(engine: EmbeddedEngine, tokenizer, env: loop_pb2.Environment,  # type: ignore[no-untyped-def]
                         lora_path: str | None = None) -> tuple[int, list[str]]:
    """The eval split scored directly: greedy answers of what the engine serves (with the adapter
    `lora_path`, when given), the arithmetic verifier. The number passed, and the answers."""
    client = SGLangClient(engine.base_url, timeout_s=60)
    eos = tokenizer.eos_token_id
    try:
        passed, answers = 0, []
        for spec in env.eval_tasks:
            result = await client.generate(GenerateRequest(
                input_ids=tokenizer(spec.prompt_text, add_special_tokens=False).input_ids, lora_path=lora_path,
                sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(eos,))))
            text = tokenizer.decode([t for t in result.output_ids if t != eos], skip_special_tokens=True)
            passed += arithmetic.score(text, result.finish_reason == "stop", spec.answer).reward > 1.0
            answers.append(text)
        return passed, answers
    finally:
        await client.close()


@pytest.mark.timeout(300)
async def test_versions_are_evaluated_promoted_and_served_and_a_rollback_changes_what_the_endpoint_answers(
        loop: Loop, bus: Bus, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    versions = {n: version(model_dir, n) for n in range(1, 9)}
    for n in (1, 2):
        await loop.pusher.push(versions[n], step=n)

    async def evaluated(*wanted: int) -> bool:
        return {e.version for e in await loop.evals.all(RUN)} >= set(wanted)

    await eventually(lambda: evaluated(2), timeout_s=180, what="version 2 evaluated")
    for n in (3, 4):
        await loop.pusher.push(versions[n], step=n)
    await eventually(lambda: evaluated(4), timeout_s=180, what="version 4 evaluated")

    # Every second version, scored on the 12 eval tasks with what the pinned engine produced.
    results = await loop.evals.all(RUN)
    assert [e.version for e in results] == [2, 4]
    latest = results[-1]
    assert loop.evaluator_engine.weight_version == "4"
    by_hand, _ = await passed_by_hand(loop.evaluator_engine, tokenizer, environment())
    score = latest.environments[0]
    assert by_hand > 0 and (score.environment, score.tasks, score.passed) == (ENV, EVAL_TASKS, by_hand)
    assert latest.step == 4 and latest.best_version == 2 and not latest.regressed
    assert score.pass_rate_low <= score.pass_rate <= score.pass_rate_high and score.pass_rate_high > 0
    assert [e.version for e in await stored(bus, "EVALS", loop_pb2.VersionEval)] == [2, 4]
    check_metrics(latest)
    # Asked again (an evaluator restarted after recording it), a version is not evaluated twice.
    last = await stored(bus, "WEIGHTS", bus_pb2.WeightsPublished)
    assert await loop.evaluator.evaluate(last[-1]) == [] and len(await loop.evals.all(RUN)) == 2

    # Promoted by rule as they passed: the serving replica serves the newest, the publisher keeps both.
    run = await loop.stub.GetRun(loop_pb2.GetRunRequest(run_id=RUN))
    assert [e.version for e in run.evals] == [2, 4]
    await until(lambda: loop.serving_ctx.policy_version == 4, timeout_s=120, what="version 4 served")
    run = await loop.stub.GetRun(loop_pb2.GetRunRequest(run_id=RUN))
    assert (run.promotion.version, run.promotion.sequence, run.promotion.previous_version) == (4, 2, 2)
    assert run.promotion.reason.startswith("rule: ")
    client = openai.AsyncOpenAI(base_url=loop.openai_url, api_key="unused", max_retries=0)
    answer = await client.completions.create(model=RUN, prompt="12+34=", max_tokens=3, temperature=0)
    assert answer.system_fingerprint == "weights-4"

    # Training goes on past the publisher's retention (3): the promoted versions stay.
    for n in range(5, 9):
        await loop.pusher.push(versions[n], step=n)
    await eventually(lambda: evaluated(6, 8), timeout_s=180, what="versions 6 and 8 evaluated")
    await until(lambda: loop.serving_ctx.policy_version == 8, timeout_s=120, what="version 8 promoted and served")
    held = {v.version: v.kept for v in await loop.publisher.list_versions(MODEL)}
    assert held[2] and held[4] and 3 not in held and 5 not in held

    # A rollback (to the version promoted before the current one) changes what the endpoint answers.
    rolled = await loop.stub.RollbackVersion(loop_pb2.RollbackVersionRequest(run_id=RUN, reason="bad answers"))
    assert rolled.version == 6 and rolled.previous_version == 8 and rolled.reason == "rollback: bad answers"
    back = await loop.stub.RollbackVersion(loop_pb2.RollbackVersionRequest(run_id=RUN, version=2))
    assert back.version == 2
    await until(lambda: loop.serving_ctx.policy_version == 2, timeout_s=120, what="version 2 served again")
    answer = await client.completions.create(model=RUN, prompt="12+34=", max_tokens=3, temperature=0)
    assert answer.system_fingerprint == "weights-2"
    assert loop.serving_engine.weight_version == "2" and serves(loop.serving_engine, versions[2])

    # By hand: a named version; the refusals name the field.
    promoted = await loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=RUN, version=8, reason="ok"))
    assert promoted.version == 8 and promoted.reason == "ok"
    await until(lambda: loop.serving_ctx.policy_version == 8, timeout_s=120, what="version 8 served")
    await check_refusals(loop)
    forced = await loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=RUN, version=6, force=True))
    assert forced.version == 6

    listed = await loop.stub.ListVersions(loop_pb2.ListRunVersionsRequest(run_id=RUN))
    rows = {row.version: row for row in listed.versions}
    assert listed.promotion.version == 6 and rows[6].serving and not rows[8].serving
    assert {v for v, row in rows.items() if row.HasField("eval")} == {2, 4, 6, 8}
    assert rows[2].kept and rows[4].kept and list(rows[2].promotions) == [1, 6]
    assert [p.sequence for p in await PromotionLog(bus).history(RUN)] == list(range(1, 9))

    await check_cli(loop)
    await client.close()


def check_metrics(newest: loop_pb2.VersionEval) -> None:
    """The evaluator's metrics: the newest version's pass rates with their interval, the verdicts."""
    from prometheus_client import REGISTRY

    from policyloop.telemetry.metrics import run_label

    run = run_label(RUN)
    for bound, value in (("point", newest.pass_rate), ("low", newest.pass_rate_low), ("high", newest.pass_rate_high)):
        for environment in ("all", ENV):
            labels = {"run": run, "environment": environment, "bound": bound}
            assert REGISTRY.get_sample_value("policyloop_eval_pass_rate", labels) == pytest.approx(value)
    assert REGISTRY.get_sample_value("policyloop_eval_version", {"run": run}) == newest.version
    assert REGISTRY.get_sample_value("policyloop_evaluations_total", {"run": run, "verdict": "passed"}) >= 2


async def check_refusals(loop: Loop) -> None:
    """Refusals name the field: a pruned version, a negative one, an unknown run, a regression."""
    await refused(loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=RUN, version=3)),
                  grpc.StatusCode.NOT_FOUND, "version")
    await refused(loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=RUN, version=-1)),
                  grpc.StatusCode.INVALID_ARGUMENT, "version")
    await refused(loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id="nope", version=2)),
                  grpc.StatusCode.NOT_FOUND, "run_id")
    flagged = await loop.evals.get(RUN, 6)
    assert flagged is not None
    flagged.regressed = True  # as the rule flags a version below the best by more than its interval
    await loop.evals.put(flagged)
    await refused(loop.stub.PromoteVersion(loop_pb2.PromoteVersionRequest(run_id=RUN, version=6)),
                  grpc.StatusCode.FAILED_PRECONDITION, "regressed")


async def check_cli(loop: Loop) -> None:
    """`policyloop versions` does the same through the gateway."""
    rolled_back = json.loads(await cli("versions", "rollback", RUN, "--version", "4", "--gateway", loop.gateway))
    assert rolled_back["version"] == "4" and rolled_back["previousVersion"] == "6"
    lines = (await cli("versions", "list", RUN, "--gateway", loop.gateway)).splitlines()
    assert any(line.startswith("v4 ") and "SERVING" in line and "pass" in line for line in lines), lines
    assert any(line.startswith("v6 ") and "REGRESSED" in line for line in lines), lines


async def cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "policyloop", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def refused(call, code: grpc.StatusCode, names: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code and names in (caught.value.details() or ""), caught.value.details()


def serves(engine: EmbeddedEngine, weights: WeightSet) -> bool:
    served = engine.served.parameters()
    return all(torch.equal(served[name].contiguous().view(torch.uint8).reshape(-1),
                           torch.frombuffer(bytearray(t.data), dtype=torch.uint8))
               for name, t in weights.tensors.items())


async def test_a_promotion_counted_from_a_stale_log_is_not_appended(bus: Bus) -> None:
    """Two promoters at once: the one that counted from an older newest entry loses and counts again."""
    log = PromotionLog(bus)
    assert await log.current(RUN) == (0, None)
    first = loop_pb2.Promotion(run_id=RUN, version=2, sequence=1)
    assert await log.append(first, 0)
    seq, newest = await log.current(RUN)
    assert newest == first
    assert not await log.append(loop_pb2.Promotion(run_id=RUN, version=3, sequence=1), 0)  # counted before `first`
    assert await log.append(loop_pb2.Promotion(run_id=RUN, version=3, sequence=2), seq)
    assert [p.version for p in await log.history(RUN)] == [2, 3]


async def test_an_answer_from_another_version_fails_the_evaluation(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from policyloop.evaluation.scoring import EvaluationError, eval_items, score_version

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = await start_engine(tiny_model_dir, threads=1, weight_version="3")
    client = SGLangClient(engine.base_url, timeout_s=60)
    try:
        items = eval_items({ENV: environment()}, lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                           [tokenizer.eos_token_id], max_tasks=2)
        scores = await score_version(client, items, default_registry(_no_sandbox), version=3, decode=tokenizer.decode,
                                     concurrency=2, rid_prefix="pinned")
        assert [(s.environment, s.tasks) for s in scores] == [(ENV, 2)]
        with pytest.raises(EvaluationError, match="answered with version 3, not 4"):
            await score_version(client, items, default_registry(_no_sandbox), version=4, decode=tokenizer.decode,
                                concurrency=2, rid_prefix="stale")
    finally:
        await client.close()
        await engine.stop()


async def _no_sandbox(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
    raise AssertionError("the arithmetic verifier runs in process")


async def test_the_heartbeat_carries_the_evaluators_status_and_survives_one_it_has_no_field_for(
        bus: Bus, redis_client) -> None:  # type: ignore[no-untyped-def]
    ctx = ServiceContext(name="evaluator", settings=EvaluatorSettings(instance_id="evaluator-t"), bus=bus,
                         redis=redis_client)
    ctx.status = lambda: status_pb2.EvaluatorStatus(evaluated=3, last_version=40)
    beat = ctx.heartbeat(0)
    assert beat.WhichOneof("status") == "evaluator" and beat.evaluator.last_version == 40
    ctx.status = lambda: status_pb2.WeightFetch(kind="delta")  # a status the heartbeat has no field for
    assert ctx.heartbeat(0).WhichOneof("status") is None


async def test_the_store_reads_a_runs_newest_results_only(redis_server) -> None:  # type: ignore[no-untyped-def]
    raw = await connect_redis(redis_server.url, decode_responses=False)
    try:
        store = EvalStore(raw, "t")
        for version in (30, 10, 20, 5, 40):
            await store.put(loop_pb2.VersionEval(run_id=RUN, version=version))
        assert [e.version for e in await store.newest(RUN, 3)] == [20, 30, 40]
        assert [e.version for e in await store.all(RUN)] == [5, 10, 20, 30, 40]
        assert await store.newest("other", 3) == [] and (await store.get(RUN, 10)).version == 10
    finally:
        await raw.aclose()


def test_an_evaluator_behind_takes_the_newest_due_version_of_each_model() -> None:
    settings = EvaluatorSettings(every_versions=2)
    evaluator = Evaluator(None, None, None, None, None, type("T", (), {"eos_token_id": 1})(), None,  # type: ignore[arg-type]
                          settings)

    def announced(model: str, version: int) -> object:
        return type("Msg", (), {"data": bus_pb2.WeightsPublished(model=model, version=version).SerializeToString()})

    async def announce_all() -> None:
        for model, version in (("policy", 2), ("policy", 3), ("other", 4), ("policy", 6), ("policy", 4),
                               ("policy", 5)):
            await evaluator.on_event(announced(model, version))

    asyncio.run(announce_all())
    assert {m: e.version for m, e in evaluator.pending.items()} == {"policy": 6, "other": 4}
    assert evaluator.due.is_set()


@dataclass
class EvaluatorParts:
    """One run's stores, an embedded engine named version 0 when the evaluator reaches it, and a
    publisher (its client): what an in-process evaluator needs."""
    runs: RunRegistry
    envs: EnvironmentCatalog
    evals: EvalStore
    engine: EmbeddedEngine
    client: SGLangClient
    weights: WeightClient

    async def connect(self) -> SGLangClient:
        from policyloop.rollout.engine_process import name_base_version

        await name_base_version(self.client)
        return self.client


@asynccontextmanager
async def evaluator_parts(bus: Bus, redis_server, model_dir: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                          run: loop_pb2.StartRunRequest) -> AsyncIterator[EvaluatorParts]:
    raw = await connect_redis(redis_server.url, decode_responses=False)
    runs, envs, evals = RunRegistry(raw, "t"), EnvironmentCatalog(raw, "t"), EvalStore(raw, "t")
    await envs.put(ENV, environment())
    await runs.create(run.run_id, run, 4)
    engine = await start_engine(model_dir, threads=1)
    client = SGLangClient(engine.base_url, timeout_s=60)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(raw.aclose)
        stack.push_async_callback(engine.stop)
        stack.push_async_callback(client.close)
        weights = WeightClient(await stack.enter_async_context(weights_publisher(bus, tmp_path / "store")))
        stack.push_async_callback(weights.close)
        yield EvaluatorParts(runs, envs, evals, engine, client, weights)


async def test_a_lora_run_is_evaluated_and_served_beside_the_base(
        bus: Bus, redis_server, model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A LoRA run's k-th adapter version is fetched, verified and loaded beside the frozen base, and
    scored with exactly that adapter (the counts are what the engine answers with it by hand). Its
    promotions, a rollback too, reach a serving replica's OpenAI endpoint: each answer is the
    promoted adapter's greedy one, labelled with its version."""
    from transformers import AutoTokenizer

    from policyloop.rl.settings import adapter_model_name

    run_id = "run-lora"
    adapter_model = adapter_model_name(MODEL, run_id)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    definition = loop_pb2.StartRunRequest(run_id=run_id, model=MODEL, lora=loop_pb2.LoraSpec(
        rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), environments=[
            loop_pb2.EnvironmentMix(environment=ENV, weight=1.0)])
    async with AsyncExitStack() as stack:
        parts = await stack.enter_async_context(evaluator_parts(bus, redis_server, model_dir, tmp_path, definition))
        runs, evals, engine, weights = parts.runs, parts.evals, parts.engine, parts.weights
        adapters = await push_adapters(VersionPusher(weights, adapter_model), model_dir, tmp_path)
        [*_, announced] = await stored(bus, "WEIGHTS", bus_pb2.WeightsPublished)
        assert (announced.model, announced.version) == (adapter_model, 2)
        pinned = PinnedEngine(parts.connect, lambda _: weights, tmp_path / "eval", model_dir)
        evaluator = Evaluator(bus, runs, parts.envs, evals, pinned, tokenizer, default_registry(_no_sandbox),
                              EvaluatorSettings(every_versions=2, model_path=model_dir))
        [result] = await evaluator.evaluate(announced)
        with_adapter, answers = await passed_by_hand(engine, tokenizer, environment(), lora_path=f"{run_id}@2")
        _, base_answers = await passed_by_hand(engine, tokenizer, environment())
        assert answers != base_answers  # the adapter changes what is answered: it was applied
        assert (result.run_id, result.model, result.version) == (run_id, adapter_model, 2)
        assert result.environments[0].tasks == EVAL_TASKS and result.environments[0].passed == with_adapter

        serving = await stack.enter_async_context(lora_serving(bus, model_dir, run_id, adapter_model, weights,
                                                               tokenizer, tmp_path))
        await check_lora_serving(Promoter(bus, runs, evals, lambda _: weights), serving, run_id, adapters,
                                 model_dir, tokenizer)


async def push_adapters(pusher: VersionPusher, model_dir: Path, tmp_path: Path) -> dict[int, Path]:
    """Two versions of a LoRA adapter (random, strong enough to change answers), pushed as a run's."""
    import safetensors.torch

    from tests.helpers import make_lora_adapter

    adapters = {}
    for number in (1, 2):
        adapters[number] = make_lora_adapter(model_dir, tmp_path / f"adapter-{number}", seed=number)
        tensors = safetensors.torch.load_file(adapters[number] / "adapter_model.safetensors")
        await pusher.push(weight_set(number, tensors), step=number)
    return adapters


@dataclass
class LoraServing:
    openai_url: str
    promoted: Any          # PromotedAdapter
    engine: SGLangClient


@asynccontextmanager
async def lora_serving(bus: Bus, model_dir: Path, run_id: str, adapter_model: str, weights: WeightClient,
                       tokenizer, tmp_path: Path) -> AsyncIterator[LoraServing]:  # type: ignore[no-untyped-def]
    """A serving replica of a LoRA run, as the rollout service wires one: its engine, the promoted
    adapter followed, the OpenAI endpoint in front."""
    from policyloop.engines.adapters import ServedAdapters
    from policyloop.rl.settings import LoraSpec
    from policyloop.rollout.adapters import PromotedAdapter

    engine = await start_engine(model_dir, threads=1, weight_version="0")
    client = SGLangClient(engine.base_url, timeout_s=60)
    promoted = PromotedAdapter(bus, ServedAdapters(client, tmp_path / "serving", lambda _: weights), run_id,
                               LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), adapter_model)
    stop = asyncio.Event()
    following = asyncio.create_task(promoted.run(stop))
    try:
        async with serving_http(OpenAIApi(client, tokenizer, bus, run_id, adapter=promoted.adapter).app()) as url:
            yield LoraServing(f"{url}/v1", promoted, client)
    finally:
        stop.set()
        await following
        await client.close()
        await engine.stop()


async def check_lora_serving(promoter: Promoter, serving: LoraServing, run_id: str, adapters: dict[int, Path],
                             model_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Promote version 2, then 1 (an older one: a rollback): each answer is that adapter's greedy
    answer (peft on the adapter's own directory), labelled with its version. Back and forth while
    a request holds the older adapter; and an engine that lost its adapter gets it back on resync."""
    client = openai.AsyncOpenAI(base_url=serving.openai_url, api_key="unused", max_retries=0)
    prompt = "12+34="
    expected = {version: lora_greedy(model_dir, adapters[version], tokenizer, prompt) for version in (1, 2)}

    async def serves(version: int) -> bool:
        answer = await client.completions.create(model=run_id, prompt=prompt, max_tokens=4, temperature=0)
        return answer.system_fingerprint == f"weights-{version}" and answer.choices[0].text == expected[version]

    for version in (2, 1):
        await promoter.promote(run_id, version, "test")
        await eventually(lambda v=version: serves(v), timeout_s=60, what=f"adapter version {version} served")
    async with serving.promoted.adapter() as held:  # a request still sampling with version 1
        assert held.version == 1
        for version in (2, 1):  # away and back: the held name is made current again, not loaded twice
            await promoter.promote(run_id, version, "test")
            await eventually(lambda v=version: serves(v), timeout_s=60, what=f"adapter version {version} served")
    # The engine loses the adapter (as a restart would): resync finds out and loads it again.
    await serving.engine.unload_lora_adapter(f"{run_id}@1")
    await serving.promoted.resync()
    assert await serves(1)
    await client.close()


def lora_greedy(model_dir: Path, adapter: Path, tokenizer, prompt: str) -> str:  # type: ignore[no-untyped-def]
    """The adapter's greedy answer (4 tokens, to the eos), by peft on its own files."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = greedy_ids(PeftModel.from_pretrained(base, adapter), tokenizer(prompt, add_special_tokens=False).input_ids, 4)
    if tokenizer.eos_token_id in ids:  # the engine stops there
        ids = ids[:ids.index(tokenizer.eos_token_id) + 1]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.timeout(300)
async def test_a_runs_start_and_end_are_evaluated_whatever_every_versions_says(
        bus: Bus, redis_server, model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Before and after: the version a run started from (its baseline: the base here) when it is
    first seen running, and its newest version once it has stopped; neither is a multiple of
    every_versions. A baseline is never promoted: the run did not make it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop = asyncio.Event()
    definition = loop_pb2.StartRunRequest(run_id=RUN, model=MODEL, environments=[
        loop_pb2.EnvironmentMix(environment=ENV, weight=1.0)])
    async with evaluator_parts(bus, redis_server, model_dir, tmp_path, definition) as parts:
        runs, evals, engine, weights = parts.runs, parts.evals, parts.engine, parts.weights
        settings = EvaluatorSettings(every_versions=100, promote="rule", model_path=model_dir, end_grace_s=60)
        evaluator = Evaluator(bus, runs, parts.envs, evals, PinnedEngine(parts.connect, lambda _: weights,
                                                                        tmp_path / "eval", model_dir),
                              tokenizer, default_registry(_no_sandbox), settings,
                              promoter=Promoter(bus, runs, evals, lambda _: weights))
        evaluating = asyncio.create_task(evaluator.run(stop))

        async def evaluated(*versions: int) -> bool:
            return [e.version for e in await evals.all(RUN)] == list(versions)

        await eventually(lambda: evaluated(0), timeout_s=120, what="the baseline evaluated")
        base_passed, _ = await passed_by_hand(engine, tokenizer, environment())
        [baseline] = await evals.all(RUN)
        assert baseline.environments[0].passed == base_passed and baseline.model == MODEL
        pusher = VersionPusher(weights, MODEL)
        for n in (1, 2, 3):
            await pusher.push(version(model_dir, n), step=n)
        await runs.set_state(RUN, loop_pb2.RUN_STATE_STOPPED)
        await eventually(lambda: evaluated(0, 3), timeout_s=120, what="the run's last version evaluated")
        end_passed, _ = await passed_by_hand(engine, tokenizer, environment())  # the engine holds version 3
        assert (await evals.get(RUN, 3)).environments[0].passed == end_passed
        assert all(p.version != 0 for p in await PromotionLog(bus).history(RUN))
        stop.set()
        await evaluating
