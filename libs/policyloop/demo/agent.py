"""`policyloop demo --agent`: an agent's usage trains the agent, on this machine.

1. Serve: the chat bootstrap model (`policyloop bootstrap --chat`) behind the serving replica's
   OpenAI endpoint, as an OpenAI Agents SDK `Agent` with a `calculator` function tool.
2. Before: held-out arithmetic questions, one agent session each (greedy), measured through the
   endpoint: tool-call validity (the first call is `calculator` with the question's expression)
   and answer accuracy (the agent's final answer is the right number).
3. Usage: scripted agent traffic on training questions through the Agents SDK, sampled, each run
   an agent session (X-Session-Id) recorded with the engine's exact tokens, and feedback on each
   session (reward 1 when the call and the answer were right, else 0).
4. Learn: the rewarded sessions become a supervised environment (`env from-traces --supervised`:
   each session one sequence, trained where the model wrote, never on tool results), which a run
   trains on by cross-entropy through the cluster's learner; its last version is promoted and the
   serving replica loads it.
5. After: the same held-out questions through the endpoint, now answered by the promoted version.

It writes `summary.json` (the measures before and after with their 95% intervals, the traffic,
the run) and `agent.png`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import grpc
from rich.console import Console

from policyloop.bus import Bus
from policyloop.cluster.local import LocalCluster
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc
from policyloop.demo.loop import DemoConfig, require_healthy
from policyloop.demo.production import on_serving_cluster, train_demonstrations
from policyloop.envs.arithmetic import Problem
from policyloop.evaluation.scoring import wilson_interval
from policyloop.models.chat_tasks import QUESTIONS, calculate, calculator_call_correct, problems, text_correct
from policyloop.serving.traces import environment_from_traces, read_exchanges, session_segments

if TYPE_CHECKING:
    from policyloop.models.chat import ChatBootstrapConfig

AGENT_RUN = "agent"
"""The run whose promotions the serving replica follows; the Agents SDK's model name."""
INSTRUCTIONS = "You are a math assistant. Use the tools you are given to compute exact results."


@dataclass
class AgentDemoConfig:
    # The SFT run's: at 1e-4 (the learner's default), 8 passes over ~50 sessions raised held-out validity
    # and accuracy (4 passes did less; 1e-3 lowered validity).
    loop: DemoConfig = field(default_factory=lambda: DemoConfig(run_dir=Path("runs/demo-agent"), groups_per_step=8))
    traffic: int = 512              # agent sessions of scripted usage (training questions)
    traffic_temperature: float = 0.7  # sampled, yet right often enough to give sessions to learn from
    heldout: int = 96               # held-out questions measured before and after
    max_tokens: int = 48            # per model request of an agent run
    concurrency: int = 8            # agent sessions at once
    sft_epochs: int = 8             # the run trains this many times as many demonstrations as sessions kept
    sft_timeout_s: float = 600.0
    serve_timeout_s: float = 120.0  # the most the serving replica may take to load the promoted version


@dataclass
class AgentMeasure:
    """One pass of the held-out questions through the endpoint."""
    version: int = 0
    sessions: int = 0
    valid_calls: int = 0            # the first call is calculator with the question's expression
    right_answers: int = 0          # the final answer's last number is the result
    failed_runs: int = 0            # runs the SDK ended with an error (e.g. a turn cut by max_tokens)
    validity: float = 0.0
    validity_interval: tuple[float, float] = (0.0, 0.0)
    accuracy: float = 0.0
    accuracy_interval: tuple[float, float] = (0.0, 0.0)

    def close(self) -> None:
        total = max(1, self.sessions)
        self.validity, self.accuracy = self.valid_calls / total, self.right_answers / total
        self.validity_interval = wilson_interval(self.valid_calls, self.sessions)
        self.accuracy_interval = wilson_interval(self.right_answers, self.sessions)


@dataclass
class AgentDemoResult:
    before: AgentMeasure = field(default_factory=AgentMeasure)
    after: AgentMeasure = field(default_factory=AgentMeasure)
    traffic: AgentMeasure = field(default_factory=AgentMeasure)  # the usage, sampled: its rewards
    feedback: int = 0
    sessions_kept: int = 0          # rewarded sessions: the supervised environment's tasks
    demonstrations_trained: int = 0
    versions: tuple[int, int] = (0, 0)
    promoted: int = 0
    sft_seconds: float = 0.0


@dataclass
class AgentRun:
    """What one agent session did."""
    session_id: str
    problem: Problem
    expressions: list[str]
    output: str | None              # the final output; None when the run failed
    error: str = ""

    @property
    def valid_call(self) -> bool:
        return bool(self.expressions) and calculator_call_correct(self.expressions[0], self.problem)

    @property
    def right_answer(self) -> bool:
        """The final output's last number is the result (the run ended with an answer)."""
        return self.output is not None and text_correct(self.output, True, self.problem)


