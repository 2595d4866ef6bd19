"""Small helpers shared by the tests: reading streams back, waiting for conditions."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TypeVar

from aiohttp import web
from google.protobuf.message import Message

from policyloop.bus import Bus
from policyloop.common.ports import free_port
from policyloop.contracts.v1 import bus_pb2, loop_pb2

M = TypeVar("M", bound=Message)


async def stored_messages(bus: Bus, stream: str) -> list[tuple[str, bytes, dict]]:
    """Every message currently stored in `stream`, as (subject, payload, headers)."""
    return [(msg.subject or "", msg.data or b"", dict(msg.headers or {})) async for _, msg in bus.stored(stream)]


async def stored(bus: Bus, stream: str, message_type: type[M]) -> list[M]:
    decoded = []
    for _, data, _ in await stored_messages(bus, stream):
        message = message_type()
        message.ParseFromString(data)
        decoded.append(message)
    return decoded


async def stored_samples(bus: Bus, stream: str) -> list[bus_pb2.Trajectory]:
    """The trajectories in the group messages of ROLLOUTS or TRAJECTORIES, in stream order."""
    return [t for group in await stored(bus, stream, bus_pb2.TrajectoryGroup) for t in group.trajectories]


def as_group(*trajectories: bus_pb2.Trajectory) -> bus_pb2.TrajectoryGroup:
    """Members of one group as a message (all of it, as rollout and reward send it, or a part)."""
    return bus_pb2.TrajectoryGroup(group_id=trajectories[0].group_id, trajectories=trajectories)


async def publish_group(bus: Bus, subject: str, *trajectories: bus_pb2.Trajectory, msg_id: str = "") -> int:
    """Publishes members of one group as one message (msg id: the group id unless given);
    returns its stream sequence."""
    group = as_group(*trajectories)
    return int((await bus.publish(subject, group, msg_id or group.group_id)).seq)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0,
                     interval_s: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def until(check: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """`eventually` for a condition that needs no awaiting (state of this process)."""

    async def checked() -> bool:
        return check()

    await eventually(checked, timeout_s=timeout_s, interval_s=0.005, what=what)


def scored_group(task: str, size: int = 2, response_len: int = 2, version: int = 0, *, environment: str = "e",
                 prompt: list[int] | None = None) -> list[bus_pb2.Trajectory]:
    """A scored group as reward stores it: sample i answers `response_len` tokens ending in EOS,
    reward i % 2, every token from `version`."""
    return [bus_pb2.Trajectory(
        trajectory_id=f"{task}/{i}", task_id=task, group_id=task, sample_index=i, group_size=size, run_id="r",
        environment=environment, prompt_token_ids=prompt or [5, 14, 6, 16],
        response_token_ids=[7 + (i % 5)] * (response_len - 1) + [1], behaviour_logprobs=[-2.0] * response_len,
        loss_mask=[True] * response_len, scored=True, reward=float(i % 2), finish_reason=bus_pb2.FINISH_REASON_STOP,
        version_spans=[bus_pb2.VersionSpan(version=version, start=0, end=response_len)],
    ) for i in range(size)]


async def publish_run_group(bus: Bus, run_id: str, task: str, version: int = 0) -> None:
    """A scored group of `run_id` on TRAJECTORIES, sampled by its policy's `version`."""
    from policyloop.bus import trajectories_subject

    group = scored_group(task, size=2, version=version)
    for traj in group:
        traj.run_id = run_id
    await publish_group(bus, trajectories_subject("e"), *group)


def addition_environment(count: int, seed: int = 0, group_size: int = 4) -> loop_pb2.Environment:
    """A small inline environment for gateway tests (the real one is policyloop.envs.arithmetic)."""
    import random

    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        tasks.append(loop_pb2.TaskSpec(prompt_text=f"{a}+{b}=", answer=str(a + b)))
    return loop_pb2.Environment(
        name="addition", version="demo", tasks=tasks,
        builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER, pattern=r"-?[0-9]+"),
        group_size=group_size,
        sampling=bus_pb2.SamplingParams(max_new_tokens=8, temperature=1.0),
    )


def random_weights(version: int, seed: int = 0, *, shapes: dict[str, tuple[int, ...]] | None = None,
                   dtype: str = "BF16"):  # type: ignore[no-untyped-def]
    """A WeightSet of random tensors (numpy only: no torch needed)."""
    import numpy as np

    from policyloop.weights.codec import ITEMSIZE, TensorBytes, WeightSet

    rng = np.random.default_rng(seed)
    shapes = shapes or {"embed": (300, 64), "layer.0.w": (64, 64), "layer.0.b": (64,), "norm": (64,)}
    tensors = {}
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        tensors[name] = TensorBytes(dtype, shape, rng.integers(0, 256, size, dtype=np.uint8))
    return WeightSet.build(version, tensors)


