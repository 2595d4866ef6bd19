"""The official OpenAI Agents SDK drives the chat bootstrap model (MODULE_MODELS) through the
serving endpoint: an Agent with a Python function tool gets a question, the model calls the
tool, the SDK runs it and sends its result back, the model answers. Each run is an agent session
(X-Session-Id) whose exchanges export as one token sequence, and the tokens the model wrote are
exactly the engine's greedy tokens for the prompts it read. The same agent streamed, over the
Responses API's events or Chat Completions' chunks, makes the same calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from policyloop.bus import Bus
from policyloop.demo import agent as demo_agent
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.gateway.feeding import demonstration
from policyloop.gateway.validation import validate_environment
from policyloop.models.chat_tasks import calculate, problems
from policyloop.serving.traces import environment_from_traces, read_exchanges, session_segments
from tests.conftest import prebuilt_model
from tests.helpers import openai_endpoint

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

SERVED = "chat-agent"
INSTRUCTIONS = "You are a math assistant. Use the tools you are given to compute exact results."
MAX_TOKENS = 48
# A run whose reply ran out of max_tokens (the small model sometimes rambles instead of calling the
# tool): the Responses API ends it `incomplete`, which the SDK raises; Chat Completions hands the
# cut text on as the output.
TRUNCATED = "<reply cut at max_tokens>"


@dataclass
class Calls:
    """What the agent's tool was asked, in order."""
    expressions: list[str] = field(default_factory=list)


def calculator_agent(model: Any, calls: Calls, session_id: str) -> Any:
    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '12 + 7' and return the result."""
        calls.expressions.append(expression)
        return str(calculate(expression))

    return agents.Agent(name="calculator-agent", instructions=INSTRUCTIONS, tools=[calculator], model=model,
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS,
                                                            extra_headers={"X-Session-Id": session_id}))


@pytest.fixture(scope="module")
def chat_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "chat")


@pytest.fixture
async def served(chat_dir: Path, bus: Bus) -> AsyncIterator[tuple[str, Any]]:
    agents.set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers
    async with openai_endpoint(chat_dir, bus, SERVED) as (url, engine, _tokenizer):
        yield url, engine


@pytest.fixture
async def served_as_demo(chat_dir: Path, bus: Bus) -> AsyncIterator[tuple[str, Any]]:
    """The endpoint under the demo's model name (the run whose promotions a serving replica follows)."""
    async with openai_endpoint(chat_dir, bus, demo_agent.AGENT_RUN) as (url, _engine, tokenizer):
        yield url, tokenizer


QUESTIONS = [f"What is {p.a} {p.op} {p.b}?" for p in problems(6, 17, heldout=True)]


