"""The serving endpoint driven by the official `openai` client, over the embedded engine and a
real NATS: chat and text completions answer with what the engine produced, every exchange is a
trace on TRACES with the engine's exact token ids and weights version, feedback attaches to a
response by its id, and the export writes them as training data. On the bootstrap model (a
context of 64 tokens, a character vocabulary): a request without max_tokens gets the room its
prompt leaves, and what does not fit, or what the tokenizer cannot represent, is a 400 naming the
field, before any streamed answer begins."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from policyloop.bus import Bus
from policyloop.engines.embedded import EmbeddedEngine, start_engine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.gateway.validation import validate_environment
from policyloop.models.tokenizer import load_tokenizer
from policyloop.serving.openai_api import OpenAIApi
from policyloop.serving.traces import environment_from_traces, export_sft, read_exchanges
from tests.helpers import serving_http

openai = pytest.importorskip("openai")

SERVED = "tiny-arith"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def with_chat_template(model_dir: Path, directory: Path) -> Path:
    """A copy of the model with a chat template in its tokenizer config (the model directory's own)."""
    shutil.copytree(model_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture
def chat_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return with_chat_template(tiny_model_dir, tmp_path / "chat-model")


@pytest.fixture
async def engine(chat_model_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    running = await start_engine(chat_model_dir, max_batch=8, threads=1, weight_version="3")
    yield running
    await running.stop()


@pytest.fixture
async def endpoint(engine: EmbeddedEngine, chat_model_dir: Path, bus: Bus) -> AsyncIterator[tuple[str, SGLangClient]]:
    from transformers import AutoTokenizer

    client = SGLangClient(engine.base_url, timeout_s=60, retries=0)
    api = OpenAIApi(client, AutoTokenizer.from_pretrained(chat_model_dir), bus, SERVED)
    async with serving_http(api.app()) as url:
        yield url, client
    await client.close()


async def greedy_ids(engine: SGLangClient, prompt_ids: list[int], max_tokens: int) -> list[int]:
    result = await engine.generate(GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(
        max_new_tokens=max_tokens, temperature=0.0)))
    return result.output_ids


@pytest.mark.timeout(180)
async def test_the_openai_client_gets_the_engines_tokens_and_every_exchange_becomes_training_data(
        endpoint: tuple[str, SGLangClient], chat_model_dir: Path, bus: Bus, nats_server, tmp_path: Path  # type: ignore[no-untyped-def]
        ) -> None:
    from transformers import AutoTokenizer

    url, engine = endpoint
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == [SERVED]

    chat = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "12+34="}],
                                                max_tokens=4, temperature=0, logprobs=True)
    text = await client.completions.create(model=SERVED, prompt="5+6=", max_tokens=3, temperature=0, logprobs=0)
    chat_prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}],
                                                          add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False).input_ids
    chat_ids = await greedy_ids(engine, list(chat_prompt), 4)
    text_ids = await greedy_ids(engine, tokenizer("5+6=", add_special_tokens=False).input_ids, 3)
    assert chat.choices[0].message.content == tokenizer.decode(chat_ids, skip_special_tokens=True)
    assert [c.token for c in chat.choices[0].logprobs.content] == [tokenizer.decode([t]) for t in chat_ids]
    assert text.choices[0].text == tokenizer.decode(text_ids, skip_special_tokens=True)
    assert chat.system_fingerprint == "weights-3" and chat.usage.completion_tokens == len(chat_ids)

    # New weights: the next trace records the version that made its tokens.
    await engine.update_weights_from_disk(str(chat_model_dir), weight_version="4")
    later = await client.completions.create(model=SERVED, prompt="7+8=", max_tokens=2, temperature=0)

    async with aiohttp.ClientSession() as http:
        async def feedback(body: dict) -> tuple[int, dict]:  # type: ignore[type-arg]
            async with http.post(f"{url}/v1/feedback", json=body) as answer:
                return answer.status, await answer.json()

        assert (await feedback({"id": chat.id, "reward": 1.0, "label": "good"}))[0] == 200
        assert (await feedback({"id": text.id, "reward": 0.0, "correction": "11"}))[0] == 200
        status, refused = await feedback({"id": "chatcmpl-nope", "reward": 1.0})
        assert status == 404 and refused["error"]["param"] == "id"
        assert (await feedback({"id": later.id}))[1]["error"]["message"] == "give a reward, a label or a correction"

    # Refusals in OpenAI's shape, which the client raises.
    with pytest.raises(openai.NotFoundError, match="this endpoint serves"):
        await client.completions.create(model="other", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 8"):
        await client.completions.create(model=SERVED, prompt="1+1=", max_tokens=2, n=9)

    chunks = await check_streaming(client, tokenizer, chat_ids, chat.choices[0].finish_reason, text.choices[0].text)

    exchanges = await read_exchanges(bus, SERVED)
    by_id = {e.trace.trace_id: e for e in exchanges}
    assert len(exchanges) == 5
    streamed_trace = by_id[chunks[0].id.removeprefix("chatcmpl-")].trace
    assert list(streamed_trace.response_token_ids) == chat_ids and streamed_trace.weights_version == "4"
    assert list(streamed_trace.prompt_token_ids) == list(chat_prompt)
    chat_trace = by_id[chat.id.removeprefix("chatcmpl-")].trace
    assert list(chat_trace.prompt_token_ids) == list(chat_prompt) and list(chat_trace.response_token_ids) == chat_ids
    assert chat_trace.weights_version == "3" and [m.content for m in chat_trace.messages] == ["12+34="]
    assert by_id[later.id.removeprefix("cmpl-")].trace.weights_version == "4"

    written = export_sft(exchanges, tmp_path / "sft.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert written == 5 and [line["trace_id"] for line in lines] == [e.trace.trace_id for e in exchanges]
    rewarded = {line["trace_id"]: line for line in lines}
    assert rewarded[chat_trace.trace_id]["reward"] == 1.0 and rewarded[chat_trace.trace_id]["response_token_ids"] \
        == chat_ids
    assert rewarded[text.id.removeprefix("cmpl-")]["feedback"][0]["correction"] == "11"
    assert export_sft(exchanges, tmp_path / "best.jsonl", min_reward=0.5) == 1

    await check_environment(exchanges, text.id.removeprefix("cmpl-"), later.id.removeprefix("cmpl-"), tokenizer,
                            nats_server.url, tmp_path)
    await client.close()
    await asyncio.sleep(0)


async def check_streaming(client, tokenizer, chat_ids: list[int], finish_reason: str,  # type: ignore[no-untyped-def]
                          text: str) -> list:  # type: ignore[type-arg]
    """Streamed, the chunks add up to what the engine produced, as the unstreamed answers did;
    returns the chat's chunks."""
    streamed = await client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "12+34="}], max_tokens=4, temperature=0, logprobs=True,
        stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in streamed]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_logprobs = [lp.token for c in chunks if c.choices and c.choices[0].logprobs
                         for lp in c.choices[0].logprobs.content]
    assert content == tokenizer.decode(chat_ids, skip_special_tokens=True)
    assert streamed_logprobs == [tokenizer.decode([t]) for t in chat_ids]
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish_reason
    assert chunks[-1].usage.completion_tokens == len(chat_ids) and chunks[-1].system_fingerprint == "weights-4"
    text_stream = await client.completions.create(model=SERVED, prompt="5+6=", max_tokens=3, temperature=0,
                                                  stream=True)
    assert "".join(c.choices[0].text for c in [c async for c in text_stream]) == text
    return chunks


