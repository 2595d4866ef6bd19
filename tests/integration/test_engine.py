"""The embedded engine over real HTTP on loopback, driven by SGLangClient (and raw aiohttp where
the exact JSON matters), on a real tiny Qwen2 model: field names and shapes, determinism, seeded
sampling independent of the batch, stop/length/abort, logprobs against a teacher-forced forward
pass, weight updates (good and bad), pause/continue/abort, and request validation."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import torch

from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.protocol import GenerateRequest, GenerateResult, SamplingParams, error_message
from policyloop.engines.sglang_client import EngineError, EngineUnavailable, SGLangClient, WeightUpdateError
from policyloop.models.tokenizer import EOS_ID, VOCAB, build_tokenizer
from tests.tiny_model import build_tiny_model, perturbed_copy

DIGITS = [VOCAB[c] for c in "0123456789"]
PLUS, EQUALS = VOCAB["+"], VOCAB["="]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def perturbed_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-model-perturbed"), scale=0.05)


@pytest.fixture(scope="session")
def other_shape_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-32"), hidden_size=32)


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(tiny_model, max_batch=16, threads=1, weight_version="0")
    yield running
    await running.stop()


@pytest.fixture
async def client(engine: EmbeddedEngine) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(engine.base_url, timeout_s=60, retries=2) as c:
        yield c


def prompt(i: int, length: int) -> list[int]:
    """A digit prompt "ddd+ddd=" of about `length` tokens (at least 1)."""
    digits = [DIGITS[(i * 7 + k * 3) % 10] for k in range(max(1, length))]
    if length >= 4:
        digits[length // 2] = PLUS
        digits[-1] = EQUALS
    return digits


def greedy(ids: list[int], n: int, **kw: object) -> GenerateRequest:
    kw.setdefault("ignore_eos", True)
    return GenerateRequest(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                         **kw))  # type: ignore[arg-type]


def sampled(ids: list[int], n: int, seed: int, rid: str | None = None, **kw: object) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=n, temperature=1.0, sampling_seed=seed, **kw)  # type: ignore[arg-type]
    return GenerateRequest(input_ids=ids, sampling_params=params, rid=rid)

async def decoding(engine: EmbeddedEngine, client: SGLangClient, rid: str, ids: list[int], max_new_tokens: int
                   ) -> asyncio.Task[GenerateResult]:
    """A greedy request that ignores EOS, once it has decoded a few tokens."""
    task = asyncio.create_task(client.generate(GenerateRequest(
        input_ids=ids, rid=rid, sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                                ignore_eos=True))))
    await wait_for(lambda: (engine.progress(rid) or 0) >= 3, what=f"{rid} decoding")
    return task



async def wait_for(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.002)


def teacher_logprobs(model_dir: Path, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Log-probability of each response token under an unpadded, uncached forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids, response in pairs:
            logits = model(input_ids=torch.tensor([ids + response])).logits[0].float()
            logps = torch.log_softmax(logits, dim=-1)
            out.append([float(logps[len(ids) - 1 + j, tok]) for j, tok in enumerate(response)])
    return out


async def post(url: str, payload: object) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        text = await response.text()
        try:
            import json

            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


# ---------------------------------------------------------------------------------------------


async def test_health_and_model_info(engine: EmbeddedEngine, client: SGLangClient, tiny_model: Path) -> None:
    assert await client.health()
    info = await client.model_info()
    assert info.model_path == str(tiny_model)
    assert info.weight_version == "0"
    assert info.model_type == "qwen2" and info.is_generation
    async with aiohttp.ClientSession() as session:
        for path in ("/model_info", "/get_model_info"):
            async with session.get(engine.base_url + path) as response:
                assert response.status == 200
                body = await response.json()
            assert set(body) == {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
                                 "weight_version", "has_image_understanding", "has_audio_understanding",
                                 "model_type", "architectures"}
            assert body["weight_version"] == "0"


async def test_generate_json_shape_and_client_result(engine: EmbeddedEngine, client: SGLangClient) -> None:
    ids = prompt(1, 6)
    status, body = await post(engine.base_url + "/generate", {
        "input_ids": ids, "rid": "shape-1", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}})
    assert status == 200, body
    assert isinstance(body, dict) and set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 5}]
    triples = meta["output_token_logprobs"]
    assert len(triples) == 5 and [t[1] for t in triples] == body["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and txt is None for lp, _, txt in triples)
    # The text decodes the tokens (special ones skipped; tool markers are tokens of several characters).
    assert body["text"] == build_tokenizer().decode(body["output_ids"], skip_special_tokens=True)

    result = await client.generate(greedy(ids, 5))
    assert isinstance(result, GenerateResult)
    assert result.output_ids == body["output_ids"]  # greedy: the same tokens
    assert result.output_logprobs == pytest.approx([t[0] for t in triples], abs=1e-6)
    assert result.finish_reason == "length" and result.prompt_tokens == len(ids) and result.completion_tokens == 5
    assert result.weight_version == "0" and result.rid

    no_logprobs = await client.generate(GenerateRequest(
        input_ids=ids, return_logprob=False,
        sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
    assert no_logprobs.output_logprobs is None and len(no_logprobs.output_ids) == 3


async def test_greedy_is_deterministic(client: SGLangClient) -> None:
    ids = prompt(2, 7)
    alone = await client.generate(greedy(ids, 20))
    crowd = await asyncio.gather(client.generate(greedy(ids, 20)),
                                 *(client.generate(greedy(prompt(i, 3 + i), 20)) for i in range(5)))
    assert crowd[0].output_ids == alone.output_ids
    assert crowd[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


async def test_seeded_sampling_is_independent_of_the_batch(client: SGLangClient) -> None:
    ids = prompt(3, 5)
    params = dict(top_p=0.9, top_k=12, ignore_eos=True)
    alone = await client.generate(sampled(ids, 24, seed=1234, **params))
    others = [client.generate(sampled(prompt(i, 2 + 2 * i), 10 + 3 * i, seed=i, **params)) for i in range(7)]
    together = await asyncio.gather(client.generate(sampled(ids, 24, seed=1234, **params)), *others)
    assert together[0].output_ids == alone.output_ids
    assert together[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    other_seed = await client.generate(sampled(ids, 24, seed=4321, **params))
    assert other_seed.output_ids != alone.output_ids


async def test_a_group_sharing_a_prompt_prefills_it_once_and_samples_as_alone(client: SGLangClient) -> None:
    """A GRPO group (one prompt, several seeds) in one batch: the prompt is computed once for the
    wave (SGLang's cached_tokens counts the others' prompt tokens), each sample is the one its
    seed draws alone, and a different prompt in the same wave is prefilled on its own."""
    shared, other = prompt(4, 6), prompt(5, 5)
    group = [sampled(shared, 8, seed=500 + i, rid=f"g-{i}", ignore_eos=True) for i in range(4)]
    lone = sampled(other, 8, seed=77, rid="other", ignore_eos=True)
    together = await client.generate_batch([*group, lone])
    alone = [await client.generate(r.model_copy(update={"rid": f"alone-{r.rid}"})) for r in [*group, lone]]
    for batched, single in zip(together, alone, strict=True):
        assert batched.output_ids == single.output_ids
        assert batched.output_logprobs == pytest.approx(single.output_logprobs, abs=1e-5)
    assert [r.cached_tokens for r in together] == [0, len(shared), len(shared), len(shared), 0]
    assert all(r.cached_tokens == 0 for r in alone)
    assert len({tuple(r.output_ids) for r in together[:4]}) > 1  # the seeds drew different samples


async def test_a_batch_request_answers_each_prompt_as_alone_in_order(engine: EmbeddedEngine,
                                                                     client: SGLangClient) -> None:
    """SGLang's batch form of /generate: prompts and per-prompt fields as lists, one answer each."""
    requests = [sampled(prompt(i, 3 + i), 6 + i, seed=100 + i, rid=f"batch-{i}", ignore_eos=True) for i in range(5)]
    requests[2] = requests[2].model_copy(update={"return_logprob": False})
    together = await client.generate_batch(requests)
    alone = [await client.generate(r.model_copy(update={"rid": f"alone-{i}"})) for i, r in enumerate(requests)]
    assert [r.rid for r in together] == [f"batch-{i}" for i in range(5)]
    for i, (batched, single) in enumerate(zip(together, alone, strict=True)):
        assert batched.output_ids == single.output_ids and len(batched.output_ids) == 6 + i
        if i == 2:
            assert batched.output_logprobs is None
        else:
            assert batched.output_logprobs == pytest.approx(single.output_logprobs, abs=1e-5)

    # One sampling_params for all prompts; per-prompt lists must match the prompts in number.
    status, body = await post(engine.base_url + "/generate", {
        "input_ids": [prompt(1, 4), prompt(2, 4)], "rid": ["s1", "s2"],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
    assert status == 200 and isinstance(body, list) and [len(a["output_ids"]) for a in body] == [3, 3]
    refusals = [
        ({"input_ids": [prompt(1, 4), prompt(2, 4)], "rid": ["a"]}, "rid", "1 values for a batch of 2 prompts"),
        ({"input_ids": [prompt(1, 4), prompt(2, 4)], "rid": "a"}, "rid", "a list of rids"),
        ({"input_ids": [prompt(1, 4), prompt(2, 4)], "rid": ["a", "a"]}, "rid", "must differ"),
        ({"input_ids": [prompt(1, 4), []]}, "input_ids", "prompt 1"),
        ({"input_ids": [prompt(1, 4), prompt(2, 4)], "sampling_params": [{}, {"top_p": 2}]},
         "sampling_params.top_p", "prompt 1"),
    ]
    for payload, field, words in refusals:
        status, body = await post(engine.base_url + "/generate", payload)
        assert status == 400, (payload, body)
        message = error_message(body)
        assert field in message and words in message, (payload, message)


async def test_aborting_one_prompt_of_a_batch_ends_only_it(engine: EmbeddedEngine, client: SGLangClient) -> None:
    await client.pause_generation("in_place")  # hold the batch so that the abort finds it in flight
    batch = asyncio.ensure_future(client.generate_batch(
        [sampled(prompt(i, 4), 5, seed=i, rid=f"held-{i}", ignore_eos=True) for i in range(3)]))
    deadline = time.monotonic() + 30
    while len(engine.scheduler.requests) < 3:
        assert time.monotonic() < deadline and not batch.done()
        await asyncio.sleep(0.01)
    await client.abort_request("held-1")
    await client.continue_generation()
    results = await batch
    assert [r.finish_reason for r in results] == ["length", "abort", "length"]
    assert [len(r.output_ids) for r in results] == [5, 0, 5]


async def test_stop_tokens_eos_and_max_new_tokens(client: SGLangClient) -> None:
    for i in range(4, 40):  # a prompt whose greedy continuation has a few tokens before any EOS
        ids = prompt(i, 6)
        full = await client.generate(greedy(ids, 12))
        before_eos = list(itertools.takewhile(lambda token: token != EOS_ID, full.output_ids))
        if len(before_eos) >= 3:
            break
    else:
        pytest.fail("every greedy continuation begins with EOS")
    assert full.finish_reason == "length" and len(full.output_ids) == 12
    assert full.finish_detail is not None and full.finish_detail.length == 12

    stop_at = before_eos[min(5, len(before_eos) - 1)]
    first = full.output_ids.index(stop_at)
    stopped = await client.generate(greedy(ids, 12, stop_token_ids=(stop_at,), ignore_eos=False))
    assert stopped.finish_reason == "stop" and stopped.finish_detail.matched == stop_at  # type: ignore[union-attr]
    assert stopped.output_ids == full.output_ids[: first + 1]  # the stop token is returned, with its logprob
    assert len(stopped.output_logprobs or []) == first + 1
    # As in SGLang, ignore_eos turns off the request's stop tokens too.
    ignored = await client.generate(greedy(ids, 12, stop_token_ids=(stop_at,)))
    assert ignored.output_ids == full.output_ids and ignored.finish_reason == "length"

    # EOS ends a request unless ignore_eos: find a seeded sample that draws EOS, then replay it.
    for seed in range(50):
        free = await client.generate(sampled(ids, 40, seed=seed, ignore_eos=True))
        if EOS_ID in free.output_ids:
            break
    else:
        pytest.fail("no sample drew EOS")
    cut = free.output_ids.index(EOS_ID)
    ended = await client.generate(sampled(ids, 40, seed=seed))
    assert ended.output_ids == free.output_ids[: cut + 1]
    assert ended.finish_reason == "stop" and ended.finish_detail.matched == EOS_ID  # type: ignore[union-attr]

    nothing = await client.generate(greedy(ids, 0))
    assert nothing.output_ids == [] and nothing.finish_reason == "length" and nothing.completion_tokens == 0


async def test_stop_strings_end_the_request_and_cut_its_text(client: SGLangClient) -> None:
    """A stop string (SGLang's `stop`) ends the request at the token that completes it: the ids
    keep every token drawn (the stop's among them), the text ends before the stop string."""
    text = build_tokenizer().decode
    for i in range(4, 40):  # a greedy continuation with a few distinct characters to stop on
        ids = prompt(i, 6)
        full = await client.generate(greedy(ids, 12))
        full_text = text(full.output_ids)
        if len(set(full_text[2:])) >= 2:
            break
    else:
        pytest.fail("every greedy continuation repeats one character")
    stop = full_text[2:4]
    at = full_text.find(stop)
    ends = next(n for n in range(1, 13) if stop in text(full.output_ids[:n]))
    stopped = await client.generate(greedy(ids, 12, stop=[stop, "never there"]))
    assert stopped.finish_reason == "stop" and stopped.finish_detail.matched == stop  # type: ignore[union-attr]
    assert stopped.output_ids == full.output_ids[:ends] and len(stopped.output_logprobs or []) == ends
    assert stopped.text == full_text[:at]
    alone = await client.generate(greedy(ids, 12, stop=stop))  # SGLang also takes one string
    assert alone.output_ids == stopped.output_ids
    unmatched = await client.generate(greedy(ids, 12, stop=["never there"]))
    assert unmatched.output_ids == full.output_ids and unmatched.finish_reason == "length"


async def test_logprobs_match_a_teacher_forced_forward(client: SGLangClient, tiny_model: Path) -> None:
    prompts = [prompt(i, n) for i, n in enumerate([1, 3, 6, 9, 12, 17])]
    requests = [sampled(p, 8 + 3 * i, seed=100 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    requests.append(greedy(prompts[2], 15))
    results = await asyncio.gather(*(client.generate(r) for r in requests))
    pairs = [(r.input_ids or [], res.output_ids) for r, res in zip(requests, results, strict=True)]
    reference = teacher_logprobs(tiny_model, pairs)
    for res, ref in zip(results, reference, strict=True):
        assert len(res.output_logprobs or []) == len(ref) > 0
        worst = max(abs(a - b) for a, b in zip(res.output_logprobs or [], ref, strict=True))
        assert worst < 1e-4, worst


async def test_update_weights_from_disk(engine: EmbeddedEngine, client: SGLangClient, tiny_model: Path,
                                        perturbed_model: Path, other_shape_model: Path, tmp_path: Path) -> None:
    ids = prompt(5, 8)
    before = await client.generate(greedy(ids, 16))

    result = await client.update_weights_from_disk(str(perturbed_model), weight_version="1")
    assert result.success and "1" in result.message
    assert (await client.model_info()).weight_version == "1"
    after = await client.generate(greedy(ids, 16))
    assert after.weight_version == "1" and after.output_logprobs != before.output_logprobs
    assert after.output_ids != before.output_ids
    # The new weights really serve: logprobs match a forward pass of the perturbed model.
    ref = teacher_logprobs(perturbed_model, [(ids, after.output_ids)])[0]
    assert max(abs(a - b) for a, b in zip(after.output_logprobs or [], ref, strict=True)) < 1e-4

    # Failures are clear, and the old weights and version keep serving.
    with pytest.raises(WeightUpdateError, match="not a directory"):
        await client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="2")
    with pytest.raises(WeightUpdateError, match="shape mismatch"):
        await client.update_weights_from_disk(str(other_shape_model), weight_version="2")
    status, body = await post(engine.base_url + "/update_weights_from_disk",
                              {"model_path": str(other_shape_model), "weight_version": "2"})
    assert status == 400 and isinstance(body, dict) and body["success"] is False and "shape" in body["message"]
    assert (await client.model_info()).weight_version == "1"
    still = await client.generate(greedy(ids, 16))
    assert still.output_ids == after.output_ids and still.weight_version == "1"

    # Back to the original weights under a new version: the original outputs come back.
    await client.update_weights_from_disk(str(tiny_model), weight_version="2")
    again = await client.generate(greedy(ids, 16))
    assert again.output_ids == before.output_ids and again.weight_version == "2"


async def test_update_weights_from_tensor(engine: EmbeddedEngine, client: SGLangClient, tiny_model: Path,
                                          perturbed_model: Path, other_shape_model: Path) -> None:
    """The version sent in the request as one safetensors file serves exactly as the same weights
    loaded from disk; anything the served model cannot take leaves the old version serving."""
    import base64

    import safetensors.torch

    def file_bytes(model_dir: Path) -> bytes:
        return (model_dir / "model.safetensors").read_bytes()

    ids = prompt(5, 8)
    before = await client.generate(greedy(ids, 16))
    result = await client.update_weights_from_tensor(file_bytes(perturbed_model), weight_version="1")
    assert result.success and "1" in result.message
    after = await client.generate(greedy(ids, 16))
    assert after.weight_version == "1" and after.output_ids != before.output_ids
    ref = teacher_logprobs(perturbed_model, [(ids, after.output_ids)])[0]
    assert max(abs(a - b) for a, b in zip(after.output_logprobs or [], ref, strict=True)) < 1e-4

    # Any of the model's parameters may be sent: these two go back to the base model's.
    base = safetensors.torch.load(file_bytes(tiny_model))
    some = dict(list(base.items())[:2])
    await client.update_weights_from_tensor(safetensors.torch.save(some), weight_version="2")
    served = engine.served.parameters()
    assert all(torch.equal(served[name], tensor) for name, tensor in some.items())

    refusals = [
        (file_bytes(other_shape_model), "shape mismatch"),
        (safetensors.torch.save({"lm_head.bias": torch.zeros(3)}), "'lm_head.bias' is not a parameter"),
        (b"not a safetensors file", "serialized_named_tensors[0]: not a safetensors file"),
    ]
    for payload, named in refusals:
        with pytest.raises(EngineError, match=re.escape(named)):  # WeightUpdateError where the engine read them
            await client.update_weights_from_tensor(payload, weight_version="3")
        assert (await client.model_info()).weight_version == "2"
    encoded, tensors = base64.b64encode(file_bytes(tiny_model)).decode(), "serialized_named_tensors"
    for body, field in [({tensors: [encoded], "weight_version": "3"}, "load_format"),
                        ({tensors: [encoded], "load_format": "flattened_bucket"}, "load_format"),
                        ({tensors: ["%%%"], "load_format": "safetensors"}, tensors),
                        ({tensors: [encoded, encoded], "load_format": "safetensors"}, tensors),
                        ({tensors: [], "load_format": "safetensors"}, tensors),
                        ({tensors: [encoded], "load_format": "safetensors", "selector": "draft"}, "draft")]:
        status, answer = await post(engine.base_url + "/update_weights_from_tensor", body)
        assert status == 400 and field in str(answer), (body.keys(), answer)
    assert (await client.model_info()).weight_version == "2"
    still = await client.generate(greedy(ids, 16))
    assert still.weight_version == "2"


async def test_update_during_generation_splits_versions_or_aborts(engine: EmbeddedEngine, client: SGLangClient,
                                                                  perturbed_model: Path, tiny_model: Path) -> None:
    ids = prompt(6, 4)
    running = await decoding(engine, client, "long-1", ids, 240)
    await client.pause_generation("in_place")
    # Paused in place, the request keeps its KV cache: SGLang cannot flush it.
    status, text = await post(engine.base_url + "/flush_cache", None)
    assert status == 400 and "running or waiting requests" in str(text)
    with pytest.raises(EngineError, match="flush_cache: Cache not flushed"):
        await client.update_weights_from_disk(str(perturbed_model), weight_version="1")
    assert (await client.model_info()).weight_version == "0"
    await client.update_weights_from_disk(str(perturbed_model), weight_version="1", flush_cache=False)
    await client.continue_generation()
    result = await running
    assert result.finish_reason == "length" and len(result.output_ids) == 240
    spans = result.weight_versions or []
    assert [s.version for s in spans] == ["0", "1"]
    assert spans[0].start == 0 and 0 < spans[0].end == spans[1].start and spans[1].end == 240
    assert result.weight_version == "1"

    running = await decoding(engine, client, "long-2", ids, 240)
    await client.update_weights_from_disk(str(tiny_model), weight_version="2", abort_all_requests=True)
    aborted = await running
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.output_ids) < 240
    assert len(aborted.output_logprobs or []) == len(aborted.output_ids)


async def test_update_while_generating_waits_for_the_requests_in_flight(
        engine: EmbeddedEngine, client: SGLangClient, perturbed_model: Path) -> None:
    """Not paused, an update takes SGLang's writer lock: it waits for the running request (all of
    whose tokens stay on the old version), and a request sent meanwhile runs after it."""
    ids = prompt(6, 4)
    running = await decoding(engine, client, "first", ids, 120)
    update = asyncio.create_task(client.update_weights_from_disk(str(perturbed_model), weight_version="1"))
    await wait_for(lambda: engine.scheduler.writers == 1, what="the update waiting")
    later = asyncio.create_task(client.generate(greedy(prompt(9, 5), 6)))
    first = await running
    assert [s.version for s in first.weight_versions or []] == ["0"] and len(first.output_ids) == 120
    assert (await update).success
    assert (await later).weight_version == "1"
    assert (await post(engine.base_url + "/flush_cache", None))[0] == 200  # idle: flushable


async def test_retract_recomputes_the_cache_with_the_new_weights(
        engine: EmbeddedEngine, client: SGLangClient, perturbed_model: Path) -> None:
    """Paused in mode retract, a request's cache is recomputed on continue: what follows the
    update is exactly what the new weights give for prompt + the tokens so far."""
    ids = prompt(6, 4)
    running = await decoding(engine, client, "retracted", ids, 60)
    await client.pause_generation("retract")
    await client.update_weights_from_disk(str(perturbed_model), weight_version="1", flush_cache=False)
    await client.continue_generation()
    result = await running
    [old, new] = result.weight_versions or []
    assert (old.version, new.version) == ("0", "1") and old.end == new.start
    head = result.output_ids[:old.end]
    tail = await client.generate(greedy(ids + head, 60 - len(head)))
    assert result.output_ids[old.end:] == tail.output_ids
    assert result.output_logprobs[old.end:] == pytest.approx(tail.output_logprobs, abs=1e-5)


async def test_a_request_aborted_by_an_update_is_resumed_as_a_partial_rollout(
        engine: EmbeddedEngine, client: SGLangClient, perturbed_model: Path) -> None:
    """pause(abort) → update → continue: the client resubmits prompt + tokens so far with the rest
    of the budget, and the joined sample says which version made each token."""
    from policyloop.engines.partial import generate_resumable

    ids = prompt(6, 4)
    request = GenerateRequest(input_ids=ids, rid="partial", sampling_params=SamplingParams(
        max_new_tokens=80, temperature=0.0, ignore_eos=True))
    running = asyncio.create_task(generate_resumable(client, request))
    await wait_for(lambda: (engine.progress("partial") or 0) >= 3, what="decoding")
    await client.pause_generation("abort")
    await client.update_weights_from_disk(str(perturbed_model), weight_version="1", flush_cache=True)
    await client.continue_generation()
    completion = await asyncio.wait_for(running, 30)
    result = completion.result
    assert completion.resubmits == 1 and result.finish_reason == "length" and len(result.output_ids) == 80
    [old, new] = result.weight_versions or []
    assert (old.version, new.version, old.start, new.end) == ("0", "1", 0, 80) and old.end == new.start
    assert len(result.output_logprobs or []) == 80
    head = result.output_ids[:old.end]
    tail = await client.generate(greedy(ids + head, 80 - len(head)))
    assert result.output_ids[old.end:] == tail.output_ids


async def test_pause_abort_then_continue(engine: EmbeddedEngine, client: SGLangClient) -> None:
    long = SamplingParams(max_new_tokens=240, temperature=0.0, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate(GenerateRequest(input_ids=prompt(i, 3 + i), rid=f"p{i}",
                                                                 sampling_params=long))) for i in range(3)]
    await wait_for(lambda: all((engine.progress(f"p{i}") or 0) >= 2 for i in range(3)), what="decoding")
    await client.pause_generation("abort")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    for res in results:
        assert res.finish_reason == "abort" and 2 <= len(res.output_ids) < 240
        assert res.finish_detail is not None and res.finish_detail.message

    # While paused, new requests wait (the engine counts them queued); continue lets them run.
    waiting = asyncio.create_task(client.generate(greedy(prompt(9, 5), 6)))
    await wait_for(lambda: len(engine.scheduler.held) == 1, what="the request held")
    metrics = await engine_metrics(client)
    assert metrics["sglang:num_queue_reqs"] == 1 and metrics["sglang:num_running_reqs"] == 0
    assert not waiting.done()
    await client.continue_generation()
    done = await asyncio.wait_for(waiting, 10)
    assert done.finish_reason == "length" and len(done.output_ids) == 6


async def engine_metrics(client: SGLangClient) -> dict[str, float]:
    """The engine's /metrics, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(f"{client.base_url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_count_tokens_and_requests_in_flight(engine: EmbeddedEngine, client: SGLangClient) -> None:
    before = await engine_metrics(client)
    ids = prompt(3, 6)
    await client.generate(greedy(ids, 5))
    after = await engine_metrics(client)
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == len(ids)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 5
    assert after["policyloop_engine_in_flight_output_tokens"] == 0
    task = await decoding(engine, client, "counted", prompt(4, 5), 200)
    await client.pause_generation("in_place")
    held = await engine_metrics(client)
    assert held["sglang:num_running_reqs"] == 1
    assert held["policyloop_engine_in_flight_output_tokens"] == engine.progress("counted") >= 3
    # The KV cache holds the wave's one row: its 5 prompt positions and every token decoded so far.
    assert held["sglang:num_used_tokens"] == 5 + engine.progress("counted")
    capacity = engine.scheduler.max_batch * engine.served.max_context
    assert held["sglang:token_usage"] == pytest.approx(held["sglang:num_used_tokens"] / capacity)
    load = await client.load()
    assert load is not None and (load.running_requests, load.kv_used_tokens) == (1, held["sglang:num_used_tokens"])
    await client.continue_generation()
    await asyncio.wait_for(task, 20)
    assert (await engine_metrics(client))["sglang:num_used_tokens"] == 0


async def test_pause_in_place_keeps_state(engine: EmbeddedEngine, client: SGLangClient) -> None:
    ids = prompt(7, 5)
    reference = await client.generate(greedy(ids, 200))
    task = await decoding(engine, client, "inplace", ids, 200)
    await client.pause_generation("in_place")
    held = engine.progress("inplace")
    await asyncio.sleep(0.2)
    assert engine.progress("inplace") == held and not task.done()
    await client.continue_generation()
    result = await asyncio.wait_for(task, 20)
    assert result.finish_reason == "length"
    assert result.output_ids == reference.output_ids
    assert result.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-5)


async def test_abort_request(engine: EmbeddedEngine, client: SGLangClient) -> None:
    victim = asyncio.create_task(client.generate(GenerateRequest(
        input_ids=prompt(8, 4), rid="victim", sampling_params=SamplingParams(max_new_tokens=240, temperature=0.0,
                                                                              ignore_eos=True))))
    bystander = asyncio.create_task(client.generate(greedy(prompt(8, 6), 60)))
    await wait_for(lambda: (engine.progress("victim") or 0) >= 2, what="decoding")
    await client.abort_request("victim")
    aborted = await asyncio.wait_for(victim, 10)
    assert aborted.rid == "victim" and aborted.finish_reason == "abort" and 2 <= len(aborted.output_ids) < 240
    finished = await asyncio.wait_for(bystander, 20)
    assert finished.finish_reason == "length" and len(finished.output_ids) == 60
    await client.abort_request("no-such-request")  # not an error, as in SGLang

    # A request still waiting (engine paused) is aborted with no tokens.
    await client.pause_generation("in_place")
    queued = asyncio.create_task(client.generate(GenerateRequest(input_ids=prompt(1, 3), rid="queued",
                                                                 sampling_params=SamplingParams(max_new_tokens=5))))
    await wait_for(lambda: engine.progress("queued") is not None, what="queued")
    await client.abort_request(abort_all=True)
    empty = await asyncio.wait_for(queued, 10)
    assert empty.finish_reason == "abort" and empty.output_ids == [] and empty.weight_version == "0"
    await client.continue_generation()


@pytest.mark.parametrize(("payload", "field", "status"), [
    # 422: FastAPI's validation of GenerateReqInput fails (a type SGLang's struct does not take).
    ({"input_ids": "12+3"}, "input_ids", 422),
    ({"input_ids": [4], "return_logprob": [1]}, "return_logprob", 422),
    ({"input_ids": [4], "rid": 7}, "rid", 422),
    # 400: SGLang refuses the values itself ({"error": {"message"}}), or the embedded engine does.
    ({"input_ids": [4, 5], "frobnicate": 1}, "frobnicate", 400),
    ({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}},
     "sampling_params.temprature", 400),
    ({"input_ids": [4, 999]}, "input_ids", 400),
    ({"input_ids": []}, "input_ids", 400),
    ({"input_ids": [[4], []]}, "input_ids", 400),  # a batch (SGLang's form) with an empty prompt
    ({"input_ids": [4], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", 400),
    ({"input_ids": [4], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", 400),
    ({"input_ids": [4], "sampling_params": {"max_new_tokens": 10_000}}, "sampling_params.max_new_tokens", 400),
    ({"input_ids": [4], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", 400),
    ({"input_ids": [4], "sampling_params": {"stop_token_ids": [1, "x"]}}, "sampling_params.stop_token_ids", 400),
    ({"input_ids": [4], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty", 400),
    ({"input_ids": [4], "sampling_params": {"stop": ["x", ""]}}, "sampling_params.stop[1]", 400),
    ({"input_ids": [[4], [5]], "stream": True}, "stream", 400),  # a batch is answered whole
])
async def test_invalid_generate_requests_get_sglangs_refusal_naming_the_field(
        engine: EmbeddedEngine, payload: dict, field: str, status: int) -> None:
    got, body = await post(engine.base_url + "/generate", payload)
    assert got == status, body
    assert (error_message(body) or "").startswith(field + ":"), body
    if status == 422:  # FastAPI's shape: where in the body, and why
        assert body["detail"][0]["loc"] == ["body", *field.split(".")]  # type: ignore[index]
    else:  # SGLang's _create_error_response
        assert set(body) == {"error"}  # type: ignore[arg-type]


async def test_invalid_control_requests_and_client_errors(engine: EmbeddedEngine, client: SGLangClient) -> None:
    status, body = await post(engine.base_url + "/pause_generation", {"mode": "sideways"})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "mode"]  # type: ignore[index]
    status, body = await post(engine.base_url + "/update_weights_from_disk", {"weight_version": "3"})
    assert status == 422 and (error_message(body) or "").startswith("model_path:")
    status, body = await post(engine.base_url + "/abort_request", {"rid": "x", "everything": True})
    assert status == 400 and (error_message(body) or "").startswith("everything:")
    async with aiohttp.ClientSession() as session, session.post(engine.base_url + "/generate", data=b"{nope") as r:
        assert r.status == 422 and (error_message(await r.json()) or "").startswith("body:")

    with pytest.raises(EngineError) as bad:
        await client.generate(GenerateRequest(input_ids=[4, 999]))
    assert bad.value.status == 400 and "input_ids: token ids [999]" in str(bad.value)
    await client.flush_cache()
    await client.pause_generation("retract")
    await client.continue_generation()


async def test_client_reports_an_unreachable_engine(engine: EmbeddedEngine) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with SGLangClient(f"http://127.0.0.1:{port}", timeout_s=2, retries=1, backoff_s=0.01) as dead:
        assert not await dead.health()
        with pytest.raises(EngineUnavailable):
            await dead.model_info()
        with pytest.raises(EngineUnavailable):
            await dead.generate(greedy([4], 2))


async def test_a_client_that_gives_up_aborts_its_request(engine: EmbeddedEngine) -> None:
    async with SGLangClient(engine.base_url, timeout_s=0.3, retries=0) as impatient:
        await impatient.pause_generation("in_place")  # the request cannot finish in time
        with pytest.raises(EngineUnavailable, match="timed out"):
            await impatient.generate(GenerateRequest(input_ids=[4, 5], rid="impatient",
                                                     sampling_params=SamplingParams(max_new_tokens=8)))
        await wait_for(lambda: engine.progress("impatient") is None, what="the request dropped")
        await impatient.continue_generation()


async def test_module_entry_point_serves_and_stops_on_sigterm(tiny_model: Path) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "policyloop.engines.embedded", "--model-path", str(tiny_model),
                             "--host", "127.0.0.1", "--port", str(port), "--max-batch", "8", "--threads", "1",
                             "--weight-version", "7"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout_s=30) as remote:
            await remote.wait_healthy(timeout_s=60)
            assert (await remote.model_info()).weight_version == "7"
            result = await remote.generate(greedy(prompt(1, 4), 3))
            assert len(result.output_ids) == 3 and result.weight_version == "7"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_batch_answer_that_does_not_match_its_requests_is_an_error() -> None:
    """A server that answers a batch with the wrong number of answers, or out of order, is caught."""
    from aiohttp import web

    from policyloop.engines.sglang_client import EngineProtocolError

    answers: list[object] = []

    async def generate(_: web.Request) -> web.Response:
        return web.json_response(answers)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    def answer(rid: str) -> dict[str, object]:
        return GenerateResult(rid=rid, output_ids=[4], output_logprobs=None, finish_reason="length",
                              weight_version="0", prompt_tokens=1, completion_tokens=1).to_json()

    requests = [GenerateRequest(input_ids=[4], rid="a"), GenerateRequest(input_ids=[5], rid="b")]
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout_s=10, retries=0) as client:
            answers[:] = [answer("a")]
            with pytest.raises(EngineProtocolError, match="a list of 2 answers"):
                await client.generate_batch(requests)
            answers[:] = [answer("b"), answer("a")]
            with pytest.raises(EngineProtocolError, match="rid 'a' came as 'b'"):
                await client.generate_batch(requests)
            answers[:] = [answer("a"), {"no": "meta_info"}]
            with pytest.raises(EngineProtocolError, match="unexpected answer"):
                await client.generate_batch(requests)
            answers[:] = [answer("a"), answer("b")]
            assert [r.rid for r in await client.generate_batch(requests)] == ["a", "b"]
    finally:
        await runner.cleanup()


async def test_a_streamed_generation_sends_everything_so_far_after_each_step_and_ends_with_the_answer(
        engine: EmbeddedEngine, client: SGLangClient) -> None:
    """SGLang's default streaming: server-sent events, each with every output id so far and
    finish_reason null, the last with the whole answer, then [DONE]; the tokens are the unstreamed ones."""
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    async with aiohttp.ClientSession() as session, session.post(engine.base_url + "/generate",
                                                                 json={**body, "stream": True}) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    whole = await client.generate(GenerateRequest.from_json(body))
    # Steps that finish while a chunk is being written go out together: fewer chunks, never a gap.
    sizes = [len(c["output_ids"]) for c in chunks]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 5 and len(chunks) >= 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole.output_ids and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["output_ids"] == whole.output_ids[:len(c["output_ids"])] for c in chunks)
    streamed = [event async for event in client.generate_stream(GenerateRequest.from_json(body))]
    assert streamed[-1].output_ids == whole.output_ids and streamed[-1].output_logprobs == whole.output_logprobs
    assert all(s.output_ids == whole.output_ids[:len(s.output_ids)] for s in streamed)


def test_an_engine_asked_for_cuda_without_a_gpu_refuses_to_start(tiny_model: Path) -> None:
    """`device=cuda` is a promise, as for the learner: never a silent CPU engine."""
    from policyloop.common.device import DeviceUnavailable

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceUnavailable, match="device=cuda was asked for"):
        EmbeddedEngine(tiny_model, device="cuda")
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        EmbeddedEngine(tiny_model, device="tpu")
    assert EmbeddedEngine(tiny_model, device="auto").served.device == torch.device("cpu")
