"""The Tinker API driven by the official `tinker` SDK (pinned 0.38.0) against a real HTTP front,
NATS JetStream and Redis, with the learner's side (TinkerWorker over an AdapterTrainer on the
tiny model) applying the requests: a supervised loop lowers the loss; bad requests are refused
with a clear message; a learner that restarts between forward_backward and optim_step loses
nothing and applies nothing twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from policyloop.bus import Bus
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.rl.lora import AdapterTrainer, adapter_model_name
from policyloop.rl.trainer import TrainerConfig
from policyloop.state import connect_redis
from policyloop.tinker.sampling import TinkerSampling
from policyloop.tinker.server import TinkerApi
from policyloop.tinker.trainer import TinkerTrainer
from policyloop.tinker.worker import TinkerWorker
from policyloop.weights.client import WeightClient
from policyloop.weights.library import WeightLibrary
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from tests.helpers import serving_http, tinker_sampling_replica

tinker = pytest.importorskip("tinker")

BASE_MODEL = "policyloop/tiny"
API_KEY = "tml-cluster-test-key"
SEQUENCES = [[4, 5, 14, 6, 16, 7, 8], [9, 10, 11, 12, 13, 15, 17], [5, 5, 6, 6, 7, 7, 8, 8]]


@dataclass
class Learner:
    worker: TinkerWorker
    task: asyncio.Task[None]
    stop: asyncio.Event

    async def close(self) -> None:
        self.stop.set()
        await self.task


def start_learner(bus: Bus, model_dir: Path, root: Path, publisher: WeightClient | None = None,
                  endpoint: str = "") -> Learner:
    trainer = TinkerTrainer(AdapterTrainer(model_dir, TrainerConfig(device="cpu")), root, BASE_MODEL)
    worker = TinkerWorker(bus, trainer, publisher=publisher, fetch_endpoint=endpoint)
    stop = asyncio.Event()
    return Learner(worker, asyncio.create_task(worker.run(stop)), stop)


@dataclass
class Publisher:
    client: WeightClient
    endpoint: str


@pytest.fixture
async def publisher(tmp_path: Path) -> AsyncIterator[Publisher]:
    async def announce(_: object) -> None:
        pass

    servicer = WeightServicer(WeightLibrary(VersionStore(tmp_path / "store", retention=4), snapshot_every=4),
                              on_stored=announce)
    server, port = await start_weight_server(servicer, host="127.0.0.1", port=0)
    client = WeightClient(f"127.0.0.1:{port}", deadline_s=60)
    yield Publisher(client, f"127.0.0.1:{port}")
    await client.close()
    await server.stop(None)


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="0")
    yield running
    await running.stop()


@pytest.fixture
async def front(bus: Bus, redis_server, engine: EmbeddedEngine) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
    """The front, and a rollout replica's sampling for it on the engine."""
    redis = await connect_redis(redis_server.url, decode_responses=False)
    api = TinkerApi(bus, redis, namespace="test", base_model=BASE_MODEL, api_key=API_KEY, poll_s=5.0)
    async with tinker_sampling_replica(bus, engine.base_url), serving_http(api.app()) as url:
        yield url
    await redis.aclose()


def datum(tokens: list[int]):  # type: ignore[no-untyped-def]
    """Next-token prediction over the whole sequence."""
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                              "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def service_client(base_url: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TINKER_BASE_URL", base_url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    return tinker.ServiceClient()