def question(problem: Problem, index: int) -> str:
    return QUESTIONS[index % len(QUESTIONS)].format(e=f"{problem.a} {problem.op} {problem.b}")


async def run_agent(client: Any, problem: Problem, index: int, *, temperature: float, max_tokens: int
                    ) -> AgentRun:
    """One agent session through the endpoint: the Agents SDK's Responses model, a calculator tool."""
    import agents

    expressions: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '12 + 7' and return the result."""
        expressions.append(expression)
        return str(calculate(expression))

    session_id = f"agent-{uuid.uuid4().hex[:12]}"
    settings = agents.ModelSettings(temperature=temperature, max_tokens=max_tokens,
                                    extra_headers={"X-Session-Id": session_id})
    agent = agents.Agent(name="calculator-agent", instructions=INSTRUCTIONS, tools=[calculator],
                         model=agents.OpenAIResponsesModel(AGENT_RUN, client), model_settings=settings)
    try:
        result = await agents.Runner.run(agent, question(problem, index), max_turns=3)
    except agents.exceptions.AgentsException as exc:  # a turn cut by max_tokens, too many turns
        return AgentRun(session_id, problem, expressions, None, type(exc).__name__)
    return AgentRun(session_id, problem, expressions, str(result.final_output))


async def run_agents(openai_url: str, chosen: list[Problem], config: AgentDemoConfig, *, temperature: float
                     ) -> list[AgentRun]:
    """One agent session per problem, `concurrency` at once (the Responses API has no seed: sampled
    usage differs from run to run)."""
    import agents
    import openai

    agents.set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=openai_url, api_key="unused", max_retries=2, timeout=300)
    gate = asyncio.Semaphore(config.concurrency)

    async def gated(index: int, problem: Problem) -> AgentRun:
        async with gate:
            return await run_agent(client, problem, index, temperature=temperature, max_tokens=config.max_tokens)

    try:
        return list(await asyncio.gather(*(gated(i, p) for i, p in enumerate(chosen))))
    finally:
        await client.close()


def measure(runs: list[AgentRun], version: int) -> AgentMeasure:
    result = AgentMeasure(version=version, sessions=len(runs), valid_calls=sum(r.valid_call for r in runs),
                          right_answers=sum(r.valid_call and r.right_answer for r in runs),
                          failed_runs=sum(r.output is None for r in runs))
    result.close()
    return result


async def served_version(openai_url: str) -> int:
    async with aiohttp.ClientSession() as http, http.post(f"{openai_url}/chat/completions", json={
            "model": AGENT_RUN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) as answer:
        answer.raise_for_status()
        return int((await answer.json())["system_fingerprint"].removeprefix("weights-"))


async def wait_served(openai_url: str, version: int, timeout_s: float) -> None:
    started = time.monotonic()
    while (now := await served_version(openai_url)) != version:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"the serving replica still serves v{now}, not the promoted v{version}, "
                               f"after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def give_feedback(openai_url: str, runs: list[AgentRun]) -> int:
    """Per session: reward 1 when the call and the answer were right, else 0."""
    async with aiohttp.ClientSession() as http:
        for run in runs:
            reward = 1.0 if run.valid_call and run.right_answer else 0.0
            async with http.post(f"{openai_url}/feedback", json={"session_id": run.session_id,
                                                                 "reward": reward}) as answer:
                answer.raise_for_status()
    return len(runs)


async def train_on_sessions(stub: loop_pb2_grpc.LoopServiceStub, env: loop_pb2.Environment,
                            config: AgentDemoConfig, result: AgentDemoResult, console: Console) -> int:
    """SFT on the rewarded sessions; returns the run's last version."""
    def announce(name: str, wanted: int) -> None:
        console.print(f"4. learn: {name}, {len(env.tasks)} rewarded sessions (each one sequence, trained where the "
                      f"model wrote); run {AGENT_RUN} trains {wanted} of them by cross-entropy")

    done = await train_demonstrations(stub, env, AGENT_RUN, epochs=config.sft_epochs, seed=config.loop.seed,
                                      timeout_s=config.sft_timeout_s, announce=announce)
    result.sft_seconds, result.demonstrations_trained, result.versions = done.seconds, done.demonstrations, \
        done.versions
    console.print(f"   {done.demonstrations} trained in {done.seconds} s (v{done.versions[0]} → v{done.versions[1]})")
    return done.versions[1]


def show(console: Console, label: str, m: AgentMeasure) -> None:
    console.print(f"{label} v{m.version}: tool-call validity {m.validity:.1%} [{m.validity_interval[0]:.1%}, "
                  f"{m.validity_interval[1]:.1%}], answer accuracy {m.accuracy:.1%} [{m.accuracy_interval[0]:.1%}, "
                  f"{m.accuracy_interval[1]:.1%}] on {m.sessions} sessions ({m.failed_runs} runs failed)")


