"""Samples scored per second by a model scorer against how many it takes at once: a reward
model's (`--scorer reward_model`, the default: samples of many groups queued into /classify calls
of at most --batch-sizes each, `concurrency` calls in flight, against an embedded engine serving the
reward model in its own process) or an LLM judge's (`--scorer judge`: --batch-sizes are the
judgements in flight, judges.concurrency, against an OpenAI-compatible endpoint: --judge-url, or the
serving API over an embedded engine on the bootstrap policy started here with a NATS of its own).
The samples are arithmetic prompts with right and wrong answers. For each size every sample is
queued at once, as a busy reward service sees them; the figure is the median over --repeats of
samples / wall seconds (a judge's replies are not cached across repeats). Prints JSON; writes it
and reward_throughput.png to --out.

    .venv/bin/python perf/reward_throughput.py                       # the bootstrap reward model
    .venv/bin/python perf/reward_throughput.py --model-path DIR --batch-sizes 1,8,64
    .venv/bin/python perf/reward_throughput.py --scorer judge --batch-sizes 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.envs.arithmetic import ArithmeticConfig, train_problems
from policyloop.rollout.engine_process import engine_url_or_start, stop_engine, wait_for_engine
from policyloop.scorers.reward_model import reward_model_scorer
from policyloop.scorers.score import UnscorableTrajectory
from policyloop.scorers.settings import ModelScorerSettings, RewardModelSettings, ScorerContext
from policyloop.telemetry.logging import configure_logging
from policyloop.telemetry.metrics import REWARD_MODEL_BATCH, REWARD_MODEL_CALL_SECONDS

MODEL = "perf-rm"


def samples(count: int, seed: int) -> list[bus_pb2.Trajectory]:
    """Arithmetic prompts with the right answer or a near miss, half each."""
    rng = random.Random(seed)
    spec = bus_pb2.Scorer(reward_model=bus_pb2.RewardModelScorer(model=MODEL))
    out = []
    for i, problem in enumerate(train_problems(ArithmeticConfig(), count, seed=seed)):
        answer = problem.answer if i % 2 else str(int(problem.answer) + rng.choice((-10, -1, 1, 10)))
        out.append(bus_pb2.Trajectory(trajectory_id=f"s{i}", prompt_text=problem.prompt, response_text=answer,
                                      scorer=spec))
    return out


def histogram(metric, name: str) -> float:  # type: ignore[no-untyped-def]
    return sum(s.value for m in metric.collect() for s in m.samples
               if s.name == name and s.labels.get("model") == MODEL)


def buckets(metric) -> dict[float, float]:  # type: ignore[no-untyped-def]
    return {float(s.labels["le"]): s.value for m in metric.collect() for s in m.samples
            if s.name.endswith("_bucket") and s.labels.get("model") == MODEL}


def bucket_median(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The upper bound of the bucket holding the median call between two snapshots (coarse, as
    Prometheus' histogram_quantile reads it)."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0
    return next((le for le, count in counts if count >= total / 2), None) if total else None


async def one_batch_size(engine_url: str, trajectories: list[bus_pb2.Trajectory], max_batch: int,
                         concurrency: int, repeats: int) -> dict[str, float | int | None]:
    rates = []
    latency_before = buckets(REWARD_MODEL_CALL_SECONDS)
    calls_before = histogram(REWARD_MODEL_BATCH, "policyloop_reward_model_batch_samples_count")
    sent_before = histogram(REWARD_MODEL_BATCH, "policyloop_reward_model_batch_samples_sum")
    for _ in range(repeats):
        scorer = reward_model_scorer(ScorerContext(ModelScorerSettings(reward_models=RewardModelSettings(
            engines={MODEL: [engine_url]}, max_batch=max_batch, max_wait_s=0.002, concurrency=concurrency,
            timeout_s=600))))
        try:
            started = time.perf_counter()
            await asyncio.gather(*(scorer.score(t) for t in trajectories))
            rates.append(len(trajectories) / (time.perf_counter() - started))
        finally:
            await scorer.close()
    calls = histogram(REWARD_MODEL_BATCH, "policyloop_reward_model_batch_samples_count") - calls_before
    sent = histogram(REWARD_MODEL_BATCH, "policyloop_reward_model_batch_samples_sum") - sent_before
    return {"max_batch": max_batch, "samples_per_s": round(statistics.median(rates), 1),
            "samples_per_s_all": [round(r, 1) for r in rates], "calls": int(calls),
            "mean_batch": round(sent / calls, 2) if calls else None,
            "call_p50_s_bucket": bucket_median(latency_before, buckets(REWARD_MODEL_CALL_SECONDS))}


JUDGE_SPEC = bus_pb2.JudgeScorer(judge="perf-judge", template="{response}+10=", min_score=0, max_score=210,
                                 max_tokens=6)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


async def one_concurrency(url: str, model: str, trajectories: list[bus_pb2.Trajectory], concurrency: int,
                          repeats: int) -> dict[str, float | int | None]:
    from policyloop.scorers.judge import judge_scorer
    from policyloop.scorers.settings import JudgeEndpoint, JudgeSettings

    rates, without_verdict = [], 0
    for _ in range(repeats):
        scorer = judge_scorer(ScorerContext(ModelScorerSettings(judges=JudgeSettings(
            endpoints={JUDGE_SPEC.judge: JudgeEndpoint(base_url=url, model=model)}, concurrency=concurrency,
            timeout_s=600))))  # a cache of its own: every sample is judged
        judged = []
        for t in trajectories:
            copy = bus_pb2.Trajectory()
            copy.CopyFrom(t)
            copy.scorer.judge.CopyFrom(JUDGE_SPEC)
            judged.append(copy)
        try:
            started = time.perf_counter()
            outcomes = await asyncio.gather(*(scorer.score(t) for t in judged), return_exceptions=True)
            rates.append(len(judged) / (time.perf_counter() - started))
        finally:
            await scorer.close()
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if any(not isinstance(o, UnscorableTrajectory) for o in failed):
            raise next(o for o in failed if not isinstance(o, UnscorableTrajectory))
        without_verdict += len(failed)  # judged all the same: a reply without a number
    return {"max_batch": concurrency, "samples_per_s": round(statistics.median(rates), 1),
            "samples_per_s_all": [round(r, 1) for r in rates], "replies_without_verdict": without_verdict}


async def measure_judge(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    import contextlib
    import shutil
    import tempfile

    from aiohttp import web

    from policyloop.bus import Bus, build_topology
    from policyloop.cluster.local import start_nats
    from policyloop.engines.embedded import start_engine
    from policyloop.models.tokenizer import load_tokenizer
    from policyloop.serving.openai_api import OpenAIApi

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    trajectories = samples(args.samples, args.seed)
    if args.judge_url:
        results = [await one_concurrency(args.judge_url, args.judge_model, trajectories, c, args.repeats)
                   for c in sizes]
        return {"scorer": "judge", "judge_url": args.judge_url, "samples": args.samples, "repeats": args.repeats,
                "results": results}
    with tempfile.TemporaryDirectory() as root:
        async with contextlib.AsyncExitStack() as stack:
            policy = args.model_path
            if policy is None:
                from policyloop.models.bootstrap import BootstrapConfig, bootstrap

                policy = bootstrap(BootstrapConfig())
            model = Path(root) / "judge-model"
            shutil.copytree(policy, model)
            config = json.loads((model / "tokenizer_config.json").read_text())
            (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
            nats = start_nats(Path(root))
            stack.callback(lambda: (nats.signal(15), nats.proc.wait(30) if nats.proc else None))
            bus = await Bus.connect(f"nats://127.0.0.1:{nats.ports['client']}", name="perf", topology=build_topology())
            stack.push_async_callback(bus.close)
            await bus.ensure_topology()
            engine = await start_engine(model, max_batch=max(sizes), threads=args.engine_threads)
            stack.push_async_callback(engine.stop)
            client = SGLangClient(engine.base_url, timeout_s=600, retries=0)
            stack.push_async_callback(client.close)
            runner = web.AppRunner(OpenAIApi(client, load_tokenizer(model), bus, "judge-model").app())
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
            await one_concurrency(url, "judge-model", trajectories[:8], 8, 1)  # warm-up
            results = [await one_concurrency(url, "judge-model", trajectories, c, args.repeats) for c in sizes]
    return {"scorer": "judge", "model_path": str(policy), "samples": args.samples, "repeats": args.repeats,
            "engine_threads": args.engine_threads, "results": results}


async def measure(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    model_path = args.model_path
    if model_path is None:
        from policyloop.models.bootstrap import bootstrap
        from policyloop.models.reward_model import REWARD_MODEL_BOOTSTRAP

        model_path = bootstrap(REWARD_MODEL_BOOTSTRAP)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    url, proc = engine_url_or_start(args.engine_url, Path(model_path), max_batch=max(batch_sizes),
                                    threads=args.engine_threads)
    try:
        async with SGLangClient(url) as client:
            await wait_for_engine(client, proc, 120)
        trajectories = samples(args.samples, args.seed)
        # A first pass warms the engine up (allocator, kernels) before anything is timed.
        await one_batch_size(url, trajectories[:16], 16, 1, 1)
        results = [await one_batch_size(url, trajectories, b, args.concurrency, args.repeats) for b in batch_sizes]
    finally:
        await stop_engine(proc)
    return {"scorer": "reward_model", "model_path": str(model_path), "samples": args.samples,
            "concurrency": args.concurrency,
            "engine_threads": args.engine_threads, "repeats": args.repeats, "results": results}


def plot(result: dict, path: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["max_batch"] for r in rows], [r["samples_per_s"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    judge = result["scorer"] == "judge"
    ax.set_xlabel("judgements in flight" if judge else "max samples per /classify call")
    ax.set_ylabel("samples scored per second (median)")
    ax.set_title(f"{'LLM judge' if judge else 'reward model'} throughput, {result['samples']} samples", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scorer", choices=("reward_model", "judge"), default="reward_model")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="reward_model: a sequence-classification directory (default: the bootstrap reward "
                             "model); judge: the judge's causal LM (default: the bootstrap policy).")
    parser.add_argument("--judge-url", default="", help="judge: an OpenAI-compatible endpoint (.../v1) to time.")
    parser.add_argument("--judge-model", default="judge-model", help="judge: the model to ask at --judge-url.")
    parser.add_argument("--engine-url", default="", help="An engine already serving it (default: start one).")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=2, help="/classify calls in flight.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("perf/out/reward_throughput"))
    args = parser.parse_args()
    configure_logging(service="perf", run_id="perf", instance="perf", level="WARNING")
    result = asyncio.run(measure_judge(args) if args.scorer == "judge" else measure(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reward_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "reward_throughput.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