def perturbed(weights, version: int, fraction: float = 0.02, seed: int = 1):  # type: ignore[no-untyped-def]
    """A copy of `weights` as `version` with about `fraction` of each tensor's bytes changed."""
    import numpy as np

    from policyloop.weights.codec import WeightSet

    rng = np.random.default_rng(seed)
    changed = weights.copy()
    for tensor in changed.tensors.values():
        hits = rng.random(tensor.data.size) < fraction
        tensor.data[hits] ^= rng.integers(1, 256, int(hits.sum()), dtype=np.uint8)
    return WeightSet.build(version, changed.tensors)


def cgroups_available() -> bool:
    """Whether this process can give sandbox jobs cgroups of their own (root on a cgroup v1 host)."""
    from policyloop.sandbox.cgroups import job_cgroups

    cgroups = job_cgroups("auto")
    if cgroups is None:
        return False
    cgroups.remove_parents()
    return True


def settings_model(entry):  # type: ignore[no-untyped-def]
    """The one ServiceSettings subclass a catalogue entry's service module serves (defined there or
    imported from its role package)."""
    import importlib
    import inspect

    from policyloop.runtime.settings import ServiceSettings

    module = importlib.import_module(entry.module + ".service")
    models = [obj for obj in vars(module).values()
              if inspect.isclass(obj) and issubclass(obj, ServiceSettings) and obj is not ServiceSettings]
    assert len(models) == 1, f"{module.__name__} must serve exactly one settings model"
    return models[0]


def setting_field(model, variable: str):  # type: ignore[no-untyped-def]
    """The pydantic field a POLICYLOOP_* variable sets in `model` (nested with `__`), or None
    when it sets none."""
    import inspect

    path = variable.removeprefix("POLICYLOOP_").lower().split("__")
    fields = model.model_fields
    for depth, part in enumerate(path):
        if part not in fields:
            return None
        if depth == len(path) - 1:
            return fields[part]
        annotation = fields[part].annotation
        if not (inspect.isclass(annotation) and hasattr(annotation, "model_fields")):
            return None
        fields = annotation.model_fields
    return None


def make_lora_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 4,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A peft LoRA adapter of the model in `model_dir`, saved to `out_dir` (adapter_config.json and
    adapter_model.safetensors), with random A and B so that it changes what the model samples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(target_modules), init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(50.0)  # strong enough to move greedy choices of a tiny random model
    model.save_pretrained(out_dir)
    return out_dir