async def drive(cluster: LocalCluster, config: AgentDemoConfig, console: Console) -> AgentDemoResult:
    loop = config.loop
    await require_healthy(cluster, loop.start_timeout_s)
    console.print("[green]the services are healthy[/green] (with a serving replica)")
    result = AgentDemoResult()
    openai_url = f"http://127.0.0.1:{cluster.process('serving-0').ports['openai']}/v1"
    heldout = problems(config.heldout, loop.seed, heldout=True)
    console.print(f"1. serve: the chat model as an Agents SDK agent with a calculator tool at {openai_url}")
    runs = await run_agents(openai_url, heldout, config, temperature=0.0)
    result.before = measure(runs, await served_version(openai_url))
    show(console, "2. before:", result.before)

    usage = await run_agents(openai_url, problems(config.traffic, loop.seed + 1, heldout=False), config,
                             temperature=config.traffic_temperature)
    result.traffic = measure(usage, result.before.version)
    result.feedback = await give_feedback(openai_url, usage)
    console.print(f"3. usage: {len(usage)} agent sessions (temperature {config.traffic_temperature}), "
                  f"{result.traffic.right_answers} rewarded; feedback on each")

    bus = await Bus.connect(cluster.nats_url, name="demo-agent")
    try:
        exchanges = await read_exchanges(bus, AGENT_RUN)
    finally:
        await bus.close()
    broken = [s for s in session_segments(exchanges) if s.broken_before]
    env = environment_from_traces(exchanges, "agent-sessions", "v1", min_reward=1.0, eval_fraction=0.0,
                                  supervised=True)
    result.sessions_kept = len(env.tasks)
    if not env.tasks:
        raise RuntimeError("no session of the usage was rewarded: nothing to learn from")
    if broken:
        console.print(f"   [yellow]{len(broken)} sessions broke token continuity[/yellow]")
    gateway = cluster.process("gateway-0").ports["grpc"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        last = await train_on_sessions(stub, env, config, result, console)
        promotion = await stub.PromoteVersion(loop_pb2.PromoteVersionRequest(
            run_id=AGENT_RUN, version=last, reason="SFT on the agent's rewarded sessions"), timeout=30)
        result.promoted = int(promotion.version)
    await wait_served(openai_url, result.promoted, config.serve_timeout_s)
    console.print(f"   promoted v{result.promoted}; the serving replica serves it")
    runs = await run_agents(openai_url, heldout, config, temperature=0.0)
    result.after = measure(runs, await served_version(openai_url))
    show(console, "5. after: ", result.after)
    return result


def write_plot(result: AgentDemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = ("tool-call validity", "answer accuracy")
    width = 0.35
    for offset, (label, m) in ((-width / 2, (f"before (v{result.before.version})", result.before)),
                               (width / 2, (f"after (v{result.after.version})", result.after))):
        values = (m.validity, m.accuracy)
        intervals = (m.validity_interval, m.accuracy_interval)
        ax.bar([i + offset for i in range(2)], values, width, label=label,
               yerr=[[v - lo for v, (lo, _) in zip(values, intervals, strict=True)],
                     [hi - v for v, (_, hi) in zip(values, intervals, strict=True)]], capsize=4)
    ax.set_xticks(range(2), names)
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"share of {result.before.sessions} held-out agent sessions (95% interval)")
    ax.set_title(f"policyloop demo --agent: SFT on {result.sessions_kept} rewarded sessions of "
                 f"{result.traffic.sessions}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_agent_demo(config: AgentDemoConfig, *, console: Console, bootstrap_config: ChatBootstrapConfig | None = None
                   ) -> int:
    from policyloop.models.bootstrap import bootstrap
    from policyloop.models.chat import CHAT_BOOTSTRAP

    loop = config.loop
    if loop.model_path is None:
        console.print("base model: the chat bootstrap model (built and cached after the first run) …")
        loop.model_path = bootstrap(bootstrap_config or CHAT_BOOTSTRAP)
    result = on_serving_cluster(loop, {}, AGENT_RUN, lambda cluster: drive(cluster, config, console), console=console,
                                what="a serving replica")
    out = loop.out or Path("runs") / "demo-agent"
    out.mkdir(parents=True, exist_ok=True)
    summary = asdict(result) | {"config": {
        "traffic": config.traffic, "traffic_temperature": config.traffic_temperature, "heldout": config.heldout,
        "max_tokens": config.max_tokens, "sft_epochs": config.sft_epochs, "lr": loop.lr,
        "groups_per_step": loop.groups_per_step, "model_path": str(loop.model_path)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_plot(result, out / "agent.png")
    console.print("[bold]summary[/bold]:")
    show(console, "  before", result.before)
    show(console, "  after ", result.after)
    console.print(f"  usage: {result.traffic.sessions} sessions, {result.sessions_kept} rewarded and trained on "
                  f"({result.demonstrations_trained} demonstrations, v{result.versions[0]} → v{result.versions[1]})")
    console.print(f"wrote {out / 'summary.json'} and {out / 'agent.png'}")
    return 0 if result.after.version == result.promoted and result.sessions_kept > 0 else 1