async def run_agents(url: str, api: str, *, streamed: bool) -> dict[str, tuple[list[str], str]]:
    """Each question to a fresh agent session: session id -> (the tool's calls, the final output)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(SERVED, client) if api == "responses" else \
        agents.OpenAIChatCompletionsModel(SERVED, client)
    done = {}
    for number, question in enumerate(QUESTIONS):
        calls, session_id = Calls(), f"{api}-{'streamed' if streamed else 'whole'}-{number}"
        agent = calculator_agent(model, calls, session_id)
        try:
            if streamed:
                run = agents.Runner.run_streamed(agent, question, max_turns=3)
                async for _ in run.stream_events():
                    pass
            else:
                run = await agents.Runner.run(agent, question, max_turns=3)
        except agents.exceptions.ModelBehaviorError as exc:
            if "max_output_tokens" not in str(exc):
                raise
            done[session_id] = (calls.expressions, TRUNCATED)
            continue
        done[session_id] = (calls.expressions, str(run.final_output))
    await client.close()
    return done


@pytest.mark.timeout(300)
async def test_an_agent_calls_its_tool_reads_the_result_and_answers_with_exact_tokens_recorded(
        served: tuple[str, Any], bus: Bus) -> None:
    url, engine = served
    done = await run_agents(url, "responses", streamed=False)
    called = {sid: run for sid, run in done.items() if run[0]}
    # The model calls the tool on most questions, and some of its calls are followed by an answer
    # that states the tool's result (the rest of its imperfection is what training is for).
    assert len(called) >= len(QUESTIONS) // 2, done
    answered = [sid for sid, (expressions, output) in called.items() if str(calculate(expressions[-1])) in output]
    assert answered, done

    exchanges = await read_exchanges(bus, SERVED)
    segments = {s.session_id: s for s in session_segments(exchanges)}
    assert set(segments) == set(done) and all(s.index == 0 for s in segments.values())
    for sid, (expressions, _) in done.items():
        segment = segments[sid]
        # One model request per call plus the answer; each prompt continues the last exchange's tokens.
        assert len(segment.exchanges) == len(expressions) + 1
        last = segment.exchanges[-1].trace
        assert segment.token_ids == list(last.prompt_token_ids) + list(last.response_token_ids)
        wrote = [t for e in segment.exchanges for t in e.trace.response_token_ids]
        assert [t for t, m in zip(segment.token_ids, segment.loss_mask, strict=True) if m] == wrote
        for exchange in segment.exchanges:  # the engine's own greedy tokens for the prompt it read
            trace = exchange.trace
            again = await engine.generate(GenerateRequest(input_ids=list(trace.prompt_token_ids), sampling_params=
                                                          SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)))
            assert list(trace.response_token_ids) == again.output_ids
        if expressions:
            first = segment.exchanges[0].trace
            assert [c.name for c in first.response_tool_calls] == ["calculator"]
            assert [m.role for m in last.messages][-2:] == ["assistant", "tool"]
            assert last.messages[-1].content == str(calculate(expressions[0]))


@pytest.mark.timeout(300)
async def test_the_same_agent_streamed_makes_the_same_calls(served: tuple[str, Any]) -> None:
    """Runner.run_streamed over the Responses API (its events) and over Chat Completions (tool
    calls as delta.tool_calls chunks): the same calls and answers as the whole responses."""
    url, _ = served
    whole = await run_agents(url, "responses", streamed=False)
    assert any(expressions for expressions, _ in whole.values())
    finished = [number for number, (_, (_, output)) in enumerate(sorted(whole.items())) if output != TRUNCATED]
    assert len(finished) >= len(QUESTIONS) // 2, whole
    for api in ("responses", "chat"):
        streamed = [run for _, run in sorted((await run_agents(url, api, streamed=True)).items())]
        runs = [run for _, run in sorted(whole.items())]
        assert [calls for calls, _ in streamed] == [calls for calls, _ in runs], api
        # A cut reply's text is the SDK's to raise or hand on: the outputs of the others are the same.
        assert [streamed[n] for n in finished] == [runs[n] for n in finished], api


@pytest.mark.timeout(300)
async def test_the_agent_demos_usage_becomes_one_demonstration_per_rewarded_session(
        served_as_demo: tuple[str, Any], bus: Bus) -> None:
    """What `policyloop demo --agent` does between its measures, in one process: agent sessions
    through the endpoint, judged and given feedback per session; the rewarded ones are a
    supervised environment the gateway accepts, each session one demonstration trained where the
    model wrote (its calls and answers), never on the instructions, questions or tool results."""
    url, tokenizer = served_as_demo
    config = demo_agent.AgentDemoConfig(concurrency=4)
    chosen = problems(24, 5, heldout=False)
    runs = await demo_agent.run_agents(f"{url}/v1", chosen, config, temperature=0.0)  # greedy: the same every run
    usage = demo_agent.measure(runs, version=0)
    assert usage.sessions == 24 and usage.right_answers <= usage.valid_calls
    assert usage.validity_interval[0] <= usage.validity <= usage.validity_interval[1]
    for run, problem in zip(runs, chosen, strict=True):  # the demo's judgement, by hand
        assert run.valid_call == (bool(run.expressions) and run.expressions[0].replace(" ", "") ==
                                  f"{problem.a}{problem.op}{problem.b}")
    assert await demo_agent.give_feedback(f"{url}/v1", runs) == 24

    exchanges = await read_exchanges(bus, demo_agent.AGENT_RUN)
    rewarded = {r.session_id for r in runs if r.valid_call and r.right_answer}
    segments = {(s.session_id, s.index): s for s in session_segments(exchanges)}
    assert {sid for sid, _ in segments} == {r.session_id for r in runs}
    env = environment_from_traces(exchanges, "agent-sessions", "v1", min_reward=1.0, eval_fraction=0.0,
                                  supervised=True)
    validate_environment(env)
    # Each segment of a rewarded session is a task (a session whose continuity broke gives two).
    kept = {(t.metadata["session_id"], int(t.metadata["segment"])) for t in env.tasks}
    assert env.tasks and kept == {key for key in segments if key[0] in rewarded}
    trained_by_session: dict[str, str] = {}
    for index, task in enumerate(env.tasks):
        segment = segments[task.metadata["session_id"], int(task.metadata["segment"])]
        assert list(task.prompt_token_ids) + list(task.demonstration_token_ids) == segment.token_ids
        trajectory = demonstration(demo_agent.AGENT_RUN, env.name, task, index)
        pairs = list(zip(trajectory.response_token_ids, trajectory.loss_mask, strict=True))
        trained, untrained = (tokenizer.decode([t for t, m in pairs if m == kind]) for kind in (True, False))
        assert trajectory.supervised and demo_agent.INSTRUCTIONS not in trained and "<tool_response>" not in trained
        assert "<tool_response>" in untrained or segment.index > 0  # a segment after a break starts past it
        trained_by_session[segment.session_id] = trained_by_session.get(segment.session_id, "") + trained
    assert all("<tool_call>" in text and "The answer is" in text for text in trained_by_session.values())