def greedy_ids(model, prompt: list[int], steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding without a cache: the reference a served model's greedy answer must equal."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@asynccontextmanager
async def serving_http(app: web.Application, port: int = 0) -> AsyncIterator[str]:
    """An aiohttp application on a loopback port (0: a free one), for as long as the block runs: its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def openai_endpoint(model_dir: Path, bus: Bus, served_model: str, *, weight_version: str = "0",
                          max_batch: int = 8, port: int = 0) -> AsyncIterator[tuple[str, object, object]]:
    """The serving endpoint over an embedded engine on `model_dir`, for as long as the block runs:
    its base URL, the engine's client (an SGLangClient) and the tokenizer as the replica loads it."""
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.models.tokenizer import load_tokenizer
    from policyloop.serving.openai_api import OpenAIApi

    running = await start_engine(model_dir, max_batch=max_batch, threads=1, weight_version=weight_version)
    engine = SGLangClient(running.base_url, timeout_s=120, retries=0)
    tokenizer = load_tokenizer(model_dir)
    try:
        async with serving_http(OpenAIApi(engine, tokenizer, bus, served_model).app(), port) as url:
            yield url, engine, tokenizer
    finally:
        await engine.close()
        await running.stop()



def checked_tool_turns(traj: bus_pb2.Trajectory, decode: Callable[[list[int]], str]) -> int:
    """Checks a chat-templated episode's turns: the model's tokens trained on, each tool result an
    observation the loss never sees (the template's <tool_response> user turn and the next
    assistant header, exactly as the turn's text), each one after a model turn that called a tool.
    Returns how many tool results it has."""
    from policyloop.models.chat_format import parse_assistant

    observed = bus_pb2.Turn.ROLE_ENVIRONMENT
    for turn in traj.turns:
        if turn.role == observed:
            assert not any(traj.loss_mask[turn.start:turn.end])
            text = decode(list(traj.response_token_ids[turn.start:turn.end]))
            assert text == turn.text and "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
        else:
            assert all(traj.loss_mask[turn.start:turn.end])
    before = [b for b, t in zip(traj.turns, traj.turns[1:], strict=False) if t.role == observed]
    assert all(parse_assistant(t.text).tool_calls for t in before)
    return sum(t.role == observed for t in traj.turns)


async def the_one_dead_letter(bus: Bus, task_id: str, timeout_s: float) -> bus_pb2.DeadLetter:
    """The DLQ's one letter, once it is there, after checking that nothing of task `task_id` was
    stored as a rollout (a failed task is never trained)."""
    async def dead_lettered() -> bool:
        return len(await stored(bus, "DLQ", bus_pb2.DeadLetter)) == 1

    await eventually(dead_lettered, timeout_s=timeout_s, what=f"task {task_id} dead-lettered")
    assert all(t.task_id != task_id for t in await stored_samples(bus, "ROLLOUTS"))
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    return letter


@contextmanager
def openenv_server(directory: Path, app: str, log_dir: Path) -> Iterator[str]:
    """An OpenEnv environment's ASGI `app` ("module:attribute" in `directory`) served by uvicorn
    on a free loopback port, as its authors serve one: its URL, once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_dir / f"openenv-{port}.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=directory, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the OpenEnv server {app} did not come up (exit {server.poll()})") from None
                time.sleep(0.2)
        yield url
    finally:
        server.kill()
        server.wait(timeout=10)


async def trained_once(bus: Bus, redis_client, run_id: str, *, steps: int, samples: int,  # type: ignore[no-untyped-def]
                       timeout_s: float) -> None:
    """Waits for `steps` learner steps, then checks by the ledger that run `run_id`'s `samples`
    were each generated and trained once, none lost."""
    from policyloop.ledger import audit_bus
    from policyloop.state import VersionRegistry

    versions = VersionRegistry(redis_client, "default")

    async def trained() -> bool:
        return (await versions.get("policy") or 0) >= steps

    await eventually(trained, timeout_s=timeout_s, what=f"{steps} learner steps of run {run_id}")
    audited = await audit_bus(bus, run_id)
    assert (audited.generated, audited.trained, audited.lost, audited.trained_twice) == (samples, samples, 0, 0)


async def submit_and_start(gateway_port: int, name: str, submit_args: list[str], *, tasks: int, group_size: int,
                           run_id: str, num_tasks: int) -> None:
    """`policyloop env submit --name NAME SUBMIT_ARGS` against the gateway, as a user runs it (its
    answer checked: `tasks` tasks of `group_size`, a new version), then a run of `num_tasks`
    groups on the environment through LoopService."""
    import json

    import grpc

    from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc

    gateway = f"127.0.0.1:{gateway_port}"
    submitted = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "policyloop", "env", "submit", "--name", name, *submit_args,
        "--group-size", str(group_size), "--gateway", gateway], capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert json.loads(submitted.stdout) == {"environment": f"{name}@v1", "tasks": tasks, "group_size": group_size,
                                            "created": True}
    async with grpc.aio.insecure_channel(gateway) as channel:
        await loop_pb2_grpc.LoopServiceStub(channel).StartRun(loop_pb2.StartRunRequest(
            run_id=run_id, num_tasks=num_tasks, environments=[loop_pb2.EnvironmentMix(environment=f"{name}@v1",
                                                                                      weight=1)]))


@asynccontextmanager
async def tinker_sampling_replica(bus: Bus, engine_url: str, drain_s: float = 5.0) -> AsyncIterator[object]:
    """What a rollout replica with tinker_sampling runs, in this process: TINKER_SAMPLES sampled on
    the engine at `engine_url`, adapters fetched from the publisher each session names. Yields the
    TinkerSampling (its `done` counts the requests answered with samples)."""
    from policyloop.engines.sglang_client import SGLangClient
    from policyloop.tinker.sampling import EngineSampler, TinkerSampling
    from policyloop.weights.client import WeightClient

    engine = SGLangClient(engine_url, timeout_s=120, retries=0)
    fetchers: dict[str, WeightClient] = {}
    sampling = TinkerSampling(bus, EngineSampler(engine, lambda e: fetchers.setdefault(e, WeightClient(e))),
                              concurrency=8)
    worker = sampling.pull_worker()
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        yield sampling
    finally:
        stop.set()
        await running
        await worker.drain(drain_s)
        await engine.close()
        await asyncio.gather(*(f.close() for f in fetchers.values()))


def torchrun_args(command: list[str]) -> argparse.Namespace:
    """A `python -m torch.distributed.run ...` command as torchrun itself parses it (its
    arguments' Namespace): a command it would refuse fails here."""
    from torch.distributed.run import get_args_parser

    assert command[:3] == ["python", "-m", "torch.distributed.run"], command
    return get_args_parser().parse_args(command[3:])


def torchrun_rank_order(addresses: list[str]) -> list[str]:
    """The order in which torchrun's c10d rendezvous ranks the nodes that name these addresses
    (--local-addr): it sorts its node descriptors, whose first field is that address (the process
    ids after it are given here in the opposite order, so only the addresses decide)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    nodes = [_NodeDesc(address, len(addresses) - i, 0) for i, address in enumerate(addresses)]
    return [node.addr for node in sorted(nodes)]
