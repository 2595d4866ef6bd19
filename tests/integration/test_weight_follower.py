"""The rollout's weight follower, with the WeightFollower class itself against real NATS, an
in-process publisher on loopback gRPC and an in-process embedded engine (no service processes):
versions are loaded in order, a delta from the held version after the first keyframe, and the
ones announced while a load runs are skipped for the newest, never applied out of order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from policyloop.bus import Bus
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import status_pb2
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.publisher.announcer import Announcer
from policyloop.rollout.engine_process import engine_client, name_base_version
from policyloop.rollout.follower import WeightFollower
from policyloop.rollout.settings import RolloutSettings
from policyloop.runtime import ServiceContext
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.library import WeightLibrary
from policyloop.weights.push import VersionPusher
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.torch_io import weight_set
from tests.helpers import until


class GatedFetches(WeightServicer):
    """A publisher that records what each Fetch asks for and serves it once the gate is open."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def Fetch(self, request, context):  # type: ignore[no-untyped-def]
        self.asked.append(request.want_version)
        await self.gate.wait()
        async for chunk in super().Fetch(request, context):
            yield chunk


@dataclass
class Rig:
    publisher: GatedFetches
    pusher: VersionPusher
    engine: EmbeddedEngine
    ctx: ServiceContext
    follower: WeightFollower | None = None


