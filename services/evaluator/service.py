"""evaluator service: follows WEIGHTS and scores each k-th version of every run on its
environments' eval splits, on an engine of its own pinned to that version; results go to Redis
(GetRun) and EVALS; with promote=rule it promotes what passes. The logic is in
policyloop.evaluation; this is its wiring."""

from __future__ import annotations

import asyncio
import subprocess

from policyloop.contracts.v1 import bus_pb2, status_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.evaluation.evaluator import Evaluator, PinnedEngine
from policyloop.evaluation.settings import EvaluatorSettings
from policyloop.releases.evals import EvalStore
from policyloop.releases.promotion import Promoter
from policyloop.rollout.engine_process import engine_url_or_start, name_base_version, stop_engine, wait_for_engine
from policyloop.runtime import ServiceContext, model_directory, run_main
from policyloop.sandbox.client import run_in_sandbox
from policyloop.scorers.registry import default_registry
from policyloop.scorers.settings import ScorerContext
from policyloop.state import connect_redis
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.weights.client import WeightClient


async def body(ctx: ServiceContext) -> None:
    from policyloop.models.tokenizer import load_tokenizer

    settings: EvaluatorSettings = ctx.settings  # type: ignore[assignment]
    model_dir = await model_directory(settings.model_path)
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
    engines: list[tuple[SGLangClient, subprocess.Popen | None]] = []

    async def connect() -> SGLangClient:
        """The engine, on the first version to evaluate: settings.engine_url, or an embedded one."""
        url, proc = engine_url_or_start(settings.engine_url, model_dir,
                                        max_batch=settings.engine_max_batch, threads=settings.engine_threads)
        client = SGLangClient(url, timeout_s=settings.generate_timeout_s)
        engines.append((client, proc))
        await wait_for_engine(client, proc, settings.engine_start_timeout_s)
        await name_base_version(client)  # the base's answers (a LoRA run's adapter beside it) say 0
        return client

    publishers: dict[str, WeightClient] = {}

    def publisher(endpoint: str) -> WeightClient:
        return publishers.setdefault(endpoint, WeightClient(endpoint, bearer_token=settings.publisher_token))

    async def run_job(job: bus_pb2.SandboxJob) -> bus_pb2.SandboxResult:
        return await run_in_sandbox(ctx.bus, job, timeout_s=settings.sandbox_timeout_s)

    # Definitions and results are protobuf.
    raw = await connect_redis(settings.redis_url, pool=settings.redis_pool, decode_responses=False)
    registry = default_registry(run_job, ScorerContext(settings, raw, settings.namespace))
    try:
        runs, evals = RunRegistry(raw, settings.namespace), EvalStore(raw, settings.namespace)
        evaluator = Evaluator(
            ctx.bus, runs, EnvironmentCatalog(raw, settings.namespace), evals,
            PinnedEngine(connect, publisher, settings.weights_dir / settings.instance_id, model_dir,
                         settings.adapter_source),
            tokenizer, registry, settings, promoter=Promoter(ctx.bus, runs, evals, publisher))
        ctx.status = lambda: status_pb2.EvaluatorStatus(
            evaluated=evaluator.evaluated, engine_url=engines[0][0].base_url if engines else "",
            last_version=evaluator.last_version)
        ctx.ready = True
        await evaluator.run(ctx.stop)
    finally:
        await raw.aclose()
        await registry.close()
        await asyncio.gather(*(client.close() for client in publishers.values()))
        for engine, proc in engines:
            await engine.close()
            await stop_engine(proc)


def main(argv: list[str] | None = None) -> int:
    return run_main("evaluator", EvaluatorSettings, body, argv)
