"""The gRPC services (gateway LoopService, publisher WeightService) as real processes, called
through real channels: health, reflection, validation errors, tokens, durability."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from policyloop.bus import Bus, build_topology
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc, weights_pb2, weights_pb2_grpc
from policyloop.envs.spec import DEFAULT_GROUP_SIZE
from policyloop.envs.tools import TOOLS_PROMPT_TOKEN
from policyloop.gateway.errors import InvalidField
from policyloop.gateway.model_context import load_model_context
from policyloop.gateway.validation import check_prompts_fit
from policyloop.models.tokenizer import VOCAB
from policyloop.weights import codec
from policyloop.weights.client import WeightClient
from policyloop.weights.push import VersionPusher
from tests.conftest import ServiceLauncher, fast_limits
from tests.helpers import addition_environment, eventually, perturbed, random_weights, stored, stored_messages


async def health_status(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def reflected_services(target: str) -> set[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def requests():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for reply in stub.ServerReflectionInfo(requests(), timeout=5):
            return {s.name for s in reply.list_services_response.service}
    return set()


@pytest.fixture
async def gateway(services: ServiceLauncher):  # type: ignore[no-untyped-def]
    # The launcher gives it the tiny model's directory (POLICYLOOP_MODEL_PATH) to check prompts against.
    process = services.start("gateway", env={"POLICYLOOP_BEARER_TOKEN": "s3cret",
                                             "POLICYLOOP_MAX_ENVIRONMENT_BYTES": str(MAX_ENVIRONMENT_BYTES)},
                             limits=fast_limits(tasks_capacity=20))
    await services.wait_healthy(process)
    target = f"127.0.0.1:{process.ports['grpc']}"
    async with grpc.aio.insecure_channel(target) as channel:
        yield process, target, loop_pb2_grpc.LoopServiceStub(channel)


AUTH = (("authorization", "Bearer s3cret"),)
MAX_ENVIRONMENT_BYTES = 16 << 20  # the gateway's bound here: room for one 6 MB prompt, not for three


async def test_gateway_health_reflection_and_token(gateway) -> None:  # type: ignore[no-untyped-def]
    _, target, stub = gateway
    assert await health_status(target) == health_pb2.HealthCheckResponse.SERVING
    assert {"policyloop.v1.LoopService", "grpc.health.v1.Health"} <= await reflected_services(target)
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await stub.ListPolicies(loop_pb2.ListPoliciesRequest(), timeout=5)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as wrong:
        await stub.ListPolicies(loop_pb2.ListPoliciesRequest(), timeout=5,
                                metadata=(("authorization", "Bearer nope"),))
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await stub.ListPolicies(loop_pb2.ListPoliciesRequest(), timeout=5, metadata=AUTH)).policies == []


# (how a valid environment is spoiled, the field the refusal must name)
INVALID_ENVIRONMENTS = [
    (lambda e: setattr(e, "name", ""), "environment.name"),
    (lambda e: setattr(e, "version", "v 1"), "environment.version"),
    (lambda e: e.ClearField("tasks"), "environment.tasks"),
    (lambda e: setattr(e.tasks[1], "prompt_text", ""), "environment.tasks[1].prompt_text"),
    (lambda e: setattr(e.tasks[2], "answer", ""), "environment.tasks[2].answer"),
    (lambda e: e.ClearField("builtin"), "environment.scorer"),
    (lambda e: setattr(e.sampling, "top_p", 1.5), "environment.sampling.top_p"),
    (lambda e: setattr(e.sampling, "top_k", -5), "environment.sampling.top_k"),
    (lambda e: setattr(e.builtin, "pattern", "(unclosed"), "environment.builtin.pattern"),
    (lambda e: (setattr(e, "max_turns", 3), e.tools.append("shell")), "environment.tools[0]"),
    (lambda e: e.tools.append("python"), "environment.max_turns"),
    (lambda e: setattr(e, "max_turns", 2), "environment.tools"),
    (lambda e: (setattr(e, "max_turns", 99), e.tools.append("python")), "environment.max_turns"),
    (lambda e: (setattr(e, "max_turns", 3), e.tools.append("python"), setattr(e.sampling, "ignore_eos", True)),
     "environment.sampling.ignore_eos"),
    (lambda e: e.unit_tests.CopyFrom(loop_pb2.UnitTestScorer(timeout_seconds=5)),
     "environment.tasks[0].metadata.tests"),
    (lambda e: e.unit_tests.CopyFrom(loop_pb2.UnitTestScorer(test_code="def test_a(): pass",
                                                             timeout_seconds=float("nan"))),
     "environment.unit_tests.timeout_seconds"),
    (lambda e: e.reward_code.CopyFrom(loop_pb2.RewardCodeScorer(source="def reward(p, c, m): return 1",
                                                          timeout_seconds=-3)),
     "environment.reward_code.timeout_seconds"),
    (lambda e: e.reward_model.CopyFrom(loop_pb2.RewardModelScorer()), "environment.reward_model.model"),
    (lambda e: e.reward_model.CopyFrom(loop_pb2.RewardModelScorer(model="rm", normalization=7)),  # type: ignore[arg-type]
     "environment.reward_model.normalization"),
    (lambda e: e.reward_model.CopyFrom(loop_pb2.RewardModelScorer(model="rm", scale=float("inf"))),
     "environment.reward_model.scale"),
    (lambda e: e.reward_model.CopyFrom(loop_pb2.RewardModelScorer(model="rm", timeout_seconds=-1)),
     "environment.reward_model.timeout_seconds"),
    (lambda e: e.judge.CopyFrom(loop_pb2.JudgeScorer(judge="j", template="Rate it.")), "environment.judge.template"),
    (lambda e: e.judge.CopyFrom(loop_pb2.JudgeScorer(judge="j", template="{response}",
                                                     verdict=loop_pb2.JudgeScorer.VERDICT_LABEL)),
     "environment.judge.labels"),
    # The eval split is checked as the tasks are.
    (lambda e: e.eval_tasks.add(prompt_text="", answer="3"), "environment.eval_tasks[0].prompt_text"),
    (lambda e: e.eval_tasks.add(prompt_text="1+2=", answer=""), "environment.eval_tasks[0].answer"),
    (lambda e: e.eval_tasks.add(prompt_token_ids=[-1], answer="3"), "environment.eval_tasks[0].prompt_token_ids"),
]


async def test_invalid_environment_is_invalid_argument_naming_the_field(gateway) -> None:  # type: ignore[no-untyped-def]
    """Every case against one gateway (a gateway per case cost two seconds each)."""
    _, _, stub = gateway
    for mutate, field in INVALID_ENVIRONMENTS:
        env = addition_environment(4)
        mutate(env)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert err.value.details().startswith(field + ":"), (field, err.value.details())


async def test_an_unset_group_size_is_the_default_and_the_answer_says_so(gateway) -> None:  # type: ignore[no-untyped-def]
    """proto3 cannot tell 0 from unset: 0 means the default, and SubmitEnvironment names the size."""
    _, _, stub = gateway
    for version, size, drawn in [("unset", 0, DEFAULT_GROUP_SIZE), ("three", 3, 3)]:
        env = addition_environment(4, group_size=size)
        env.version = version
        reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5,
                                             metadata=AUTH)
        assert reply.group_size == drawn
    env = addition_environment(4, group_size=5000)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5, metadata=AUTH)
    assert err.value.details() == f"environment.group_size: at most 1024 (0: the default, {DEFAULT_GROUP_SIZE}), " \
                                  f"got 5000"


async def refusal(stub: loop_pb2_grpc.LoopServiceStub, env: loop_pb2.Environment) -> str:
    """The details of SubmitEnvironment's INVALID_ARGUMENT for `env`."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=30, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def reward_code_environment(source: str, version: str = "demo") -> loop_pb2.Environment:
    env = addition_environment(4)
    env.version = version
    env.reward_code.CopyFrom(loop_pb2.RewardCodeScorer(source=source, timeout_seconds=3))
    return env


