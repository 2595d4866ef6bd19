"""The replica's engine health check also reads how busy its engine is (queue, running requests,
KV cache use) into the replica's own metrics: a real embedded engine, the EngineHealth class."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import REGISTRY

from policyloop.engines.embedded import start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rollout.health import EngineHealth
from tests.helpers import until


def load(figure: str) -> float | None:
    return REGISTRY.get_sample_value("policyloop_engine_load", {"figure": figure})


async def test_the_health_check_reports_the_engine_load(tiny_model_dir: Path) -> None:
    engine = await start_engine(tiny_model_dir, threads=1)
    client = SGLangClient(engine.base_url, timeout_s=60)

    async def resync() -> None:
        await client.update_weight_version("0")

    health = EngineHealth(client, 1.0, None, resync)
    try:
        request = GenerateRequest(input_ids=[5, 14, 6], rid="busy",
                                  sampling_params=SamplingParams(max_new_tokens=240, temperature=0.0, ignore_eos=True))
        busy = asyncio.create_task(client.generate(request))
        await until(lambda: (engine.progress("busy") or 0) >= 2, what="decoding")
        await client.pause_generation("in_place")
        await health.check()
        assert health.ready()
        assert load("running_requests") == 1 and load("queued_requests") == 0
        assert load("kv_used_tokens") == 3 + engine.progress("busy")
        assert 0 < (load("kv_usage") or 0) < 1
        await client.continue_generation()
        await asyncio.wait_for(busy, 60)
        await health.check()
        assert load("running_requests") == 0 and load("kv_used_tokens") == 0
    finally:
        await client.close()
        await engine.stop()