def version(model_dir: Path, number: int) -> WeightSet:
    """The tiny model's parameters with noise of their own per version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(number)
    return weight_set(number, {name: (p.detach() + 0.05 * torch.randn(p.shape, generator=generator)).contiguous()
                               for name, p in model.named_parameters()})


def serves(engine: EmbeddedEngine, weights: WeightSet) -> bool:
    served = engine.served.parameters()
    return all(torch.equal(served[name].contiguous().view(torch.uint8).reshape(-1),
                           torch.frombuffer(bytearray(data), dtype=torch.uint8))
               for name, data in ((n, t.data) for n, t in weights.tensors.items()))


@asynccontextmanager
async def rig(bus: Bus, redis_client, model_dir: Path, root: Path,  # type: ignore[no-untyped-def]
              weight_load: str = "directory", weight_activation: str = "auto") -> AsyncIterator[Rig]:
    library = WeightLibrary(VersionStore(root / "store", retention=8), snapshot_every=2)
    announcer = Announcer(bus)
    publisher = GatedFetches(library, on_stored=announcer.announce)
    server, port = await start_weight_server(publisher, host="127.0.0.1", port=0)
    announcer.endpoint = f"127.0.0.1:{port}"
    weights_client = WeightClient(announcer.endpoint, deadline_s=60)
    engine = await start_engine(model_dir, threads=1)
    settings = RolloutSettings(model_path=model_dir, weights_dir=root / "versions", instance_id="rollout-t",
                               weight_load=weight_load, weight_activation=weight_activation)
    client = engine_client(settings, engine.base_url)
    ctx = ServiceContext(name="rollout", settings=settings, bus=bus, redis=redis_client)
    ctx.policy_version = await name_base_version(client)
    rigged = Rig(publisher, VersionPusher(weights_client, settings.model), engine, ctx)
    running: asyncio.Task[None] | None = None

    def start() -> WeightFollower:
        nonlocal running
        rigged.follower = WeightFollower(ctx, settings, client, status_pb2.RolloutStatus())
        running = asyncio.create_task(rigged.follower.run())
        return rigged.follower

    rigged.start = start  # type: ignore[attr-defined]
    try:
        yield rigged
    finally:
        ctx.stop.set()
        publisher.gate.set()
        if running is not None:
            await asyncio.wait_for(running, 30)
        await client.close()
        await engine.stop()
        await weights_client.close()
        await server.stop(None)
        await library.drain()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("weight_load", "weight_activation"), [("tensors", "pause"), ("directory", "swap")])
async def test_versions_load_in_order_and_those_announced_during_a_load_are_skipped_for_the_newest(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
        weight_load: str, weight_activation: str) -> None:
    """Either way a version reaches the engine: written as a directory the engine stages or loads,
    or sent in the request (weight_load tensors); staged and swapped in, or loaded while paused."""
    versions = {n: version(tiny_model_dir, n) for n in range(1, 5)}
    delays = REGISTRY.get_sample_value("policyloop_weights_serving_delay_seconds_count") or 0
    since_step = REGISTRY.get_sample_value("policyloop_weights_step_to_serving_seconds_count") or 0
    swaps = REGISTRY.get_sample_value("policyloop_rollout_weight_activation_pause_seconds_count") or 0
    async with rig(bus, redis_client, tiny_model_dir, tmp_path, weight_load, weight_activation) as r:
        follower = r.start()  # type: ignore[attr-defined]
        trained_ms = now_ms()
        await r.pusher.push(versions[1], step=1, trained_unix_ms=trained_ms)
        await until(lambda: r.ctx.policy_version == 1, timeout_s=120, what="version 1 loaded")
        assert r.engine.weight_version == "1" and serves(r.engine, versions[1])
        assert follower.status.last_fetch.kind == "keyframe"

        r.publisher.gate.clear()  # the fetch of version 2 waits while versions 3 and 4 come out
        await r.pusher.push(versions[2], step=2)
        await until(lambda: r.publisher.asked == [1, 2], timeout_s=60, what="version 2 being fetched")
        await r.pusher.push(versions[3], step=3)
        await r.pusher.push(versions[4], step=4)
        await until(lambda: follower.latest is not None and follower.latest.version == 4, timeout_s=60,
                    what="version 4 announced")
        assert r.ctx.policy_version == 1  # still serving 1 while 2 is held
        r.publisher.gate.set()

        await until(lambda: r.ctx.policy_version == 4, timeout_s=120, what="version 4 loaded")
        assert r.publisher.asked == [1, 2, 4]  # 3 was announced during a load: skipped, not applied late
        assert r.engine.weight_version == "4" and serves(r.engine, versions[4])
        assert follower.status.last_fetch.kind == "delta"  # from the held version 2
        assert follower.held is not None and follower.held.version == 4
        written = tmp_path / "versions" / "rollout-t"
        if weight_load == "directory":  # the one being served, no other
            assert sorted(p.name for p in written.iterdir()) == ["v000000004"]
        else:
            assert not written.exists()
        # Publication to serving, once per version served (1, 2 and 4).
        assert REGISTRY.get_sample_value("policyloop_weights_serving_delay_seconds_count") == delays + 3
        # From the step's end only where the push said when that was (version 1); the publisher keeps it.
        assert REGISTRY.get_sample_value("policyloop_weights_step_to_serving_seconds_count") == since_step + 1
        listed = {v.version: v.trained_unix_ms for v in await r.pusher.client.list_versions("policy")}
        assert listed[1] == trained_ms and listed[4] == 0
        # Each version swapped in (1, 2 and 4) recorded its pause; a paused load records none.
        swapped = (REGISTRY.get_sample_value("policyloop_rollout_weight_activation_pause_seconds_count") or 0) - swaps
        assert swapped == (3 if weight_activation == "swap" else 0)
        assert r.engine.scheduler.activations == swapped


@pytest.mark.timeout(240)
async def test_a_replica_that_starts_late_loads_the_last_announced_version(
        bus: Bus, redis_client, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    versions = {n: version(tiny_model_dir, n) for n in (1, 2)}
    async with rig(bus, redis_client, tiny_model_dir, tmp_path) as r:
        await r.pusher.push(versions[1], step=1)
        await r.pusher.push(versions[2], step=2)
        follower = r.start()  # type: ignore[attr-defined]
        await until(lambda: r.ctx.policy_version == 2, timeout_s=120, what="version 2 loaded")
        assert r.publisher.asked == [2]
        assert follower.status.last_fetch.kind == "keyframe" and serves(r.engine, versions[2])