# (reward code, what the refusal must say): code the sandbox's harness can never call
UNRUNNABLE_REWARD_CODE = [
    ("def reward(prompt, completion, metadata):\n    return (len(completion)\n", "does not parse: "),
    ("import math\n\ndef reward(prompt, completion, metadata)\n    return math.pi\n", "(line 3)"),
    ("def score(prompt, completion, metadata):\n    return 1.0\n", "defines no top-level `reward`"),
    ("class Scorer:\n    def reward(self, prompt, completion, metadata):\n        return 1.0\n",
     "defines no top-level `reward`"),
    ("import math\n\nasync def reward(prompt, completion, metadata):\n    return 1.0\n", "line 3: `async def"),
    ("def reward(completion):\n    return 1.0\n", "line 1: `reward` cannot be called"),
    ("def reward(prompt, completion, metadata, *, scale):\n    return scale\n", "cannot be called"),
]
RUNNABLE_REWARD_CODE = [
    "def reward(prompt, completion, metadata):\n    return len(completion) / 10, 'length/10'\n",
    "def reward(*args):\n    return 1.0\n",
    "def reward(prompt, completion, metadata=None, scale=1.0):\n    return scale\n",
    "import math\nreward = lambda prompt, completion, metadata: math.pi\n",
    "try:\n    from math import isclose as reward\nexcept ImportError:\n    reward = None\n",
]


