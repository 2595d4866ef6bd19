"""The OpenAI endpoint as agent frameworks use it, on a tiny random Qwen2 with the chat model's
byte-level tokenizer and chat template, over the embedded engine and a real NATS: tools rendered
into the prompt, tool results rendered back, n choices sampled together, stop strings, the exact
token ids for harnesses, agent sessions whose prompts continue the previous exchange's tokens, the
Responses API; and every hostile body a 4xx naming its field, never a 5xx. (What a trained chat
model does with tools — calls parsed into tool_calls, the Agents SDK end to end — is
test_agents.py's, on the bootstrap chat model.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from policyloop.bus import Bus
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.gateway.validation import validate_environment
from policyloop.models.chat_format import function_tool
from policyloop.models.chat_tokenizer import save_chat_tokenizer
from policyloop.models.tokenizer import load_tokenizer
from policyloop.serving.openai_api import MAX_BODY_BYTES
from policyloop.serving.traces import TracedExchange, environment_from_traces, export_sft, read_exchanges
from tests.helpers import openai_endpoint

openai = pytest.importorskip("openai")

SERVED = "tiny-chat"
ADD = function_tool("add", "Adds two integers.", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen2 on the chat tokenizer (its template included): what it says is noise,
    but every token of it goes through the same path as a trained model's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    directory = tmp_path_factory.mktemp("tiny-chat")
    save_chat_tokenizer(directory)
    tokenizer = load_tokenizer(directory)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, architectures=["Qwen2ForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


@pytest.fixture
async def served(chat_model_dir: Path, bus: Bus) -> AsyncIterator[tuple[str, Any, Any]]:
    async with openai_endpoint(chat_model_dir, bus, SERVED, weight_version="7") as endpoint:
        yield endpoint


async def read_exchanges_by_id(bus: Bus, model: str) -> dict[str, TracedExchange]:
    return {e.trace.trace_id: e for e in await read_exchanges(bus, model)}


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def engine_ids(engine: SGLangClient, prompt_ids: list[int], max_tokens: int, **params: Any) -> list[int]:
    result = await engine.generate(GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(
        max_new_tokens=max_tokens, **params)))
    return result.output_ids


@pytest.mark.timeout(180)
async def test_tools_and_tool_results_are_rendered_through_the_chat_template_and_recorded(
        served: tuple[str, SGLangClient, Any], bus: Bus) -> None:
    url, engine, tokenizer = served
    client = client_of(url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 47+38?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 47, "b": 38}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "85"},
    ]
    answer = await client.chat.completions.create(model=SERVED, messages=messages, tools=[ADD], max_tokens=8,
                                                  temperature=0, extra_body={"return_token_ids": True})
    as_template = [*messages[:2], {**messages[2], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 47, "b": 38}}}]},
        messages[3]]
    expected_prompt = tokenizer.apply_chat_template(as_template, tools=[ADD], add_generation_prompt=True,
                                                    tokenize=False)
    assert '"name": "add"' in expected_prompt and "<tool_response>\n85\n</tool_response>" in expected_prompt
    prompt_ids = tokenizer(expected_prompt, add_special_tokens=False).input_ids
    wire = answer.model_dump()
    assert wire["prompt_token_ids"] == prompt_ids
    assert wire["choices"][0]["token_ids"] == await engine_ids(engine, prompt_ids, 8, temperature=0.0)
    [exchange] = (await read_exchanges_by_id(bus, SERVED)).values()
    trace = exchange.trace
    assert list(trace.prompt_token_ids) == prompt_ids and json.loads(trace.tools_json) == [ADD]
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool"]
    assert trace.messages[2].tool_calls[0].name == "add" and trace.messages[3].tool_call_id == "call_1"
    # tool_choice "none": the tools are not offered at all.
    plain = await client.chat.completions.create(model=SERVED, messages=messages[:2], tools=[ADD], tool_choice="none",
                                                 max_tokens=2, temperature=0, extra_body={"return_token_ids": True})
    assert plain.model_dump()["prompt_token_ids"] == tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    await client.close()


@pytest.mark.timeout(180)
async def test_n_choices_are_sampled_together_and_stop_strings_cut_the_text_not_the_tokens(
        served: tuple[str, SGLangClient, Any], bus: Bus) -> None:
    url, engine, tokenizer = served
    client = client_of(url)
    ask = [{"role": "user", "content": "Say something."}]
    answer = await client.chat.completions.create(model=SERVED, messages=ask, n=3, max_tokens=6, temperature=1.0,
                                                  seed=11, extra_body={"return_token_ids": True})
    wire = answer.model_dump()
    assert [c["index"] for c in wire["choices"]] == [0, 1, 2]
    for i, choice in enumerate(wire["choices"]):  # choice i is the engine's sample with seed + i
        assert choice["token_ids"] == await engine_ids(engine, wire["prompt_token_ids"], 6, temperature=1.0,
                                                       sampling_seed=11 + i)
    assert answer.usage.completion_tokens == sum(len(c["token_ids"]) for c in wire["choices"])
    traces = await read_exchanges_by_id(bus, SERVED)
    response_id = answer.id.removeprefix("chatcmpl-")
    assert set(traces) == {response_id, f"{response_id}-1", f"{response_id}-2"}

    free = await client.chat.completions.create(model=SERVED, messages=ask, max_tokens=12, temperature=0,
                                                extra_body={"return_token_ids": True})
    text = free.choices[0].message.content or ""
    stop = text[3:5]
    assert len(text) >= 5, text
    cut = await client.chat.completions.create(model=SERVED, messages=ask, max_tokens=12, temperature=0,
                                               stop=[stop], extra_body={"return_token_ids": True})
    assert cut.choices[0].message.content == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    cut_trace = (await read_exchanges_by_id(bus, SERVED))[cut.id.removeprefix("chatcmpl-")].trace
    assert cut_trace.stop_matched == stop
    ids = cut.model_dump()["choices"][0]["token_ids"]
    assert list(cut_trace.response_token_ids) == ids == free.model_dump()["choices"][0]["token_ids"][:len(ids)]
    assert stop in tokenizer.decode(ids)  # the tokens keep what the text leaves out
    streamed = await client.chat.completions.create(model=SERVED, messages=ask, max_tokens=12, temperature=0,
                                                    stop=[stop], n=2, stream=True)
    by_choice: dict[int, str] = {}
    async for chunk in streamed:
        for choice in chunk.choices:
            by_choice[choice.index] = by_choice.get(choice.index, "") + (choice.delta.content or "")
    assert by_choice == {0: text[:text.find(stop)], 1: text[:text.find(stop)]}
    await client.close()


@pytest.mark.timeout(180)
async def test_a_sessions_next_prompt_continues_the_exact_tokens_of_its_last_exchange(
        served: tuple[str, SGLangClient, Any], bus: Bus, tmp_path: Path) -> None:
    """...and the session exports as one sequence whose model-written tokens (loss mask) are exactly
    the engine's, cut where the client rewrote history."""
    url, _, tokenizer = served
    client = client_of(url)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Hello there, how are you?"}]
    turns = []
    for follow_up in ("And then?", "Thanks!"):
        answer = await client.chat.completions.create(model=SERVED, messages=history, max_tokens=10, temperature=1.0,
                                                      seed=3, extra_headers={"X-Session-Id": "agent-run-1"},
                                                      extra_body={"return_token_ids": True})
        turns.append(answer.model_dump())
        history += [{"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": follow_up}]
    first, second = turns
    assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["choices"][0]["token_ids"])] == \
        first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    # The client rewrites history: the session goes on, but its export is cut there.
    rewritten = [{"role": "user", "content": "Hello, how are you?"}, *history[1:]]
    third = await client.chat.completions.create(model=SERVED, messages=rewritten, max_tokens=4, temperature=0,
                                                 extra_headers={"X-Session-Id": "agent-run-1"},
                                                 extra_body={"return_token_ids": True})
    traces = await read_exchanges_by_id(bus, SERVED)
    assert {t.trace.session_id for t in traces.values()} == {"agent-run-1"}

    written = export_sft(traces.values(), tmp_path / "sessions.jsonl")
    records = [json.loads(line) for line in (tmp_path / "sessions.jsonl").read_text().splitlines()]
    assert written == 2 and [(r["kind"], r["segment"], bool(r["broken_before"])) for r in records] == \
        [("session", 0, False), ("session", 1, True)]
    whole, cut = records
    wrote = [t for t in (first, second) for t in t["choices"][0]["token_ids"]]
    assert whole["token_ids"] == second["prompt_token_ids"] + second["choices"][0]["token_ids"]
    assert [t for t, m in zip(whole["token_ids"], whole["loss_mask"], strict=True) if m] == wrote
    assert len(whole["trace_ids"]) == 2 and cut["token_ids"] == third.model_dump()["prompt_token_ids"] + \
        third.model_dump()["choices"][0]["token_ids"]
    # Given as metadata, the same; a header and metadata that disagree are refused.
    with pytest.raises(openai.BadRequestError, match="differs from the X-Session-Id header"):
        await client.chat.completions.create(model=SERVED, messages=history[:1], max_tokens=1,
                                             metadata={"session_id": "b"}, extra_headers={"X-Session-Id": "a"})
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/feedback", json={
            "session_id": "agent-run-1", "reward": 1.0}) as response:
        assert response.status == 200 and (await response.json())["session_id"] == "agent-run-1"
    # Rewarded, the session is supervised data: its first prompt, then the rest to imitate where
    # the model wrote.
    env = environment_from_traces(await read_exchanges(bus, SERVED), "agent", "v1", min_reward=1.0,
                                  eval_fraction=0.0, supervised=True)
    validate_environment(env)
    task = next(t for t in env.tasks if t.metadata.get("segment") == "0")
    start = len(first["prompt_token_ids"])
    assert list(task.prompt_token_ids) == whole["token_ids"][:start]
    assert list(task.demonstration_token_ids) == whole["token_ids"][start:]
    assert [int(m) for m in task.demonstration_loss_mask] == whole["loss_mask"][start:]
    await client.close()


