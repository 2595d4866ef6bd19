"""Embedded-engine throughput on this machine: N concurrent /generate requests through
SGLangClient against an in-process engine on loopback, generated tokens per second (median over
repeats). Uses the tiny test model unless --model-path is given. Prints JSON.

    .venv/bin/python perf/engine_throughput.py --requests 32 --max-new-tokens 64 --repeats 3
    .venv/bin/python perf/engine_throughput.py --model-path /models/Qwen2.5-0.5B --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tiny_model

from policyloop.engines.embedded import start_engine  # noqa: E402
from policyloop.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from policyloop.engines.sglang_client import SGLangClient  # noqa: E402


async def one_round(client: SGLangClient, requests: int, prompt_tokens: int, max_new_tokens: int,
                    vocab: int, round_no: int) -> dict:
    reqs = [GenerateRequest(input_ids=[(i * 7 + k) % vocab for k in range(prompt_tokens)],
                            sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                                           sampling_seed=round_no * 100_000 + i, ignore_eos=True))
            for i in range(requests)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(r) for r in reqs))
    seconds = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if model_path is None:
            from tests.tiny_model import build_tiny_model

            model_path = str(build_tiny_model(Path(tmp) / "tiny"))
        engine = await start_engine(model_path, max_batch=args.max_batch, threads=args.threads)
        try:
            vocab = min(engine.vocab_size, 1000)  # prompt ids must be in the vocabulary
            async with SGLangClient(engine.base_url, timeout_s=3600) as client:
                await one_round(client, min(args.requests, 4), args.prompt_tokens, 4, vocab, -1)  # warm-up
                rounds = [await one_round(client, args.requests, args.prompt_tokens, args.max_new_tokens, vocab, i)
                          for i in range(args.repeats)]
        finally:
            await engine.stop()
    return {
        "model_path": args.model_path or "tiny (tests/tiny_model.py)",
        "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
        "max_batch": args.max_batch, "threads": args.threads, "repeats": args.repeats,
        "generated_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rounds),
        "seconds_median": statistics.median(r["seconds"] for r in rounds),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests per round")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    from policyloop.telemetry.logging import configure_logging

    configure_logging(service="perf", run_id="", instance="engine_throughput", level="WARNING")  # stdout: JSON only
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