async def test_reward_code_that_can_never_run_is_refused_naming_the_field_and_line(gateway) -> None:  # type: ignore[no-untyped-def]
    _, _, stub = gateway
    for source, problem in UNRUNNABLE_REWARD_CODE:
        details = await refusal(stub, reward_code_environment(source))
        assert details.startswith("environment.reward_code.source:"), (source, details)
        assert problem in details, (source, details)
    assert "(line 2)" in await refusal(stub, reward_code_environment(UNRUNNABLE_REWARD_CODE[0][0]))
    for i, source in enumerate(RUNNABLE_REWARD_CODE):
        reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(
            environment=reward_code_environment(source, f"ok{i}")), timeout=10, metadata=AUTH)
        assert reply.created, source


async def test_prompts_that_cannot_fit_the_models_context_are_refused_naming_the_task(  # type: ignore[no-untyped-def]
        gateway, tiny_model_dir: Path) -> None:
    """The gateway's model (the tiny one) has a context of 256 positions; addition_environment asks
    for 8 new tokens, so a prompt may have 248 tokens, counted by the model's own tokenizer."""
    _, _, stub = gateway
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    room = context - addition_environment(1).sampling.max_new_tokens

    def spoiled(mutate: Callable[[loop_pb2.Environment], object]) -> loop_pb2.Environment:
        env = addition_environment(5)
        mutate(env)
        return env

    six_mb = await refusal(stub, spoiled(lambda e: setattr(e.tasks[3], "prompt_text", "7" * 6_000_000)))
    assert six_mb.startswith("environment.tasks[3].prompt_text:") and f"context of {context} tokens" in six_mb
    one_over = await refusal(stub, spoiled(lambda e: setattr(e.tasks[1], "prompt_text", "1" * (room + 1))))
    assert one_over.startswith("environment.tasks[1].prompt_text:") and f"{room + 1} tokens" in one_over
    ids_over = await refusal(stub, spoiled(lambda e: e.tasks[2].prompt_token_ids.extend([5] * (room + 1))))
    assert ids_over.startswith("environment.tasks[2].prompt_token_ids:") and f"{room + 1} tokens" in ids_over
    outside = await refusal(stub, spoiled(lambda e: e.tasks[4].prompt_token_ids.extend([5, len(VOCAB)])))
    assert outside.startswith("environment.tasks[4].prompt_token_ids:") and "vocabulary" in outside
    no_room = await refusal(stub, spoiled(lambda e: setattr(e.sampling, "max_new_tokens", context)))
    assert no_room.startswith("environment.sampling.max_new_tokens:")

    # What fits to the last token is accepted. `<tools>` is one token of seven characters: the
    # prompt is measured in tokens, not characters.
    def fitting(e: loop_pb2.Environment) -> None:
        e.version = "fits"
        e.tasks[1].prompt_text = "1" * room
        e.tasks[2].prompt_token_ids.extend([5] * room)
        e.tasks[3].prompt_text = TOOLS_PROMPT_TOKEN * room

    reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=spoiled(fitting)),
                                         timeout=30, metadata=AUTH)
    assert reply.created and reply.num_tasks == 5


