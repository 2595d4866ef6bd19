"""The learner service in the many-runs mode (lora_runs) with the gateway and the publisher as
processes: LoRA runs started through the gateway are trained side by side on their own adapters
and version sequences, a full-model run is refused naming the field, a run whose adapter cannot
be made fails with the reason, and a third run started while two train trains too, one of the two
stopped and the other stepping on. GetRun and ListPolicies show each run's adapter version."""

from __future__ import annotations

import grpc
import pytest

from policyloop.bus import Bus
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.rl.lora import adapter_model_name
from policyloop.state import VersionRegistry
from tests.conftest import ServiceLauncher
from tests.helpers import addition_environment, eventually, publish_run_group


def lora_run(run_id: str, *modules: str) -> loop_pb2.StartRunRequest:
    return loop_pb2.StartRunRequest(
        run_id=run_id, environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)], num_tasks=2,
        lora=loop_pb2.LoraSpec(rank=4, target_modules=list(modules or ("q_proj", "v_proj"))))


@pytest.mark.timeout(300)
async def test_lora_runs_started_at_the_gateway_train_side_by_side(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    learner = services.start("learner", env={
        "POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_FULL_MODEL": "false", "POLICYLOOP_GROUPS_PER_STEP": "1",
        "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"})
    gateway = services.start("gateway")
    await services.wait_healthy(learner, gateway, timeout_s=90)
    versions = VersionRegistry(redis_client, "default")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=addition_environment(4)),
                                     timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stub.StartRun(loop_pb2.StartRunRequest(
                environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)]), timeout=10)
        assert full.value.code() == grpc.StatusCode.FAILED_PRECONDITION and full.value.details().startswith("lora:")

        for run_id in ("ra", "rb"):
            run = await stub.StartRun(lora_run(run_id), timeout=10)
            assert run.lora.rank == 4 and run.lora.alpha == 8.0
        ra, rb = adapter_model_name("policy", "ra"), adapter_model_name("policy", "rb")
        await publish_run_group(bus, "ra", "a0")
        await publish_run_group(bus, "rb", "b0")

        async def both_stepped() -> bool:
            return await versions.get(ra) == 1 and await versions.get(rb) == 1

        await eventually(both_stepped, timeout_s=120)  # each run added once the gateway started it

        # A third run starts while the two train, then one of the two is stopped.
        await stub.StartRun(lora_run("rd"), timeout=10)
        rd = adapter_model_name("policy", "rd")
        await publish_run_group(bus, "rd", "d0")
        await stub.StopRun(loop_pb2.StopRunRequest(run_id="rb"), timeout=10)
        bad = await stub.StartRun(lora_run("rc", "q_proj", "no_such_proj"), timeout=10)
        assert bad.state == loop_pb2.RUN_STATE_RUNNING  # the gateway cannot know the model's modules

        async def failed() -> bool:
            got = await stub.GetRun(loop_pb2.GetRunRequest(run_id="rc"), timeout=10)
            return got.state == loop_pb2.RUN_STATE_FAILED

        await eventually(failed, timeout_s=60)
        got = await stub.GetRun(loop_pb2.GetRunRequest(run_id="rc"), timeout=10)
        assert "target_modules" in got.error and "no_such_proj" in got.error

        for version, task in ((1, "a1"), (2, "a2")):
            await publish_run_group(bus, "ra", task, version)

            async def ra_on(version: int = version) -> bool:
                return await versions.get(ra) == version + 1

            await eventually(ra_on, timeout_s=120)  # the stopped and the failed run hold up nothing

        async def rd_trained() -> bool:
            return await versions.get(rd) == 1

        await eventually(rd_trained, timeout_s=120)
        assert await versions.get(rb) == 1
        # GetRun shows a LoRA run's own adapter version; ListPolicies lists every adapter.
        assert (await stub.GetRun(loop_pb2.GetRunRequest(run_id="ra"), timeout=10)).policy_version == 3
        policies = await stub.ListPolicies(loop_pb2.ListPoliciesRequest(), timeout=10)
        assert {(p.model, p.version) for p in policies.policies} >= {(ra, 3), (rb, 1), (rd, 1)}
