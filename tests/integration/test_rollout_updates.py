"""A rollout replica takes a new version while it samples, through the SGLang client and each of
SGLang's pause modes: requests in flight go on (in_place, retract) or are aborted and resumed as
partial rollouts (abort); every token's version is recorded."""

from __future__ import annotations

import time

import aiohttp
import pytest
import safetensors.torch
import torch

from policyloop.bus import Bus, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from policyloop.engines.sglang_client import SGLangClient
from policyloop.state import HeartbeatRegistry
from policyloop.weights.client import WeightClient
from policyloop.weights.push import VersionPusher
from policyloop.weights.torch_io import weight_set
from tests.conftest import HEARTBEAT_INTERVAL_S, ServiceLauncher
from tests.helpers import eventually, stored_samples

EXACT_46 = bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_EXACT_ANSWER), answer="46")

# Fixed-length samples (ignore_eos): every wave decodes TOKENS steps.
TASKS, GROUP, TOKENS = 16, 8, 200


async def test_engine_embedded_a_version_that_aborts_requests_in_flight_resumes_them(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """engine=embedded (the replica starts its own engine) through the same SGLang client, with
    pause mode abort: a version published while the replica samples aborts the requests in
    flight, and the replica resubmits each (partial rollouts) so that every sample gets its full
    budget, its tokens' versions recorded. The test holds the replica's engine (paused in place)
    with decoded tokens in flight until the version arrives, whatever the machine's speed: the
    replica's own abort-mode update ends the hold."""
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    rollout = services.start("rollout", env={"POLICYLOOP_MAX_LAG": "-1", "POLICYLOOP_WEIGHT_UPDATE_MODE": "abort"})
    await services.wait_healthy(rollout, timeout_s=60)
    [beat] = await HeartbeatRegistry(redis_client, "default").alive("rollout")
    engine = SGLangClient(beat.rollout.engine_url, timeout_s=30)
    try:
        await _update_mid_generation("abort", _holding(engine), bus, services, redis_client, publisher, rollout)
    finally:
        await engine.close()


def _holding(engine: SGLangClient):  # type: ignore[no-untyped-def]
    """A condition that holds the engine (paused in place) once decoded tokens are in flight, so
    the version pushed next lands mid-generation however slow the machine; the replica's own
    update (pause in its mode, load, continue) ends the hold."""

    async def held_with_tokens_in_flight() -> bool:
        if await _engine_metric(engine, "policyloop_engine_in_flight_output_tokens") == 0:
            return False
        await engine.pause_generation("in_place")  # answers once the engine is between two steps
        if await _engine_metric(engine, "policyloop_engine_in_flight_output_tokens") > 0:
            return True
        await engine.continue_generation()  # paused between two waves: try again
        return False

    return held_with_tokens_in_flight


async def _engine_metric(engine: SGLangClient, name: str) -> float:
    """One sample of the engine's /metrics (SGLang's exposition format)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(f"{engine.base_url}/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in the engine's /metrics")


# in_place and retract through the rollout, with the engine in this process (the replica drives
# it at its URL, as it would SGLang), so that the version is pushed once tokens are flowing. Both
# modes keep requests in the engine, which test_engine covers without the services around them.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_a_version_published_mid_generation_reaches_requests_in_flight(
        mode: str, bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    from policyloop.engines.embedded import start_engine

    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    engine = await start_engine(services.model_dir, weight_version="0")
    try:
        rollout = services.start("rollout", env={
            "POLICYLOOP_ENGINE": "sglang", "POLICYLOOP_ENGINE_URL": engine.base_url, "POLICYLOOP_MAX_LAG": "-1",
            "POLICYLOOP_WEIGHT_UPDATE_MODE": mode})

        async with SGLangClient(engine.base_url, timeout_s=30) as client:
            await _update_mid_generation(mode, _holding(client), bus, services, redis_client, publisher, rollout)
    finally:
        await engine.stop()


async def _update_mid_generation(mode: str, generating, bus: Bus, services: ServiceLauncher, redis_client,  # type: ignore[no-untyped-def]
                                 publisher, rollout) -> None:
    reward = services.start("reward")
    await services.wait_healthy(rollout, reward, timeout_s=60)
    base = safetensors.torch.load_file(str(services.model_dir / "model.safetensors"))
    torch.manual_seed(0)
    changed = {k: t + 0.05 * torch.randn_like(t) if t.is_floating_point() else t for k, t in base.items()}
    version = weight_set(1, changed)
    for n in range(TASKS):
        await bus.publish(tasks_subject("addition@v1"), bus_pb2.Task(
            task_id=f"t{n}", run_id="r", environment="addition@v1", prompt_text="12+34=", group_size=GROUP,
            scorer=EXACT_46, sampling=bus_pb2.SamplingParams(
                max_new_tokens=TOKENS, temperature=1.0, seed=n, ignore_eos=True)), f"t{n}")

    await eventually(generating, timeout_s=60, interval_s=0.02, what="tokens being generated")
    client = WeightClient(f"127.0.0.1:{publisher.ports['grpc']}")
    try:
        await VersionPusher(client, "policy").push(version, step=1)
    finally:
        await client.close()

    async def all_scored() -> bool:
        return len(await stored_samples(bus, "TRAJECTORIES")) == TASKS * GROUP

    await eventually(all_scored, timeout_s=120, what="every sample scored")
    trajectories = await stored_samples(bus, "TRAJECTORIES")
    straddling = 0
    kinds: dict[tuple[int, ...], int] = {}
    for traj in trajectories:
        n = len(traj.response_token_ids)
        spans = [(s.version, s.start, s.end) for s in traj.version_spans]
        assert n == TOKENS and len(traj.behaviour_logprobs) == n  # every token has its logprob
        assert spans[0][1] == 0 and spans[-1][2] == n
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
        assert [v for v, _, _ in spans] in ([0], [1], [0, 1])
        straddling += [v for v, _, _ in spans] == [0, 1]
        kinds[tuple(v for v, _, _ in spans)] = kinds.get(tuple(v for v, _, _ in spans), 0) + 1
        # Never cut short: an aborted request was resumed until it used its budget.
        assert traj.finish_reason == bus_pb2.FINISH_REASON_LENGTH
    assert straddling > 0, f"no sample was in flight across the update: {kinds}"
    async def counted() -> bool:  # the replica's figures reach its next heartbeat
        [beat] = await HeartbeatRegistry(redis_client, "default").alive("rollout")
        return beat.rollout.resubmitted > 0

    if mode == "abort":
        await eventually(counted, timeout_s=30, what="the resubmissions in the replica's heartbeat")
    [beat] = await HeartbeatRegistry(redis_client, "default").alive("rollout")
    assert (beat.rollout.resubmitted > 0) if mode == "abort" else (beat.rollout.resubmitted == 0)
    assert beat.policy_version == 1


async def test_an_engine_outage_costs_no_delivery_and_a_restarted_engine_gets_a_version_again(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """engine=sglang at a URL. A sample under way when the engine goes away holds its Task until
    the engine is back; while the engine is gone the replica reports unhealthy and takes no new
    Task, so an outage uses up none of a Task's deliveries (however long it lasts). The engine
    comes back as a restarted SGLang does, at weight_version "default" on the base weights: the
    replica names it 0 and loads the newest version (1) again before anything is sampled."""
    from policyloop.cluster.local import free_port
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.sglang_client import SGLangClient

    def task(task_id: str) -> bus_pb2.Task:
        return bus_pb2.Task(
            task_id=task_id, run_id="r", environment="addition@v1", prompt_text="12+34=", group_size=2,
            scorer=EXACT_46, sampling=bus_pb2.SamplingParams(max_new_tokens=6))

    port = free_port()
    engine = await start_engine(services.model_dir, port=port)  # boots at "default", like SGLang
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    rollout = services.start("rollout", env={
        "POLICYLOOP_ENGINE": "sglang", "POLICYLOOP_ENGINE_URL": engine.base_url, "POLICYLOOP_MAX_LAG": "-1",
        "POLICYLOOP_ENGINE_HEALTH_INTERVAL_S": "0.3", "POLICYLOOP_GENERATE_TIMEOUT_S": "5"})
    await services.wait_healthy(rollout, timeout_s=60)
    registry = HeartbeatRegistry(redis_client, "default")
    async with SGLangClient(engine.base_url, timeout_s=5) as direct:
        assert (await direct.model_info()).weight_version == "0"  # named by the replica
        await _push_version(publisher, services, 1)

        async def at_version_1() -> bool:
            return (await direct.model_info()).weight_version == "1"

        await eventually(at_version_1, timeout_s=30, what="version 1 loaded")
        await direct.pause_generation("in_place")  # the next sample is held inside the engine
    await bus.publish(tasks_subject("addition@v1"), task("held"), "held")

    async def in_engine() -> bool:
        return len(engine.scheduler.requests) == 2

    await eventually(in_engine, timeout_s=30, what="the first task's samples inside the engine")
    await engine.stop()

    async def unhealthy() -> bool:
        beats = await registry.alive("rollout")
        return bool(beats) and not beats[0].healthy

    await eventually(unhealthy, timeout_s=15, what="the replica reporting its engine gone")

    async def not_pulling() -> bool:  # a pull already waiting when health changed has expired
        return (await bus.backlog("rollout")).waiting == 0

    await eventually(not_pulling, timeout_s=15, what="no pull request waiting at the server")
    await bus.publish(tasks_subject("addition@v1"), task("during"), "during")
    published_ms = time.time() * 1000

    async def beaten_twice_since() -> bool:  # the replica's loop went on (and could have pulled) meanwhile
        beats = await registry.alive("rollout")
        return bool(beats) and beats[0].beat_unix_ms > published_ms + 2000 * HEARTBEAT_INTERVAL_S

    await eventually(beaten_twice_since, timeout_s=30, what="two heartbeats of the unhealthy replica")
    backlog = await bus.backlog("rollout")
    assert (backlog.pending, backlog.ack_pending, backlog.redelivered) == (1, 1, 0), backlog
    assert await stored_samples(bus, "ROLLOUTS") == []
    engine = await start_engine(services.model_dir, port=port)
    try:
        async def sampled() -> bool:
            return len(await stored_samples(bus, "ROLLOUTS")) == 4

        await eventually(sampled, timeout_s=60, what="both tasks sampled once the engine is back")
        await services.wait_healthy(rollout, timeout_s=15)
        trajectories = await stored_samples(bus, "ROLLOUTS")
        # The restarted engine was named 0 and given version 1 again before it sampled anything.
        assert {s.version for t in trajectories for s in t.version_spans} == {1}
        assert (await bus.backlog("rollout")).redelivered == 0
        assert any(e["event"] == "engine_unavailable_mid_sample" for e in rollout.log_events())
    finally:
        await engine.stop()


async def _push_version(publisher, services: ServiceLauncher, version: int) -> None:  # type: ignore[no-untyped-def]
    base = safetensors.torch.load_file(str(services.model_dir / "model.safetensors"))
    torch.manual_seed(version)
    changed = {k: t + 0.05 * torch.randn_like(t) if t.is_floating_point() else t for k, t in base.items()}
    client = WeightClient(f"127.0.0.1:{publisher.ports['grpc']}")
    try:
        await VersionPusher(client, "policy").push(weight_set(version, changed), step=version)
    finally:
        await client.close()