async def check_environment(exchanges: list, corrected_id: str, unrated_id: str, tokenizer,  # type: ignore[no-untyped-def]
                            nats_url: str, tmp_path: Path) -> None:
    """The traces as an RL environment: each prompt's exact ids, judged against its recorded outcome;
    and the CLI reading the same traces."""
    env = environment_from_traces(exchanges, "served", "v1", min_reward=0.5, eval_fraction=0.0)
    answers = {task.metadata["trace_id"]: task for task in env.tasks}
    corrected = answers[corrected_id]
    assert corrected.answer == "11" and corrected.metadata["weights_version"] == "3"  # the correction
    assert list(corrected.prompt_token_ids) == tokenizer("5+6=", add_special_tokens=False).input_ids
    assert unrated_id not in answers  # no feedback: no outcome to learn from
    validate_environment(env)
    held_out = environment_from_traces(exchanges, "served", "v1", min_reward=0.5, eval_fraction=1.0)
    assert not held_out.tasks and len(held_out.eval_tasks) == len(env.tasks)

    exported = await cli("traces", "export", "--model", SERVED, "--to", str(tmp_path / "cli.jsonl"),
                         "--nats-url", nats_url)
    assert exported.returncode == 0 and len((tmp_path / "cli.jsonl").read_text().splitlines()) == len(exchanges)
    nothing = await cli("env", "from-traces", "--model", "never-served", "--name", "x", "--nats-url", nats_url,
                        "--gateway", "127.0.0.1:1")
    assert nothing.returncode == 1 and "no trace of never-served has an outcome" in nothing.stdout


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "policyloop", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode or 0, out.decode(), "")


# -- limits, on the bootstrap model: what agent frameworks send ---------------------------------

@pytest.fixture(scope="module")
def bootstrap_model_dir() -> Path:
    from policyloop.models.bootstrap import bootstrap

    return bootstrap()  # cached after the first build


@pytest.fixture
async def bootstrap_endpoint(bootstrap_model_dir: Path, tmp_path: Path, bus: Bus
                             ) -> AsyncIterator[tuple[openai.AsyncOpenAI, SGLangClient, int]]:
    """The endpoint on the bootstrap model (with a chat template), its tokenizer loaded as the
    serving replica loads it: the caller, the engine and the model's context length."""
    model_dir = with_chat_template(bootstrap_model_dir, tmp_path / "bootstrap-chat")
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    running = await start_engine(model_dir, max_batch=4, threads=1)
    engine = SGLangClient(running.base_url, timeout_s=60, retries=0)
    api = OpenAIApi(engine, load_tokenizer(model_dir), bus, SERVED)
    async with serving_http(api.app()) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield client, engine, context
        await client.close()
    await engine.close()
    await running.stop()