@pytest.mark.timeout(300)
async def test_a_supervised_loop_written_with_the_sdk_lowers_the_loss(
        bus: Bus, front: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = start_learner(bus, tiny_model_dir, tmp_path / "learner")

    def train() -> tuple[list[float], object, int]:
        client = service_client(front, monkeypatch)
        capabilities = client.get_server_capabilities()
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        data = [datum(s) for s in SEQUENCES]
        losses = []
        for _ in range(12):
            result = training.forward_backward(data, "cross_entropy").result()
            losses.append(result.metrics["loss:sum"])
            training.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        forward = training.forward(data, "cross_entropy").result()
        return losses, (capabilities, forward, training.get_info()), len(data)

    try:
        losses, (capabilities, forward, info), count = await asyncio.to_thread(train)
    finally:
        await learner.close()
    assert [m.model_name for m in capabilities.supported_models] == [BASE_MODEL]
    assert info.model_data.model_name == BASE_MODEL and info.lora_rank == 8
    assert losses[-1] < 0.5 * losses[0], losses
    # forward: per-datum logprobs of the targets, and the loss they make (nothing applied).
    assert len(forward.loss_fn_outputs) == count
    logprobs = [np.asarray(out["logprobs"].tolist()) for out in forward.loss_fn_outputs]
    assert [len(lp) for lp in logprobs] == [len(s) - 1 for s in SEQUENCES]
    assert forward.metrics["loss:sum"] == pytest.approx(-sum(lp.sum() for lp in logprobs), rel=1e-4)
    assert forward.metrics["loss:sum"] < 0.5 * losses[0]  # what the steps learned is what forward computes


@pytest.mark.timeout(300)
async def test_a_learner_restart_between_forward_backward_and_optim_step_loses_nothing_and_applies_nothing_twice(
        bus: Bus, front: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models made alike (same seed, data and step): `steady` takes its optim_step before the
    learner stops, `restarted` after a new learner took over. They must end equal, bit for bit."""
    root = tmp_path / "learner"
    learner = start_learner(bus, tiny_model_dir, root)
    client = await asyncio.to_thread(service_client, front, monkeypatch)
    data = [datum(s) for s in SEQUENCES]
    adam = tinker.types.AdamParams(learning_rate=1e-2)

    def before() -> tuple[object, object, float]:
        restarted = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
        steady = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=7).result()
        loss = restarted.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        steady.forward_backward(data, "cross_entropy").result()
        steady.optim_step(adam).result()
        return restarted, steady, loss

    restarted, steady, loss_before = await asyncio.to_thread(before)
    await learner.close()  # restarted's gradients were in this learner's memory only
    learner = start_learner(bus, tiny_model_dir, root)
    try:
        done = await asyncio.to_thread(lambda: restarted.optim_step(adam).result())
        assert done.metrics["forward_backward_calls:sum"] == 1  # its forward_backward, recomputed once
        ids = [c.model_id for c in (restarted, steady)]
        trainer = learner.worker.trainer.trainer
        assert [trainer.run(i).steps for i in ids] == [1, 1]
        adapters = [trainer.export_adapter(i) for i in ids]
        assert adapters[0].keys() == adapters[1].keys()
        assert all(np.array_equal(adapters[0][k].numpy(), adapters[1][k].numpy()) for k in adapters[0])
        # The step was applied to the weights the new learner serves.
        again = await asyncio.to_thread(lambda: restarted.forward(data, "cross_entropy").result())
        assert again.metrics["loss:sum"] < loss_before
    finally:
        await learner.close()
    # A third learner restores both from their checkpoints: one step each, nothing applied again.
    learner = start_learner(bus, tiny_model_dir, root)
    try:
        await asyncio.to_thread(lambda: restarted.forward(data, "cross_entropy").result())
        assert [learner.worker.trainer.trainer.run(i).steps for i in ids] == [1, 1]
    finally:
        await learner.close()


@pytest.mark.timeout(300)
async def test_requests_that_cannot_be_done_are_refused_with_a_clear_message(
        bus: Bus, front: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from policyloop.bus.topology import dlq_subject, tinker_request_subject
    from policyloop.contracts.v1 import bus_pb2

    learner = start_learner(bus, tiny_model_dir, tmp_path / "learner")

    def misuse() -> list[str]:
        client = service_client(front, monkeypatch)
        with pytest.raises(tinker.BadRequestError, match="base_model: this cluster trains"):
            client.create_lora_training_client(base_model="someone/else", rank=4).result()
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        refusals = []
        for loss, data in (("stable_reinforce", [datum(SEQUENCES[0])]), ("no_such_loss", [datum(SEQUENCES[0])]),
                           ("importance_sampling", [datum(SEQUENCES[0])])):
            with pytest.raises(tinker.RequestFailedError) as refused:
                training.forward_backward(data, loss).result()
            refusals.append(str(refused.value))
        wrong = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2, 3]),
                                   loss_fn_inputs={"target_tokens": np.array([1, 2], dtype=np.int64),
                                                   "weights": np.ones(2, dtype=np.float32)})
        with pytest.raises(tinker.RequestFailedError) as refused:
            training.forward_backward([wrong], "cross_entropy").result()
        refusals.append(str(refused.value))
        with pytest.raises(tinker.NotFoundError, match="not served by this cluster's Tinker API"):
            client.create_rest_client().publish_checkpoint_from_tinker_path(
                f"tinker://{training.model_id}/weights/w").result()
        monkeypatch.setenv("TINKER_API_KEY", "tml-not-the-key")
        with pytest.raises(tinker.AuthenticationError, match="X-API-Key is not this cluster's API key"):
            tinker.ServiceClient().create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        return refusals

    try:
        refusals = await asyncio.to_thread(misuse)
        # A message on TINKER that is no TinkerRequest goes to the DLQ with the reason; the learner goes on.
        ack = await bus.publish_bytes(tinker_request_subject("m"), b"\xff\x00 not protobuf",
                                      {"Nats-Msg-Id": "garbage-1"})
        await learner.worker.reached(ack.seq, timeout_s=30)
        letter = bus_pb2.DeadLetter.FromString((await bus.js.get_last_msg("DLQ", dlq_subject("TINKER"))).data)
    finally:
        await learner.close()
    assert "loss_fn: 'stable_reinforce' is not supported" in refusals[0]
    assert "loss_fn: unknown loss 'no_such_loss'" in refusals[1]
    assert "loss_fn_inputs: importance_sampling needs ['target_tokens', 'logprobs', 'advantages']" in refusals[2]
    assert "data[0].loss_fn_inputs.target_tokens: shape [2], expected [3]" in refusals[3]
    assert letter.stream_sequence == ack.seq and letter.reason.startswith("malformed: cannot decode")


@pytest.mark.timeout(300)
async def test_sampling_serves_exactly_the_weights_saved_for_the_sampler(
        bus: Bus, front: str, publisher: Publisher, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """save_weights_for_sampler publishes the adapter through the publisher; a sampling client
    samples it on the engine: its sampled tokens' logprobs, and compute_logprobs, are the
    training client's own logprobs of those tokens."""
    learner = start_learner(bus, tiny_model_dir, tmp_path / "learner", publisher.client, publisher.endpoint)
    target = SEQUENCES[0]

    def train_and_sample():  # type: ignore[no-untyped-def]
        client = service_client(front, monkeypatch)
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        base = client.create_sampling_client(base_model=BASE_MODEL)
        prompt = tinker.types.ModelInput.from_ints(target[:3])
        greedy = tinker.types.SamplingParams(max_tokens=len(target) - 3, temperature=0.0, stop=[])
        before = base.sample(prompt, 1, greedy).result().sequences[0].tokens
        for _ in range(15):
            training.forward_backward([datum(target)], "cross_entropy").result()
            training.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result()
        path = training.save_weights_for_sampler("memorised").result().path
        named = client.create_sampling_client(model_path=path)
        drawn = named.sample(prompt, 4, tinker.types.SamplingParams(max_tokens=4, temperature=1.0, seed=5,
                                                                     stop=[])).result()
        after = named.sample(prompt, 1, greedy).result().sequences[0]
        unnamed = training.save_weights_and_get_sampling_client().result()
        prompt_logprobs = unnamed.compute_logprobs(tinker.types.ModelInput.from_ints(target)).result()
        forward = training.forward([datum(target)], "cross_entropy").result()
        checks = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(target[:3] + s.tokens[:-1]),
                                     loss_fn_inputs={"target_tokens": np.array(target[1:3] + s.tokens, dtype=np.int64),
                                                     "weights": np.ones(len(s.tokens) + 2, dtype=np.float32)})
                  for s in drawn.sequences]
        learner_logprobs = training.forward(checks, "cross_entropy").result()
        return path, before, after, drawn, prompt_logprobs, forward, learner_logprobs

    try:
        path, before, after, drawn, prompt_logprobs, forward, learner_logprobs = await asyncio.to_thread(
            train_and_sample)
    finally:
        await learner.close()
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/memorised")
    assert after.tokens != before  # the trained adapter samples, not the base
    assert after.stop_reason == "length" and len(after.logprobs) == len(after.tokens)
    assert len(drawn.sequences) == 4 and all(len(s.tokens) == 4 for s in drawn.sequences)
    # The engine's logprobs of what it sampled are the learner's logprobs of the same tokens.
    for sequence, learned in zip(drawn.sequences, learner_logprobs.loss_fn_outputs, strict=True):
        assert sequence.logprobs == pytest.approx(learned["logprobs"].tolist()[2:], abs=2e-3)
    assert prompt_logprobs[0] is None
    assert prompt_logprobs[1:] == pytest.approx(forward.loss_fn_outputs[0]["logprobs"].tolist(), abs=2e-3)