async def test_an_upload_larger_than_the_bound_is_refused_before_it_is_held(gateway) -> None:  # type: ignore[no-untyped-def]
    _, _, stub = gateway
    big = loop_pb2.TaskSpec(prompt_text="7" * 6_000_000, answer="7")

    async def messages() -> AsyncIterator[loop_pb2.UploadEnvironmentRequest]:
        yield loop_pb2.UploadEnvironmentRequest(environment=addition_environment(1))
        for _ in range(3):  # 18 MB against a bound of 16 MiB
            yield loop_pb2.UploadEnvironmentRequest(tasks=[big])

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.UploadEnvironment(messages(), timeout=60, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"environment: larger than {MAX_ENVIRONMENT_BYTES} bytes"


def test_without_the_tokenizer_prompts_are_bounded_by_bytes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A model directory without tokenizer.json (or a gateway without `tokenizers`): a prompt counts
    at least one token per MAX_BYTES_PER_TOKEN bytes, which still refuses what is far too long."""
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    model = load_model_context(tmp_path)
    assert model.tokenizer is None and model.context_tokens == 256
    env = addition_environment(3)
    check_prompts_fit(env, model)
    env.tasks[2].prompt_text = "7" * 6_000_000
    with pytest.raises(InvalidField) as err:
        check_prompts_fit(env, model)
    assert err.value.field == "environment.tasks[2].prompt_text"
    with pytest.raises(ValueError, match="model_path: cannot read"):
        load_model_context(tmp_path / "missing")


async def test_runs_feed_tasks_with_backpressure_and_clear_errors(gateway, nats_server) -> None:  # type: ignore[no-untyped-def]
    _, _, stub = gateway
    # The gateway's own limits (TASKS holds 20); the shared fixture would reset them.
    bus = await Bus.connect(nats_server.url, name="test", topology=build_topology(fast_limits(tasks_capacity=20)))
    try:
        await _runs_feed_tasks(stub, bus)
    finally:
        await bus.close()


async def test_runs_are_fed_side_by_side(gateway, nats_server, redis_client) -> None:  # type: ignore[no-untyped-def]
    """A run whose feeding waits on a full TASKS (it holds 20) does not hold up another run's
    feeder: the second run's feeder runs (holds its lease) while the first is still waiting."""
    from policyloop.state import IdempotencyKeys

    _, _, stub = gateway
    bus = await Bus.connect(nats_server.url, name="test", topology=build_topology(fast_limits(tasks_capacity=20)))
    leases = IdempotencyKeys(redis_client, "default")
    try:
        env = addition_environment(5, group_size=2)
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5, metadata=AUTH)

        async def start(run_id: str) -> None:
            await stub.StartRun(loop_pb2.StartRunRequest(
                run_id=run_id, environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)],
                num_tasks=40), timeout=5, metadata=AUTH)

        await start("first")

        async def first_waits() -> bool:
            return len(await stored_messages(bus, "TASKS")) == 20 and await leases.owner("feeder:first") is not None

        await eventually(first_waits)
        await start("second")

        async def second_fed() -> bool:
            return await leases.owner("feeder:second") is not None

        await eventually(second_fed)
        assert await leases.owner("feeder:first") is not None  # still waiting for room: both feed at once
        for run_id in ("first", "second"):
            await stub.StopRun(loop_pb2.StopRunRequest(run_id=run_id), timeout=5, metadata=AUTH)
    finally:
        await bus.close()


