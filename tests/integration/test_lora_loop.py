"""Two LoRA runs through the whole loop as processes (gateway, rollout with its embedded engine,
reward, learner, publisher): each run's tasks are sampled with its own adapter, the newest its
replica loaded, every token stamped with that adapter's version; each run's learner steps make
its own version sequence, pushed as adapter deltas and followed by the replica.

Slow set (make test-all): the default run covers each hop of it faster — the learner's LoRA runs
through the gateway (test_lora_service.py), their deltas to a replica (test_adapter_sync.py,
test_served_adapters.py) and the engine sampling with adapters (test_engine_lora.py)."""

from __future__ import annotations

import grpc
import pytest

from policyloop.bus import Bus
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.ledger import trained_steps
from policyloop.rl.lora import adapter_model_name
from policyloop.state import VersionRegistry
from tests.conftest import ServiceLauncher
from tests.helpers import addition_environment, eventually, stored_samples

LORA = {"POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_FULL_MODEL": "false", "POLICYLOOP_GROUPS_PER_STEP": "2"}


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_two_lora_runs_sample_with_their_own_adapters_and_train_their_own_versions(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    endpoint = {"POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"}
    learner = services.start("learner", env=LORA | endpoint)
    rollout = services.start("rollout", env=LORA)
    reward, gateway = services.start("reward"), services.start("gateway")
    await services.wait_healthy(learner, rollout, reward, gateway, timeout_s=120)
    versions = VersionRegistry(redis_client, "default")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(
            environment=addition_environment(12, group_size=2)), timeout=10)
        for run_id, seed in (("ra", 1), ("rb", 2)):
            await stub.StartRun(loop_pb2.StartRunRequest(
                run_id=run_id, environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)],
                num_tasks=12, seed=seed, lora=loop_pb2.LoraSpec(rank=4, target_modules=["q_proj", "v_proj"])),
                timeout=10)
        models = {run_id: adapter_model_name("policy", run_id) for run_id in ("ra", "rb")}

        async def both_trained() -> bool:
            return all([await versions.get(m) >= 3 for m in models.values()])

        await eventually(both_trained, timeout_s=300)

    trajectories = await stored_samples(bus, "TRAJECTORIES")
    for run_id, model in models.items():
        mine = [t for t in trajectories if t.run_id == run_id]
        stamped = {s.version for t in mine for s in t.version_spans}
        # The base first, then its own adapter versions (a version superseded before a task
        # sampled with it never shows), none newer than the run has made.
        newest = await versions.get(model)
        assert 0 in stamped and max(stamped) >= 1 and max(stamped) <= newest, (run_id, stamped, newest)
        assert all(len(t.version_spans) == 1 for t in mine if t.response_token_ids)
        records = await trained_steps(bus, model)
        assert [r.version for r in records][:3] == [1, 2, 3]
        trained = {i for r in records for i in r.trajectory_ids}
        assert trained <= {t.trajectory_id for t in mine}  # a run trains its own samples only