async def run_example(front_url: str, model_name: str, *args: str) -> str:
    """examples/tinker_rl_loop.py as a user runs it: its own process, two environment variables."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLICYLOOP_", "TINKER_"))}
    env.update(TINKER_BASE_URL=front_url, TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0")
    example = Path(__file__).resolve().parents[2] / "examples" / "tinker_rl_loop.py"
    proc = await asyncio.create_subprocess_exec(sys.executable, str(example), "--base-model", model_name, *args,
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()[-4000:]
    return out.decode()


@pytest.fixture
async def arithmetic_cluster(bus: Bus, redis_server, publisher: Publisher,  # type: ignore[no-untyped-def]
                             tmp_path: Path) -> AsyncIterator[str]:
    """The Tinker API over the bootstrapped arithmetic model: front, engine, learner, publisher."""
    from policyloop.models.bootstrap import bootstrap

    model_dir = await asyncio.to_thread(bootstrap)
    engine = await start_engine(model_dir, max_batch=256, threads=1, weight_version="0")
    redis = await connect_redis(redis_server.url, decode_responses=False)
    api = TinkerApi(bus, redis, namespace="rl", base_model="arith", api_key=API_KEY, tokenizer_id=str(model_dir))
    trainer = TinkerTrainer(AdapterTrainer(model_dir, TrainerConfig(device="cpu")), tmp_path / "rl-learner", "arith")
    worker = TinkerWorker(bus, trainer, publisher=publisher.client, fetch_endpoint=publisher.endpoint)
    stop = asyncio.Event()
    learning = asyncio.create_task(worker.run(stop))
    try:
        async with tinker_sampling_replica(bus, engine.base_url), serving_http(api.app()) as url:
            yield url
    finally:
        stop.set()
        await learning
        await redis.aclose()
        await engine.stop()


@pytest.mark.timeout(300)
async def test_the_example_rl_loop_runs_its_steps_through_the_sdk(arithmetic_cluster: str) -> None:
    """The example's every call (sampler saves, sampling, importance_sampling, optim_step) in a few
    steps; that it learns is the slow test below."""
    out = await run_example(arithmetic_cluster, "arith", "--steps", "3", "--eval-problems", "20")
    lines = [line for line in out.splitlines() if line.startswith("held-out accuracy")]
    assert len(lines) == 2, out


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_the_example_rl_loop_raises_heldout_accuracy(arithmetic_cluster: str) -> None:
    out = await run_example(arithmetic_cluster, "arith", "--steps", "100", "--eval-problems", "300")
    print(out)
    lines = [line for line in out.splitlines() if line.startswith("held-out accuracy")]
    before = float(lines[0].split(":")[1].strip().rstrip("%")) / 100
    after = float(lines[1].split(":")[1].split("(")[0].strip().rstrip("%")) / 100
    assert after >= before + 0.04, out  # +7 and +11 points in two 80-step runs


@pytest.mark.timeout(300)
async def test_a_saved_state_outlives_the_learner_and_training_continues_from_it(
        bus: Bus, front: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_state, the learner killed and replaced, then a training client created from the
    state with its optimizer: it computes what the saved model computed, and its next step is
    the step the original model takes, bit for bit."""
    root = tmp_path / "learner"
    learner = start_learner(bus, tiny_model_dir, root)
    client = await asyncio.to_thread(service_client, front, monkeypatch)
    data = [datum(s) for s in SEQUENCES]
    adam = tinker.types.AdamParams(learning_rate=1e-2)

    def train_and_save() -> tuple[object, str, float]:
        original = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        for _ in range(3):
            original.forward_backward(data, "cross_entropy").result()
            original.optim_step(adam).result()
        path = original.save_state("after-3").result().path
        with pytest.raises(tinker.RequestFailedError, match="saved already"):
            original.save_state("after-3").result()
        return original, path, original.forward(data, "cross_entropy").result().metrics["loss:sum"]

    original, path, saved_loss = await asyncio.to_thread(train_and_save)
    await learner.close()
    learner = start_learner(bus, tiny_model_dir, root)
    try:
        def load_and_continue() -> tuple[object, float, float]:
            loaded = client.create_training_client_from_state_with_optimizer(path).result()
            loaded_loss = loaded.forward(data, "cross_entropy").result().metrics["loss:sum"]
            for training in (original, loaded):
                training.forward_backward(data, "cross_entropy").result()
                training.optim_step(adam).result()
            return loaded, loaded_loss, loaded.forward(data, "cross_entropy").result().metrics["loss:sum"]

        loaded, loaded_loss, continued_loss = await asyncio.to_thread(load_and_continue)

        def listings():  # type: ignore[no-untyped-def]
            rest = client.create_rest_client()
            return (rest.list_training_runs().result(), rest.list_checkpoints(original.model_id).result(),
                    rest.get_weights_info_by_tinker_path(path).result(), rest.list_user_checkpoints().result())

        runs, checkpoints, info, everything = await asyncio.to_thread(listings)
        trainer = learner.worker.trainer.trainer
        ids = [original.model_id, loaded.model_id]
        adapters = [trainer.export_adapter(i) for i in ids]
        steps = [trainer.run(i).steps for i in ids]
    finally:
        await learner.close()
    assert path == f"tinker://{original.model_id}/weights/after-3"
    assert loaded_loss == saved_loss and continued_loss < loaded_loss
    assert steps == [4, 4]
    assert all(np.array_equal(adapters[0][k].numpy(), adapters[1][k].numpy()) for k in adapters[0])
    # The REST listings: both models as training runs, the saved state as a checkpoint of the first.
    assert {r.training_run_id for r in runs.training_runs} >= {original.model_id, loaded.model_id}
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in checkpoints.checkpoints] == [
        ("weights/after-3", "training", path)]
    assert info.base_model == BASE_MODEL and info.is_lora and info.lora_rank == 4
    assert path in {c.tinker_path for c in everything.checkpoints}


