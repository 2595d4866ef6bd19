"""What the bus hop costs a Tinker sample request: the same request sampled on an embedded engine
directly (EngineSampler, what the front did before it kept no engine) and through the Tinker API
as it runs now (asample on the front → TINKER_SAMPLES → a replica's TinkerSampling → the engine →
TINKER_RESULTS → retrieve_future), one request at a time, against a nats-server and a
redis-server of its own. Front, replica and engine client share this process (in a cluster they
are three), so the figure is the hop's own cost, not a network's. Prints JSON: medians and p90s.

    .venv/bin/python perf/tinker_sampling.py --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from policyloop.bus import Bus, build_topology
from policyloop.cluster.local import ManagedProcess, start_nats, start_redis
from policyloop.contracts.v1 import tinker_pb2
from policyloop.engines.embedded import start_engine
from policyloop.engines.sglang_client import SGLangClient
from policyloop.models.bootstrap import BootstrapConfig, bootstrap
from policyloop.state import connect_redis
from policyloop.telemetry.logging import configure_logging
from policyloop.tinker.sampling import EngineSampler, TinkerSampling
from policyloop.tinker.server import TinkerApi
from policyloop.weights.client import WeightClient

BASE_MODEL = "arith"
PROMPT = [4, 5, 6, 7, 8, 9, 10, 11]


def quantiles(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2)}


def sample_body(session: str, seq_id: int, num_samples: int, max_tokens: int) -> dict:  # type: ignore[type-arg]
    return {"sampling_session_id": f"{session}:sample:0", "seq_id": seq_id, "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seq_id}}


async def direct(engine_url: str, requests: int, num_samples: int, max_tokens: int) -> list[float]:
    client = SGLangClient(engine_url, timeout_s=120, retries=0)
    sampler = EngineSampler(client, lambda endpoint: WeightClient(endpoint))
    took = []
    for i in range(requests):
        request = tinker_pb2.TinkerSampleRequest(request_id=f"direct-{i}", prompt=PROMPT, num_samples=num_samples,
                                                 max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                                                 seed=i, session=tinker_pb2.TinkerSamplingSession())
        started = time.perf_counter()
        await sampler.sample(request)
        took.append(time.perf_counter() - started)
    await client.close()
    return took


async def through_the_api(bus: Bus, redis_url: str, engine_url: str, requests: int, num_samples: int,
                          max_tokens: int) -> list[float]:
    redis = await connect_redis(redis_url, decode_responses=False)
    api = TinkerApi(bus, redis, namespace="perf", base_model=BASE_MODEL)
    runner = aiohttp.web.AppRunner(api.app())
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/api/v1"  # type: ignore[union-attr]
    client = SGLangClient(engine_url, timeout_s=120, retries=0)
    worker = TinkerSampling(bus, EngineSampler(client, lambda endpoint: WeightClient(endpoint))).pull_worker()
    stop = asyncio.Event()
    consuming = asyncio.create_task(worker.run(stop))
    took = []
    async with aiohttp.ClientSession() as http:
        async def post(route: str, body: dict) -> bytes:  # type: ignore[type-arg]
            async with http.post(f"{url}/{route}", json=body) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"{route}: {answer.status} {await answer.text()}")
                return await answer.read()

        session = json.loads(await post("create_session", {}))["session_id"]
        await post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": BASE_MODEL})
        for i in range(requests):
            started = time.perf_counter()
            request_id = json.loads(await post("asample", sample_body(session, i + 1, num_samples,
                                                                      max_tokens)))["request_id"]
            while (answer := await post("retrieve_future", {"request_id": request_id})).startswith(b"{"):
                if json.loads(answer).get("type") != "try_again":
                    raise RuntimeError(f"sampling failed: {answer!r}")
            took.append(time.perf_counter() - started)
    stop.set()
    await consuming
    await worker.drain(5)
    await client.close()
    await runner.cleanup()
    await redis.aclose()
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="requests timed on each path (after 5 warm-up)")
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model-path", default="", help="a model directory (default: the bootstrap model)")
    args = parser.parse_args()
    configure_logging(service="perf", run_id="perf", instance="perf", level="WARNING")
    model = Path(args.model_path) if args.model_path else await asyncio.to_thread(bootstrap, BootstrapConfig())
    with tempfile.TemporaryDirectory() as root:
        servers: list[ManagedProcess] = [start_nats(Path(root)), start_redis(Path(root))]
        engine = await start_engine(model, max_batch=64, threads=1)
        try:
            bus = await Bus.connect(f"nats://127.0.0.1:{servers[0].ports['client']}", name="perf",
                                    topology=build_topology())
            await bus.ensure_topology()
            redis_url = f"redis://127.0.0.1:{servers[1].ports['client']}/0"
            figures = {}
            for name, path in (("direct", lambda n: direct(engine.base_url, n, args.num_samples, args.max_tokens)),
                               ("through_the_api", lambda n: through_the_api(
                                   bus, redis_url, engine.base_url, n, args.num_samples, args.max_tokens))):
                await path(5)
                figures[name] = quantiles(await path(args.requests))
            await bus.close()
        finally:
            await engine.stop()
            for server in servers:
                server.signal(signal.SIGTERM)
                if server.proc is not None:
                    server.proc.wait(30)
    hop = figures["through_the_api"]["median_ms"] - figures["direct"]["median_ms"]
    print(json.dumps({"requests": args.requests, "num_samples": args.num_samples, "max_tokens": args.max_tokens,
                      **figures, "hop_median_ms": round(hop, 2)}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