async def _runs_feed_tasks(stub: loop_pb2_grpc.LoopServiceStub, bus: Bus) -> None:
    env = addition_environment(5, group_size=2)
    first = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5, metadata=AUTH)
    assert (first.environment, first.num_tasks, first.created) == ("addition@demo", 5, True)
    again = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=5, metadata=AUTH)
    assert not again.created  # the identical definition is accepted as is
    changed = addition_environment(6)
    with pytest.raises(grpc.aio.AioRpcError) as exists:
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=changed), timeout=5, metadata=AUTH)
    assert exists.value.code() == grpc.StatusCode.ALREADY_EXISTS

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.StartRun(loop_pb2.StartRunRequest(
            environments=[loop_pb2.EnvironmentMix(environment="nope@v1", weight=1)]), timeout=5, metadata=AUTH)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert missing.value.details().startswith("environments[0].environment:")
    with pytest.raises(grpc.aio.AioRpcError) as bad_weight:
        await stub.StartRun(loop_pb2.StartRunRequest(
            environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=0)]), timeout=5, metadata=AUTH)
    assert bad_weight.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_weight.value.details().startswith("environments[0].weight:")
    with pytest.raises(grpc.aio.AioRpcError) as bad_rank:
        await stub.StartRun(loop_pb2.StartRunRequest(
            environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)],
            lora=loop_pb2.LoraSpec(rank=4096)), timeout=5, metadata=AUTH)
    assert bad_rank.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_rank.value.details().startswith("lora.rank:")
    with pytest.raises(grpc.aio.AioRpcError) as unknown_run:
        await stub.GetRun(loop_pb2.GetRunRequest(run_id="ghost"), timeout=5, metadata=AUTH)
    assert unknown_run.value.code() == grpc.StatusCode.NOT_FOUND

    # 30 tasks into a TASKS stream that holds 20: the feeder waits, it never drops.
    run = await stub.StartRun(loop_pb2.StartRunRequest(
        run_id="run1", environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)],
        num_tasks=30, seed=3), timeout=5, metadata=AUTH)
    assert (run.run_id, run.state, run.tasks_total) == ("run1", loop_pb2.RUN_STATE_RUNNING, 30)
    with pytest.raises(grpc.aio.AioRpcError) as duplicate:
        await stub.StartRun(loop_pb2.StartRunRequest(
            run_id="run1", environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)]),
            timeout=5, metadata=AUTH)
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS

    async def full() -> bool:
        return len(await stored_messages(bus, "TASKS")) == 20

    await eventually(full)
    state = await stub.GetRun(loop_pb2.GetRunRequest(run_id="run1"), timeout=5, metadata=AUTH)
    assert state.tasks_enqueued == 20
    # Drain ten: the feeder resumes and enqueues exactly the rest.
    sub = await bus.js.pull_subscribe_bind(durable="rollout", stream="TASKS")
    taken = []
    while len(taken) < 10:
        for msg in await sub.fetch(10 - len(taken), timeout=5):
            await msg.ack_sync()
            taken.append(msg)

    async def rest_enqueued() -> bool:
        return (await stub.GetRun(loop_pb2.GetRunRequest(run_id="run1"), timeout=5, metadata=AUTH)).tasks_enqueued == 30

    await eventually(rest_enqueued)
    tasks = [bus_pb2.Task.FromString(m.data) for m in taken] + await stored(bus, "TASKS", bus_pb2.Task)
    assert sorted(t.task_id for t in tasks) == [f"run1:{i:09d}" for i in range(30)]
    assert all(t.group_size == 2 and t.scorer.answer and t.scorer.HasField("builtin") and t.prompt_text for t in tasks)

    watch = stub.WatchRun(loop_pb2.WatchRunRequest(run_id="run1"), timeout=10, metadata=AUTH)
    first_update = await watch.read()
    assert first_update.run_id == "run1" and first_update.state == loop_pb2.RUN_STATE_RUNNING
    stopped = await stub.StopRun(loop_pb2.StopRunRequest(run_id="run1"), timeout=5, metadata=AUTH)
    assert stopped.state == loop_pb2.RUN_STATE_STOPPED
    updates = []
    while (update := await watch.read()) != grpc.aio.EOF:
        updates.append(update)
    assert updates[-1].state == loop_pb2.RUN_STATE_STOPPED  # the stream ends with the run


PUBLISHER_ENV = {"POLICYLOOP_RETENTION_VERSIONS": "2", "POLICYLOOP_SNAPSHOT_EVERY": "2"}


@pytest.fixture
async def publisher(services: ServiceLauncher):  # type: ignore[no-untyped-def]
    process = services.start("publisher", env=PUBLISHER_ENV)
    await services.wait_healthy(process)
    client = WeightClient(f"127.0.0.1:{process.ports['grpc']}", deadline_s=10)
    yield process, client
    await client.close()