@pytest.mark.timeout(180)
async def test_the_responses_api_takes_items_and_function_call_outputs(
        served: tuple[str, SGLangClient, Any], bus: Bus) -> None:
    url, engine, tokenizer = served
    client = client_of(url)
    response = await client.responses.create(
        model=SERVED, instructions="Use the tools.", max_output_tokens=6, temperature=0,
        tools=[{"type": "function", "name": "add", "parameters": ADD["function"]["parameters"], "strict": True}],
        input=[{"role": "user", "content": "What is 2+3?"},
               {"type": "function_call", "call_id": "c9", "name": "add", "arguments": '{"a": 2, "b": 3}'},
               {"type": "function_call_output", "call_id": "c9", "output": "5"}])
    assert response.status in ("completed", "incomplete") and response.usage is not None
    trace = (await read_exchanges_by_id(bus, SERVED))[response.id.removeprefix("resp_")].trace
    assert trace.endpoint == "responses"
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool"]
    assert list(trace.response_token_ids) == await engine_ids(engine, list(trace.prompt_token_ids), 6,
                                                              temperature=0.0)
    text = "".join(part.text for item in response.output if item.type == "message" for part in item.content)
    assert text == trace.response_text
    await client.close()


@pytest.mark.timeout(180)
async def test_the_responses_api_streams_its_events_and_ends_with_the_whole_response(
        served: tuple[str, SGLangClient, Any], bus: Bus) -> None:
    url, _, _ = served
    client = client_of(url)
    ask = {"model": SERVED, "input": "Tell me something.", "max_output_tokens": 10, "temperature": 0,
           "tools": [{"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}]}
    whole = await client.responses.create(**ask)
    events = [event async for event in await client.responses.create(**ask, stream=True)]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    last = events[-1].response
    assert [item.type for item in last.output] == [item.type for item in whole.output]
    assert last.output_text == whole.output_text == "".join(
        event.delta for event in events if event.type == "response.output_text.delta")
    if whole.output_text:  # the message item opened, its text streamed, closed with the same id
        done = next(event for event in events if event.type == "response.output_item.done")
        assert done.item.id == last.output[0].id and done.item.content[0].text == whole.output_text
    streamed = (await read_exchanges_by_id(bus, SERVED))[last.id.removeprefix("resp_")].trace
    assert streamed.endpoint == "responses" and streamed.response_text == whole.output_text
    await client.close()


HUGE = "x" * (MAX_BODY_BYTES + 1)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("chat/completions", chat(messages=[{"role": "user", "content": HUGE}]), 413, "body"),
    ("chat/completions", chat(tools=[function_tool("deep", "", nested(40))]), 400, "tools[0].function.parameters"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "1+2?"}, {**CALL, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "1+2?"}, CALL,
                                        {"role": "tool", "tool_call_id": "c2", "content": "3"}]), 400,
     "messages[2].tool_call_id"),
    ("chat/completions", chat(tools=[ADD], tool_choice={"type": "function", "function": {"name": "mul"}}), 400,
     "tool_choice.function.name"),
    ("chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("chat/completions", chat(n=0), 400, "n"),
    ("chat/completions", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("chat/completions", chat(top_logprobs=5), 400, "top_logprobs"),
    ("chat/completions", chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages[0].content[0].type"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0]"),
    ("responses", {"model": SERVED, "input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("responses", {"model": SERVED, "input": "hi", "stream": "maybe"}, 400, "stream"),
    ("responses", {"model": SERVED, "input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ("responses", {"model": SERVED, "input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
    ("responses", {"model": SERVED, "input": "hi", "text": {"format": {"type": "json_schema"}}}, 400,
     "text.format.type"),
])
async def test_hostile_bodies_get_a_4xx_naming_the_field(served: tuple[str, SGLangClient, Any], route: str,
                                                         body: dict[str, Any], status: int, param: str) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/{route}", json=body) as response:
        answer = await response.json()
    assert response.status == status, answer
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(param), answer


async def test_a_body_nested_past_the_parsers_limit_is_a_400(served: tuple[str, SGLangClient, Any]) -> None:
    url, _, _ = served
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/chat/completions", data="[" * 100_000,
                                                          headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400 and (await response.json())["error"]["param"] == "body"