async def test_a_models_requests_go_on_the_stream_in_seq_id_order_across_front_restarts(
        bus: Bus, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The SDK may send a model's requests concurrently: the front puts them on TINKER in
    seq_id order, and a restarted front goes on from where the order stood (no wait for a
    seq_id it handled before the restart)."""
    from policyloop.bus.topology import tinker_request_subject
    from policyloop.contracts.v1 import tinker_pb2

    redis = await connect_redis(redis_server.url, decode_responses=False)

    def request(seq: int) -> tinker_pb2.TinkerRequest:
        return tinker_pb2.TinkerRequest(request_id=f"m#{seq}", model_id="m", seq_id=seq,
                                        optim_step=tinker_pb2.TinkerAdamParams(learning_rate=0.1))

    try:
        first = TinkerApi(bus, redis, namespace="order", base_model=BASE_MODEL, order_wait_s=600)
        later = asyncio.create_task(first._submit(request(3)))
        middle = asyncio.create_task(first._submit(request(2)))
        await asyncio.sleep(0)  # both wait for seq_id 1
        assert not later.done() and not middle.done()
        await first._submit(request(1))
        await asyncio.wait_for(asyncio.gather(later, middle), 30)
        restarted = TinkerApi(bus, redis, namespace="order", base_model=BASE_MODEL, order_wait_s=600)
        await asyncio.wait_for(restarted._submit(request(4)), 30)  # 1-3 were handled before the restart
        stored = [tinker_pb2.TinkerRequest.FromString(msg.data).seq_id
                  async for _, msg in bus.read("TINKER", tinker_request_subject("m"))]
    finally:
        await redis.aclose()
    assert stored == [1, 2, 3, 4]


async def a_replica_stops_mid_sample(bus: Bus) -> None:
    """A replica takes the next sample request and stops (SIGTERM's drain) before it answers."""
    taken = asyncio.Event()

    class Stalled:
        async def sample(self, request: object) -> None:
            taken.set()
            await asyncio.Event().wait()

    worker, stop = TinkerSampling(bus, Stalled(), concurrency=1).pull_worker(), asyncio.Event()  # type: ignore[arg-type]
    running = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(taken.wait(), 30)
    stop.set()
    await running
    await worker.drain(0)


async def test_a_sample_waits_on_the_bus_for_a_replica_and_outlives_one_that_stops_mid_sample(
        bus: Bus, redis_server, engine: EmbeddedEngine) -> None:  # type: ignore[no-untyped-def]
    """The front keeps no engine: a sample request goes on TINKER_SAMPLES for the rollout replicas.
    While none samples for the API, retrieve_future's try_again says so (paused_capacity, with the
    reason the SDK logs); a replica that stops while it samples hands the request back, and the
    next replica's samples are the answer. A request the engine refuses is answered with the
    engine's reason and dead-lettered with it."""
    import aiohttp

    from policyloop.bus import dlq_subject
    from policyloop.contracts.v1 import bus_pb2, tinker_wire_pb2

    redis = await connect_redis(redis_server.url, decode_responses=False)
    alive = False

    async def samplers_alive() -> bool:
        return alive

    api = TinkerApi(bus, redis, namespace="queued", base_model=BASE_MODEL, poll_s=0.2, samplers_alive=samplers_alive)
    stack = AsyncExitStack()
    url = await stack.enter_async_context(serving_http(api.app()))
    http = await stack.enter_async_context(aiohttp.ClientSession())

    async def post(route: str, body: dict) -> tuple[int, bytes]:  # type: ignore[type-arg]
        async with http.post(f"{url}/api/v1/{route}", json=body) as answer:
            return answer.status, await answer.read()

    async def asample(seq_id: int, tokens: list[int]) -> str:
        status, body = await post("asample", {
            "sampling_session_id": f"{session}:sample:0", "seq_id": seq_id, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 7}})
        assert status == 200, body
        return str(json.loads(body)["request_id"])

    async def answered(request_id: str) -> bytes:
        while True:
            status, body = await post("retrieve_future", {"request_id": request_id})
            assert status == 200, body
            if not body.startswith(b"{") or json.loads(body).get("type") != "try_again":
                return body

    try:
        session = json.loads((await post("create_session", {}))[1])["session_id"]
        assert (await post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                       "base_model": BASE_MODEL}))[0] == 200
        request_id = await asample(1, [4, 5, 6])
        waiting = json.loads((await post("retrieve_future", {"request_id": request_id}))[1])
        assert waiting["type"] == "try_again" and waiting["queue_state"] == "paused_capacity"
        assert "tinker_sampling" in waiting["queue_state_reason"]

        await a_replica_stops_mid_sample(bus)  # the request goes back on the stream
        alive = True
        again = json.loads((await post("retrieve_future", {"request_id": request_id}))[1])
        assert again["queue_state"] == "active"

        async with tinker_sampling_replica(bus, engine.base_url) as sampling:
            response = tinker_wire_pb2.SampleResponse.FromString(await answered(request_id))
            refused_id = await asample(2, [4, 10_000])  # outside the tiny model's vocabulary
            refused = json.loads(await answered(refused_id))
        letter = bus_pb2.DeadLetter.FromString(
            (await bus.js.get_last_msg("DLQ", dlq_subject("TINKER_SAMPLES"))).data)
    finally:
        await stack.aclose()
        await redis.aclose()
    assert len(response.sequences) == 2 and all(len(s.tokens) == 12 for s in response.sequences)  # 3 int32 each
    assert sampling.done == 1
    assert refused["category"] == "user" and "outside the vocabulary" in refused["error"]
    assert refused_id in letter.reason and letter.origin_stream == "TINKER_SAMPLES"


