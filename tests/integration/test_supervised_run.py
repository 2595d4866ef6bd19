"""SFT through the same services as RL: a supervised environment submitted to the gateway (its
text made the model's token ids there), a run of it fed as demonstrations to TRAJECTORIES, the
learner's cross-entropy steps recorded in LEDGER and published as versions the publisher serves —
the same weight sync the rollout replicas follow."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import torch

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc
from policyloop.gateway.feeder import RunFeeder
from policyloop.gateway.feeding import nth_item
from policyloop.gateway.model_context import load_model_context
from policyloop.gateway.validation import prepare_environment
from policyloop.ledger import audit_bus
from policyloop.models.tokenizer import VOCAB
from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.state import IdempotencyKeys, VersionRegistry, connect_redis
from policyloop.state.catalog import EnvironmentCatalog, RunRegistry
from policyloop.weights.client import WeightClient
from policyloop.weights.sync import sync_weights
from policyloop.weights.torch_io import to_tensor
from tests.conftest import ServiceLauncher
from tests.helpers import eventually, stored

IDS = {ch: i for i, ch in enumerate(VOCAB)}
STEPS = 4
PER_STEP = 2


def demos_environment() -> loop_pb2.Environment:
    """Two demonstrations as text (the gateway tokenizes them) and one as ids."""
    return loop_pb2.Environment(name="demos", version="v1", supervised=True, tasks=[
        loop_pb2.TaskSpec(prompt_text="12+30=", demonstration_text="42"),
        loop_pb2.TaskSpec(prompt_text="7+8=", demonstration_text="15"),
        loop_pb2.TaskSpec(prompt_token_ids=[IDS[c] for c in "5+5="], demonstration_token_ids=[IDS["1"], IDS["0"]]),
    ])


def mean_nll(model: torch.nn.Module, samples: list[bus_pb2.Trajectory]) -> float:
    batch = pack([list(t.prompt_token_ids) for t in samples], [list(t.response_token_ids) for t in samples])
    with torch.no_grad():
        return float(-(token_logprobs(model, batch) * batch.response_mask).sum() / batch.response_mask.sum())


def write_demos(path: Path) -> Path:
    """demos_environment's tasks as the JSONL `policyloop env submit --supervised` reads."""
    rows = [{"prompt": t.prompt_text, "demonstration": t.demonstration_text} if t.demonstration_text else
            {"prompt_token_ids": list(t.prompt_token_ids), "demonstration_token_ids": list(t.demonstration_token_ids)}
            for t in demos_environment().tasks]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_a_supervised_run_trains_the_demonstrations_by_cross_entropy_through_the_services(
        bus: Bus, services: ServiceLauncher, redis_client, tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    endpoint = f"127.0.0.1:{publisher.ports['grpc']}"
    learner = services.start("learner", env={
        "POLICYLOOP_GROUPS_PER_STEP": str(PER_STEP), "POLICYLOOP_PUBLISHER_ENDPOINT": endpoint,
        "POLICYLOOP_OPTIMIZER__LR": "3e-3"})
    gateway = services.start("gateway")
    await services.wait_healthy(learner, gateway, timeout_s=60)
    target = f"127.0.0.1:{gateway.ports['grpc']}"
    submitted = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "policyloop", "env", "submit", str(write_demos(tmp_path / "demos.jsonl")),
        "--name", "demos", "--supervised", "--gateway", target], capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["tasks"] == 3
    async with grpc.aio.insecure_channel(target) as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        # One short of a full last batch: the gateway feeds a multiple of the learner's batch.
        request = loop_pb2.StartRunRequest(run_id="sft", num_tasks=STEPS * PER_STEP - 1,
                                           environments=[loop_pb2.EnvironmentMix(environment="demos@v1", weight=1)])
        await stub.StartRun(request)
        versions = VersionRegistry(redis_client, "default")

        async def trained() -> bool:
            return await versions.get("policy") == STEPS

        await eventually(trained, timeout_s=120)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id="sft"))
        # A run started now starts from the version the first one made: the evaluator's baseline.
        later = await stub.StartRun(loop_pb2.StartRunRequest(run_id="later", num_tasks=1, environments=[
            loop_pb2.EnvironmentMix(environment="demos@v1", weight=1)]))
        await stub.StopRun(loop_pb2.StopRunRequest(run_id="later"))
    assert run.tasks_enqueued == STEPS * PER_STEP and run.start_version == 0 and later.start_version == STEPS

    # What the gateway fed: the demonstrations as the learner got them, exact ids and all.
    env = demos_environment()
    prepare_environment(env, load_model_context(tiny_model_dir))
    items = (nth_item("sft", request, {"demos@v1": env}, i) for i in range(STEPS * PER_STEP))
    fed = {d.trajectory_id: d for d in items}
    assert all(isinstance(d, bus_pb2.Trajectory) and d.supervised for d in fed.values())
    events = await stored(bus, "LEDGER", bus_pb2.LedgerEvent)
    steps = sorted((e for e in events if e.kind == bus_pb2.LedgerEvent.KIND_TRAINED
                    and e.trajectory_ids[0].startswith("sft:")), key=lambda e: e.step)
    assert [e.policy_version for e in steps] == list(range(1, STEPS + 1))
    assert sorted(t for e in steps for t in e.trajectory_ids) == sorted(fed)  # each trained once, none lost
    audited = await audit_bus(bus, "sft")  # the audit accounts for every demonstration the gateway fed
    assert (audited.generated, audited.trained, audited.lost, audited.trained_twice,
            audited.trained_not_generated) == (STEPS * PER_STEP, STEPS * PER_STEP, 0, 0, 0)

    # The learner's first step is cross-entropy on its demonstrations under the base weights.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    [first] = [e for e in learner.log_events() if e["event"] == "step" and e["step"] == 1]
    assert abs(first["loss"] - mean_nll(base, [fed[t] for t in steps[0].trajectory_ids])) < 1e-4

    # The version the publisher serves — what rollout replicas fetch — imitates them better.
    client = WeightClient(endpoint)
    try:
        weights, _ = await sync_weights(client, "policy", None, STEPS)
    finally:
        await client.close()
    tuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = tuned.load_state_dict({name: to_tensor(t) for name, t in weights.tensors.items()}, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied to the embeddings
    demos = list(fed.values())
    assert mean_nll(tuned, demos) < mean_nll(base, demos) - 0.1


async def test_demonstrations_wait_while_the_learner_is_behind(bus: Bus, redis_server, redis_client) -> None:  # type: ignore[no-untyped-def]
    """TRAJECTORIES pushes nothing back, so the feeder paces a supervised run by the learner's
    backlog: at `max_waiting_demonstrations` untaken it pauses (backpressure), and goes on as the
    learner takes them. Every demonstration fed is recorded as generated, for the ledger's audit."""
    raw = await connect_redis(redis_server.url, decode_responses=False)
    envs, runs = EnvironmentCatalog(raw, "t"), RunRegistry(raw, "t")
    await envs.put("demos@v1", loop_pb2.Environment(name="demos", version="v1", supervised=True, tasks=[
        loop_pb2.TaskSpec(prompt_token_ids=[5, 14], demonstration_token_ids=[6, 1])]))
    await runs.create("sft", loop_pb2.StartRunRequest(run_id="sft", num_tasks=12, environments=[
        loop_pb2.EnvironmentMix(environment="demos@v1", weight=1)]), 12)
    paused: list[bool] = []
    stop = asyncio.Event()
    feeder = RunFeeder(bus, envs, runs, IdempotencyKeys(redis_client, "t"), owner="gateway-t", lease_s=10,
                       backpressure_wait_s=0.05, stop=stop, wake=asyncio.Event(), on_backpressure=paused.append,
                       max_waiting_demonstrations=4)
    feeding = asyncio.create_task(feeder.feed("sft"))
    learner = await bus.js.pull_subscribe_bind(durable="learner", stream="TRAJECTORIES")
    try:
        async def held_back() -> bool:
            return True in paused

        await eventually(held_back)
        assert (await bus.backlog("learner")).pending == 4 and (await runs.get("sft")).tasks_enqueued == 4
        taken = 0
        while taken < 12:  # the learner takes what is there; feeding goes on
            for msg in await learner.fetch(4, timeout=30):
                await msg.ack()
                taken += 1
        await asyncio.wait_for(feeding, 30)
        assert (await runs.get("sft")).tasks_enqueued == 12
        generated = [e for e in await stored(bus, "LEDGER", bus_pb2.LedgerEvent)
                     if e.kind == bus_pb2.LedgerEvent.KIND_GENERATED]
        assert sorted(t for e in generated for t in e.trajectory_ids) == [f"sft:{i:09d}/0" for i in range(12)]
    finally:
        stop.set()
        feeding.cancel()
        await learner.unsubscribe()
        await raw.aclose()