async def test_publisher_stores_serves_and_announces_versions(publisher, bus: Bus, services: ServiceLauncher) -> None:  # type: ignore[no-untyped-def]
    process, client = publisher
    target = f"127.0.0.1:{process.ports['grpc']}"
    assert await health_status(target) == health_pb2.HealthCheckResponse.SERVING
    assert "policyloop.v1.WeightService" in await reflected_services(target)
    pusher = VersionPusher(client, "policy")
    shapes = {"embed": (1024, 768), "norm": (768,)}  # a keyframe of several 1 MiB chunks
    versions = {1: random_weights(1, shapes=shapes)}
    for v in (2, 3, 4):
        versions[v] = perturbed(versions[v - 1], v, seed=v)
    kinds = [(await pusher.push(w, step=v)).kind for v, w in versions.items()]
    assert kinds == ["keyframe", "delta", "delta", "delta"]
    fetched = await client.fetch("policy")
    assert fetched.header.version == 4 and fetched.header.kind == weights_pb2.PAYLOAD_KIND_KEYFRAME
    assert fetched.header.manifest_hash == versions[4].manifest_hash
    assert codec.apply(None, fetched.payload).manifest_hash == versions[4].manifest_hash
    delta = await client.fetch("policy", have_version=3, want_version=4)
    assert delta.header.kind == weights_pb2.PAYLOAD_KIND_DELTA and delta.header.base_version == 3
    assert codec.apply(versions[3].copy(), delta.payload).manifest_hash == versions[4].manifest_hash
    # Retention 2, snapshots every 2 deltas (v3, written in the background): versions 1 and 2 go
    # once it is written.
    async def only_the_newest_two() -> bool:
        return [v.version for v in await client.list_versions("policy")] == [3, 4]

    await eventually(only_the_newest_two, what="versions 1 and 2 pruned after v3's snapshot")
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.fetch("policy", want_version=1)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    events = await stored(bus, "WEIGHTS", bus_pb2.WeightsPublished)
    assert [e.version for e in events] == [1, 2, 3, 4]
    assert events[-1].manifest_hash == versions[4].manifest_hash and list(events[-1].base_versions) == [3]
    assert events[-1].bytes_raw == versions[4].raw_bytes and 0 < events[-1].bytes_delta < events[-1].bytes_raw
    assert events[-1].fetch_endpoint.endswith(str(process.ports["grpc"]))

    # A restarted publisher rebuilds what is on disk, serves it and announces it again (stored once).
    assert process.terminate() == 0
    again = services.start("publisher", env=PUBLISHER_ENV | {"POLICYLOOP_GRPC_PORT": str(process.ports["grpc"])})
    await services.wait_healthy(again)
    assert codec.apply(None, (await client.fetch("policy")).payload).manifest_hash == versions[4].manifest_hash
    assert [e.version for e in await stored(bus, "WEIGHTS", bus_pb2.WeightsPublished)] == [1, 2, 3, 4]
    versions[5] = perturbed(versions[4], 5, seed=5)
    assert (await pusher.push(versions[5], step=5)).kind == "delta"