@pytest.mark.timeout(300)
async def test_a_sampler_save_between_forward_backward_and_optim_step_keeps_the_pending_gradients(
        bus: Bus, front: str, publisher: Publisher, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """save_weights_for_sampler while gradients wait for optim_step checkpoints nothing (the
    checkpoint would cover gradients it does not hold): after a restart the forward_backward is
    recomputed, and the sampler version, published again, is the one the publisher holds."""
    root = tmp_path / "learner"
    learner = start_learner(bus, tiny_model_dir, root, publisher.client, publisher.endpoint)
    client = await asyncio.to_thread(service_client, front, monkeypatch)

    def before():  # type: ignore[no-untyped-def]
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        training.forward_backward([datum(SEQUENCES[0])], "cross_entropy").result()
        return training, training.save_weights_for_sampler("mid").result().path

    training, path = await asyncio.to_thread(before)
    await learner.close()
    learner = start_learner(bus, tiny_model_dir, root, publisher.client, publisher.endpoint)
    try:
        adam = tinker.types.AdamParams(learning_rate=1e-2)
        done = await asyncio.to_thread(lambda: training.optim_step(adam).result())
        again = await asyncio.to_thread(lambda: training.save_weights_for_sampler("after").result().path)
        versions = [v.version for v in await publisher.client.list_versions(
            adapter_model_name("policy", training.model_id))]
    finally:
        await learner.close()
    assert done.metrics["forward_backward_calls:sum"] == 1
    assert path.endswith("/sampler_weights/mid") and again.endswith("/sampler_weights/after")
    assert versions == [1, 2]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tiny_model_dir: Path, tmp_path: Path) -> None:
    from policyloop.contracts.v1 import tinker_pb2

    def request(seq: int, **op: object) -> tinker_pb2.TinkerRequest:
        return tinker_pb2.TinkerRequest(request_id=f"m#{seq}", model_id="m", seq_id=seq, **op)  # type: ignore[arg-type]

    trainer = TinkerTrainer(AdapterTrainer(tiny_model_dir, TrainerConfig(device="cpu")), tmp_path, BASE_MODEL)
    create = tinker_pb2.TinkerCreateModel(base_model=BASE_MODEL, rank=4, train_attn=True)
    assert not trainer.apply(request(0, create_model=create), 1).HasField("error")
    trainer.commit("m")
    adam = tinker_pb2.TinkerAdamParams(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8)
    assert not trainer.apply(request(1, optim_step=adam), 2).HasField("error")
    trainer.commit("m")
    newest = sorted((tmp_path / "checkpoints").glob("*/version-*-seq*"))[-1]
    (newest / "adapter_model.safetensors").write_bytes(b"damaged")
    again = TinkerTrainer(AdapterTrainer(tiny_model_dir, TrainerConfig(device="cpu")), tmp_path, BASE_MODEL)
    assert again.restore_all() == 2  # the create's checkpoint: the optim_step is applied again
    assert again.models["m"].stream_seq == 1 and again.trainer.run("m").steps == 0