async def complete(client: openai.AsyncOpenAI, stream: bool, chat: bool, text: str, **fields: object) -> str:
    """The answer's text, from one request of either route, streamed or not."""
    if chat:
        answer = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": text}],
                                                      temperature=0, stream=stream, **fields)  # type: ignore[call-overload]
        if stream:
            return "".join([c.choices[0].delta.content or "" async for c in answer if c.choices])
        return answer.choices[0].message.content or ""
    if "max_completion_tokens" in fields:  # the client's completions() has no such argument
        fields = {"extra_body": {"max_completion_tokens": fields.pop("max_completion_tokens")}, **fields}
    answer = await client.completions.create(model=SERVED, prompt=text, temperature=0, stream=stream,
                                             **fields)  # type: ignore[call-overload]
    if stream:
        return "".join([c.choices[0].text async for c in answer])
    return answer.choices[0].text


ROUTES = [(stream, chat) for stream in (False, True) for chat in (False, True)]


@pytest.mark.timeout(180)
async def test_without_max_tokens_the_answer_gets_the_room_its_prompt_leaves(
        bootstrap_endpoint: tuple[openai.AsyncOpenAI, SGLangClient, int], bootstrap_model_dir: Path) -> None:
    client, engine, context = bootstrap_endpoint
    tokenizer = load_tokenizer(bootstrap_model_dir)
    prompt = "12+34="
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    expected = tokenizer.decode(await greedy_ids(engine, prompt_ids, context - len(prompt_ids)),
                                skip_special_tokens=True)
    assert expected  # the bootstrap model answers something
    for stream, chat in ROUTES:  # the chat template adds nothing: the same prompt either way
        assert await complete(client, stream, chat, prompt) == expected, (stream, chat)

    # One token of room: one token of answer, however long the model would go on. (The spaces
    # are in the vocabulary: each is a token.)
    padded = " " * (context - 1 - len(prompt)) + prompt
    tight = await client.completions.create(model=SERVED, prompt=padded, temperature=0)
    assert tight.usage.prompt_tokens == context - 1 and tight.usage.completion_tokens == 1


@pytest.mark.timeout(180)
async def test_what_overflows_the_context_is_a_400_naming_the_field_before_any_answer(
        bootstrap_endpoint: tuple[openai.AsyncOpenAI, SGLangClient, int]) -> None:
    client, _, context = bootstrap_endpoint
    cases = [  # (the prompt, the fields, the field named)
        ("1" * context, {}, None),  # fills the context: no room for a completion
        ("1" * (context + 5), {"max_tokens": 1}, None),
        ("12+34=", {"max_tokens": context}, "max_tokens"),
        ("12+34=", {"max_completion_tokens": context - 5}, "max_completion_tokens"),
    ]
    for prompt, fields, param in cases:
        for stream, chat in ROUTES:
            # Raised by create() itself: for a stream, the 400 came instead of the 200, not after it.
            with pytest.raises(openai.BadRequestError) as refused:
                await complete(client, stream, chat, prompt, **fields)
            named = param or ("messages" if chat else "prompt")
            assert (refused.value.code, refused.value.param) == ("context_length_exceeded", named), (prompt, fields)
            assert f"maximum context length is {context} tokens" in refused.value.message

    # What fits exactly is served.
    fits = await client.completions.create(model=SERVED, prompt="12+34=", max_tokens=context - 6, temperature=0)
    assert fits.usage.prompt_tokens == 6 and fits.choices[0].text

    # OpenAI's error shape, and the status before any event.
    async with aiohttp.ClientSession() as http, http.post(f"{client.base_url}chat/completions", json={
            "model": SERVED, "messages": [{"role": "user", "content": "1" * context}], "stream": True}) as answer:
        body = await answer.json()
        assert answer.status == 400 and answer.content_type == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.timeout(180)
async def test_what_the_tokenizer_cannot_represent_is_refused_not_dropped(
        bootstrap_endpoint: tuple[openai.AsyncOpenAI, SGLangClient, int]) -> None:
    client, _, _ = bootstrap_endpoint
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+34="}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=3,  # type: ignore[arg-type]
                                                 stream=stream)
        assert refused.value.param == "messages[0].content"
        assert "'A', 'd', '.'" in refused.value.message  # which characters, each once
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=SERVED, prompt="12+34=?", max_tokens=3, stream=stream)
        assert refused.value.param == "prompt" and "'?'" in refused.value.message
        # Token ids the model has no embedding for: refused before the engine sees them.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=SERVED, prompt=[10**6], max_tokens=2, stream=stream)
        assert refused.value.param == "prompt" and "vocabulary" in refused.value.message

    # The tokenizer's own added tokens, written as text, are known: served.
    served = await client.completions.create(model=SERVED, prompt="<tools>12+34=", max_tokens=2, temperature=0)
    assert served.usage.prompt_tokens == 7