async def test_publisher_rejects_bad_pushes_and_keeps_what_it_has(publisher) -> None:  # type: ignore[no-untyped-def]
    process, client = publisher
    good = random_weights(5)
    await VersionPusher(client, "policy").push(good, step=5)
    stub = weights_pb2_grpc.WeightServiceStub(client.channel)

    async def push(header: weights_pb2.PushHeader, *chunks: bytes) -> grpc.aio.AioRpcError:
        async def stream():  # type: ignore[no-untyped-def]
            yield weights_pb2.PushChunk(header=header)
            for chunk in chunks:
                yield weights_pb2.PushChunk(data=chunk)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Push(stream(), timeout=10)
        return err.value

    data = codec.encode(perturbed(good, 6), good).payload
    digest = xxhash.xxh3_128_hexdigest(data)
    header = dict(model="policy", version=6, codec=codec.CODEC, total_bytes=len(data), payload_xxh3_128=digest)
    corrupted = await push(weights_pb2.PushHeader(**header), data[:-1] + bytes([data[-1] ^ 1]))
    assert corrupted.code() == grpc.StatusCode.INVALID_ARGUMENT and "xxh3-128" in corrupted.details()
    truncated = await push(weights_pb2.PushHeader(**header), data[:500])
    assert truncated.code() == grpc.StatusCode.INVALID_ARGUMENT and "500 bytes" in truncated.details()
    stale = await push(weights_pb2.PushHeader(**(header | {"version": 5})), data)
    assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION and stale.details().startswith("header.version:")
    bad_model = await push(weights_pb2.PushHeader(**(header | {"model": "../etc"})), data)
    assert bad_model.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_model.details().startswith("header.model:")
    before_time = await push(weights_pb2.PushHeader(**(header | {"trained_unix_ms": -1})), data)
    assert before_time.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert before_time.details().startswith("header.trained_unix_ms:")
    bad_hash = await push(weights_pb2.PushHeader(**(header | {"payload_xxh3_128": "xyz"})), data)
    assert bad_hash.details().startswith("header.payload_xxh3_128:")
    other_version = await push(weights_pb2.PushHeader(**(header | {"version": 7})), data)
    assert other_version.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.version says 7" in other_version.details()
    # None of it replaced or added a version; no temporary file is left behind.
    assert [v.version for v in await client.list_versions()] == [5]
    assert (await client.fetch("policy")).header.manifest_hash == good.manifest_hash
    weights_dir = process.log_path.parent / "weights" / "policy"
    assert sorted(p.name for p in weights_dir.iterdir()) == ["000000000005.bin", "000000000005.json"]
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await client.fetch("other")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_rollout_replicas_hear_of_published_versions(publisher, services: ServiceLauncher) -> None:  # type: ignore[no-untyped-def]
    from policyloop.state import HeartbeatRegistry, connect_redis

    _, client = publisher
    pusher = VersionPusher(client, "policy")
    await pusher.push(random_weights(1), step=1)
    rollout = services.start("rollout")  # joins late: reads the last announcement
    await services.wait_healthy(rollout)
    await pusher.push(random_weights(2, seed=2), step=2)
    redis_client = await connect_redis(services.redis.url)
    try:
        async def heard() -> bool:
            beats = await HeartbeatRegistry(redis_client, "default").alive("rollout")
            return bool(beats) and beats[0].rollout.announced_version == 2

        await eventually(heard)
    finally:
        await redis_client.aclose()
    heard = [e["version"] for e in rollout.log_events() if e["event"] == "weights_announced"]
    assert heard[-1] == 2 and heard == sorted(heard)


async def test_a_large_environment_is_uploaded_as_a_stream(gateway) -> None:  # type: ignore[no-untyped-def]
    """UploadEnvironment: the environment, then its tasks in chunks; the result is the very
    environment SubmitEnvironment would have stored. Malformed streams are INVALID_ARGUMENT
    naming the field (a bad task by its index in the whole environment)."""
    from policyloop.cluster.client import upload_messages

    _, _, stub = gateway
    env = addition_environment(5000)
    env.eval_tasks.extend(addition_environment(1500).tasks)  # the eval split comes after the tasks
    messages = list(upload_messages(env, 16 * 1024))  # 6500 small tasks: about 100 kB
    assert len(messages) > 3 and all(m.ByteSize() <= 16 * 1024 + 100 for m in messages)
    assert any(m.tasks and m.eval_tasks for m in messages) is False
    reply = await stub.UploadEnvironment(iter(messages), timeout=30, metadata=AUTH)
    assert (reply.environment, reply.num_tasks, reply.created) == ("addition@demo", 5000, True)
    inline = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=30,
                                          metadata=AUTH)
    assert inline.created is False  # the identical definition, tasks and eval tasks in the same order

    bad_task = loop_pb2.Environment()
    bad_task.CopyFrom(env)
    bad_task.version = "other"
    bad_task.tasks[2345].prompt_text = ""
    header = loop_pb2.UploadEnvironmentRequest(environment=addition_environment(0))
    cases = [
        (upload_messages(bad_task, 16 * 1024), "environment.tasks[2345].prompt_text"),
        ([loop_pb2.UploadEnvironmentRequest(tasks=env.tasks[:3])], "environment"),
        ([header, header], "messages[1].environment"),
        ([], "environment"),
    ]
    for messages, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UploadEnvironment(iter(messages), timeout=30, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert err.value.details().startswith(field + ":"), (field, err.value.details())