@pytest.mark.timeout(300)
async def test_a_request_that_fails_unforeseen_is_answered_and_not_applied_again(
        bus: Bus, front: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no check foresaw (held here on purpose in the first optim_step) is the
    request's result, and ends the worker: the next learner starts from the checkpoints and
    skips that request, whose failure changed nothing, and the model goes on."""
    root = tmp_path / "learner"
    learner = start_learner(bus, tiny_model_dir, root)
    original = TinkerTrainer._optim_step

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("held on purpose")

    monkeypatch.setattr(TinkerTrainer, "_optim_step", failing)
    client = await asyncio.to_thread(service_client, front, monkeypatch)
    adam = tinker.types.AdamParams(learning_rate=1e-2)

    def first():  # type: ignore[no-untyped-def]
        training = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        training.forward_backward([datum(SEQUENCES[0])], "cross_entropy").result()
        with pytest.raises(tinker.RequestFailedError, match="the learner failed: RuntimeError"):
            training.optim_step(adam).result()
        return training

    training = await asyncio.to_thread(first)
    with pytest.raises(RuntimeError, match="held on purpose"):
        await learner.task
    monkeypatch.setattr(TinkerTrainer, "_optim_step", original)
    learner = start_learner(bus, tiny_model_dir, root)
    try:
        done = await asyncio.to_thread(lambda: training.optim_step(adam).result())
        steps = learner.worker.trainer.trainer.run(training.model_id).steps
    finally:
        await learner.close()
    assert done.metrics["forward_backward_calls:sum"] == 1 and steps == 1


async def test_malformed_requests_get_4xx_naming_the_field(bus: Bus, front: str) -> None:
    """What the SDK would retry for minutes (5xx) must never answer a request that is simply wrong."""
    import aiohttp

    from policyloop.contracts.v1 import tinker_wire_pb2
    from policyloop.tinker import wire

    headers = {"X-API-Key": API_KEY}
    async with aiohttp.ClientSession(headers=headers) as http:
        async def post(route: str, body: dict) -> tuple[int, str]:  # type: ignore[type-arg]
            async with http.post(f"{front}/api/v1/{route}", json=body) as answer:
                return answer.status, (await answer.json()).get("detail", "")

        assert await post("create_model", {"session_id": "../etc", "model_seq_id": 0, "base_model": BASE_MODEL}) == (
            400, "session_id: '../etc' is not a session this API opened (create_session)")
        session = (await (await http.post(f"{front}/api/v1/create_session", json={})).json())["session_id"]
        status, detail = await post("create_model", {"session_id": session, "model_seq_id": 0,
                                                      "base_model": BASE_MODEL, "lora_config": {"rank": 2**40}})
        assert status == 400 and detail.startswith("rank: ")
        await post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                    "lora_config": {"rank": 4}})
        model = f"{session}:train:0"
        assert (await post("optim_step", {"model_id": model, "seq_id": 0, "adam_params": {}}))[1] == \
            "seq_id: from 1, got 0"
        assert (await post("optim_step", {"model_id": model, "seq_id": 1,
                                          "adam_params": {"learning_rate": "fast"}}))[0] == 400
        async with http.get(f"{front}/api/v1/training_runs", params={"limit": "many"}) as answer:
            assert answer.status == 400
        await post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": BASE_MODEL})
        assert await post("asample", {"sampling_session_id": f"{session}:sample:0", "seq_id": 1,
                                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, -1]}]}}) == (
            400, "prompt.chunks[0].tokens: token ids are within [0, 2**31)")
        oversize = b"\0" * (bus.nc.max_payload + 1)
        async with http.post(f"{front}/api/v1/forward_backward", data=oversize,
                             headers={"Content-Type": "application/x-protobuf"}) as answer:
            assert answer.status == 413

    # Float or NaN token ids never reach the model.
    datum = tinker_wire_pb2.Datum(model_input=[tinker_wire_pb2.Chunk(encoded_text=tinker_wire_pb2.EncodedTextChunk(
        tokens=np.array([4, 5], dtype="<i4").tobytes()))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(tinker_wire_pb2.Tensor(
        dense=np.array([5, np.nan], dtype="<f4").tobytes(), dtype=tinker_wire_pb2.DTYPE_FLOAT32, shape=[2]))
    with pytest.raises(wire.WireError, match="target_tokens: not finite"):
        wire.examples(tinker_wire_pb2.ForwardBackwardRequest(data=[datum]), vocab_size=32)
    datum.loss_fn_inputs["target_tokens"].dense = np.array([5, 6], dtype="<f4").tobytes()
    with pytest.raises(wire.WireError, match="token ids are integers"):
        wire.examples(tinker_wire_pb2.ForwardBackwardRequest(data=[datum]), vocab_size=32)


@pytest.mark.timeout(300)
async def test_a_burst_of_sample_requests_is_answered_without_a_server_error(front: str) -> None:
    """150 samples at once, as 150 sample() futures send them, and no retries to hide a 5xx: more
    requests at once than a Redis client's pool holds wait for a connection (they answered
    HTTP 500, MaxConnectionsError, past redis-py's 100)."""
    import aiohttp

    from policyloop.contracts.v1 import tinker_wire_pb2

    burst = 150
    async with aiohttp.ClientSession(headers={"X-API-Key": API_KEY},
                                     connector=aiohttp.TCPConnector(limit=0)) as http:  # no client-side queue
        async def post(route: str, body: dict) -> tuple[int, bytes]:  # type: ignore[type-arg]
            async with http.post(f"{front}/api/v1/{route}", json=body) as answer:
                return answer.status, await answer.read()

        session = (await (await http.post(f"{front}/api/v1/create_session", json={})).json())["session_id"]
        status, _ = await post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                            "base_model": BASE_MODEL})
        assert status == 200

        async def sample(seq_id: int) -> tinker_wire_pb2.SampleResponse:
            status, body = await post("asample", {
                "sampling_session_id": f"{session}:sample:0", "seq_id": seq_id, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 6]}]},
                "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": seq_id}})
            assert status == 200, body
            request_id = json.loads(body)["request_id"]
            while True:  # the long poll answers try_again until the result is there
                status, body = await post("retrieve_future", {"request_id": request_id})
                assert status == 200, body
                if not body.startswith(b"{"):
                    return tinker_wire_pb2.SampleResponse.FromString(body)
                assert json.loads(body).get("type") == "try_again", body

        answers = await asyncio.gather(*(sample(seq_id) for seq_id in range(1, burst + 1)))
    assert all(len(answer.sequences) == 1 and answer.sequences[0].tokens for answer in answers)
