"""One learner process trains every kind of run at once (learner.combined): a full-model run and
a LoRA run started at the gateway and a Tinker API model driven with the official SDK, each
stepping on its own version sequence, with one status that says all three."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import tinker

from policyloop.bus import Bus
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.rl.lora import adapter_model_name
from policyloop.state import HeartbeatRegistry, VersionRegistry
from tests.conftest import ServiceLauncher
from tests.helpers import addition_environment, eventually, publish_run_group
from tests.integration.test_tinker_api import BASE_MODEL, SEQUENCES, datum, engine, front, service_client  # noqa: F401

ENVIRONMENT = [loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)]



@pytest.mark.timeout(300)
async def test_one_learner_trains_a_full_model_run_a_lora_run_and_a_tinker_model_at_once(
        bus: Bus, services: ServiceLauncher, redis_client, front: str, tmp_path: Path,  # type: ignore[no-untyped-def]  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    learner = services.start("learner", env={
        "POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_TINKER": "true", "POLICYLOOP_BASE_MODEL": BASE_MODEL,
        "POLICYLOOP_GROUPS_PER_STEP": "1", "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"})
    gateway = services.start("gateway")
    await services.wait_healthy(learner, gateway, timeout_s=120)
    versions = VersionRegistry(redis_client, "default")
    lora_model = adapter_model_name("policy", "lora-run")

    def tinker_steps() -> tuple[list[float], dict[str, float]]:
        training = service_client(front, monkeypatch).create_lora_training_client(base_model=BASE_MODEL,
                                                                                  rank=4).result()
        losses = []
        for _ in range(3):
            result = training.forward_backward([datum(s) for s in SEQUENCES], "cross_entropy").result()
            losses.append(result.metrics["loss:sum"])
            training.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        # A policy-gradient loss of the same registry reports its statistics as metrics too.
        sampled = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={
            "target_tokens": np.array(s[1:], dtype=np.int64), "logprobs": np.full(len(s) - 1, -2.0, np.float32),
            "advantages": np.ones(len(s) - 1, np.float32)}) for s in SEQUENCES]
        return losses, training.forward(sampled, "ppo").result().metrics

    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=addition_environment(4)),
                                     timeout=10)
        # Either kind of run is taken: the learner trains both.
        await stub.StartRun(loop_pb2.StartRunRequest(run_id="full-run", environments=ENVIRONMENT, num_tasks=2),
                            timeout=10)
        await stub.StartRun(loop_pb2.StartRunRequest(run_id="lora-run", environments=ENVIRONMENT, num_tasks=2,
                                                     lora=loop_pb2.LoraSpec(rank=4)), timeout=10)
        tinker_losses = asyncio.create_task(asyncio.to_thread(tinker_steps))
        await publish_run_group(bus, "full-run", "f0")
        await publish_run_group(bus, "lora-run", "l0")

        async def both_stepped() -> bool:
            return await versions.get("policy") == 1 and await versions.get(lora_model) == 1

        await eventually(both_stepped, timeout_s=180)
        losses, ppo_metrics = await asyncio.wait_for(tinker_losses, 180)
    assert losses[-1] < losses[0], losses  # the Tinker model's optim_steps were applied, between the runs' steps
    assert {"loss:sum", "clip_fraction:mean", "ratio_mean:mean", "kl_behaviour:mean"} <= set(ppo_metrics), ppo_metrics
    assert 0.0 <= ppo_metrics["clip_fraction:mean"] <= 1.0 and ppo_metrics["ratio_mean:mean"] > 0

    async def reported() -> bool:
        [beat] = await HeartbeatRegistry(redis_client, "default").alive("learner")
        status = beat.learner
        return status.step == 1 and dict(status.lora_run_versions) == {"lora-run": 1}

    await eventually(reported, timeout_s=30)
    [beat] = await HeartbeatRegistry(redis_client, "default").alive("learner")
    assert beat.learner.full_model and beat.learner.lora_runs and beat.learner.tinker
    assert beat.learner.trained_samples == 2  # the full model's run; the LoRA run's in lora_run_versions
