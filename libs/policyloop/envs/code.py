"""Scorers that run code, always in the sandbox: unit tests of a completion, and a team's own
reward code. The reward service builds a SandboxJob here, the sandbox service runs it, and the
result is turned back into (reward, breakdown) here; no submitted or generated code ever runs in
the reward service's own process.

Unit tests. The completion (after the task's `solution_prefix`, e.g. a function signature) is
`solution.py`; the environment's `test_code` plus the task's own `tests` are `tests.py`, whose
`test_*` functions call the functions `solution.py` defines (and see its plain-data constants).
The reward is the fraction of tests that pass; a solution that does not load, the tests that
timed out or crashed, and the limit that stopped the job are in the breakdown.

Reward code. The team's source defines `reward(prompt, completion, metadata)` returning a
number (or a (number, detail) pair); it runs with the trajectory on its stdin. A crash, a
timeout or a non-finite value gives reward 0 with the reason in the breakdown.

The tests run in the harness's process and the solution in a child process, with plain data
between them (policyloop/envs/unit_test_harness.py): the report, its nonce and the tests are
out of the solution's reach, a test's share of the time budget bounds each call, and a solution
that times out or crashes fails that test and is started again for the next. Tests are the
top-level `def test_*` functions of tests.py (each name once); the gateway refuses test code
without any (`test_functions`).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.trajectories import answer_text

UNIT_TESTS, REWARD_CODE = "unit_tests", "reward_code"
DEFAULT_TIMEOUT_S = 10.0

TEST_HARNESS = (Path(__file__).parent / "unit_test_harness.py").read_bytes()
# Time for the job's own start (bwrap, two interpreters) and report, beyond the tests' budget.
START_MARGIN_S = 2.0

REWARD_FUNCTION = "reward"  # what reward code defines; the harness calls it (the gateway checks it is there)

_REWARD_HARNESS = r'''
import json, sys
nonce = sys.stdin.readline().strip()
args = json.loads(sys.stdin.readline())
namespace = {"__name__": "reward_code"}
exec(compile(open("reward.py").read(), "reward.py", "exec"), namespace)
value = namespace[REWARD_FUNCTION](args["prompt"], args["completion"], args["metadata"])
detail = ""
if isinstance(value, (tuple, list)):
    value, detail = value[0], str(value[1])
sys.stdout.write("\n" + nonce + " " + json.dumps({"reward": float(value), "detail": detail[:500]}) + "\n")
'''.replace("REWARD_FUNCTION", repr(REWARD_FUNCTION))


@dataclass(frozen=True)
class CodeJob:
    job: bus_pb2.SandboxJob
    nonce: str


def is_code_scorer(traj: bus_pb2.Trajectory) -> bool:
    return traj.metadata.get("scorer") in (UNIT_TESTS, REWARD_CODE)


def scorer_metadata(env: loop_pb2.Environment) -> dict[str, str]:
    """What a Task of `env` must carry for the reward service to build its sandbox job."""
    scorer = env.WhichOneof("scorer")
    if scorer == UNIT_TESTS:
        return {"scorer": UNIT_TESTS, "test_code": env.unit_tests.test_code,
                "timeout_seconds": repr(env.unit_tests.timeout_seconds or DEFAULT_TIMEOUT_S)}
    if scorer == REWARD_CODE:
        return {"scorer": REWARD_CODE, "reward_source": env.reward_code.source,
                "timeout_seconds": repr(env.reward_code.timeout_seconds or DEFAULT_TIMEOUT_S)}
    raise ValueError(f"{scorer!r} is not a code scorer")


def sandbox_job(traj: bus_pb2.Trajectory) -> CodeJob:
    """The job that scores `traj` (its metadata names the scorer, as the gateway wrote it)."""
    metadata = dict(traj.metadata)
    nonce = secrets.token_hex(16)
    timeout = float(metadata.get("timeout_seconds", DEFAULT_TIMEOUT_S))
    limits = bus_pb2.SandboxLimits(wall_seconds=timeout, cpu_seconds=timeout, max_output_bytes=256 * 1024)
    if metadata.get("scorer") == UNIT_TESTS:
        solution = metadata.get("solution_prefix", "") + answer_text(traj)
        tests = metadata.get("test_code", "") + "\n" + metadata.get("tests", "") + "\n"
        files = {"solution.py": solution.encode(), "tests.py": tests.encode(), "harness.py": TEST_HARNESS}
        stdin = nonce + "\n" + json.dumps({"budget_s": timeout}) + "\n"
        limits.wall_seconds = limits.cpu_seconds = timeout + START_MARGIN_S
    elif metadata.get("scorer") == REWARD_CODE:
        files = {"reward.py": metadata.get("reward_source", "").encode(), "harness.py": _REWARD_HARNESS.encode()}
        call = {"prompt": traj.prompt_text, "completion": answer_text(traj),
                "metadata": {k: v for k, v in metadata.items() if k not in ("reward_source", "test_code")}}
        stdin = nonce + "\n" + json.dumps(call) + "\n"
    else:
        raise ValueError(f"metadata.scorer: {metadata.get('scorer')!r} is not a code scorer")
    job = bus_pb2.SandboxJob(job_id=f"score:{traj.trajectory_id}", run_id=traj.run_id, files=files,
                             command=["python3", "-I", "harness.py"], stdin=stdin.encode(), limits=limits)
    return CodeJob(job, nonce)


def _component(name: str, value: float, weight: float, detail: str) -> bus_pb2.RewardComponent:
    return bus_pb2.RewardComponent(name=name, value=value, weight=weight, detail=detail)


def _reported(result: bus_pb2.SandboxResult, nonce: str) -> dict | None:
    """The harness's report (the line after the nonce), or None when there is none."""
    for line in reversed(result.stdout.decode(errors="replace").splitlines()):
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None


def _stopped(result: bus_pb2.SandboxResult) -> list[bus_pb2.RewardComponent]:
    """Why the job did not report: the limit that fired, or the crash."""
    if result.error:
        return [_component("sandbox_error", 1.0, 0.0, result.error)]
    if result.limit_hit != bus_pb2.SANDBOX_LIMIT_NONE:
        limit = bus_pb2.SandboxLimit.Name(result.limit_hit).removeprefix("SANDBOX_LIMIT_").lower()
        return [_component(f"limit_{limit}", 1.0, 0.0, f"stopped by the {limit} limit after "
                                                         f"{result.wall_seconds:.1f}s")]
    tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return [_component("crashed", 1.0, 0.0, f"exit code {result.exit_code}: {tail[0][:300]}")]


def score_result(traj: bus_pb2.Trajectory, code_job: CodeJob, result: bus_pb2.SandboxResult
                 ) -> tuple[float, list[bus_pb2.RewardComponent]]:
    """(reward, breakdown) from the sandbox's result of `code_job`."""
    report = _reported(result, code_job.nonce)
    if traj.metadata.get("scorer") == UNIT_TESTS:
        if report is None:
            return 0.0, [_component("tests_passed", 0.0, 1.0, "the tests did not run to the end"), *_stopped(result)]
        if not report.get("compiled"):
            return 0.0, [_component("compiled", 0.0, 0.0, str(report.get("error", ""))),
                         _component("tests_passed", 0.0, 1.0, "the solution did not load")]
        tests = [t for t in report.get("tests") or [] if isinstance(t, list) and len(t) == 4]
        passed = sum(1 for _, ok, _, _ in tests if ok is True)
        fraction = passed / len(tests) if tests else 0.0
        failed = "; ".join(f"{name}: {error}" for name, ok, error, _ in tests if ok is not True)[:500]
        breakdown = [_component("compiled", 1.0, 0.0, ""),
                     _component("tests_passed", fraction, 1.0,
                                f"{passed}/{len(tests)} passed" + (f" ({failed})" if failed else ""))]
        for kind, component in (("timeout", "tests_timed_out"), ("crash", "tests_crashed")):
            names = [str(name) for name, _, _, how in tests if how == kind]
            if names:
                breakdown.append(_component(component, float(len(names)), 0.0, ", ".join(names)[:300]))
        if report.get("error"):
            breakdown.append(_component("tests_error", 1.0, 0.0, str(report["error"])[:300]))
        return fraction, breakdown
    if report is None:
        return 0.0, [_component("reward_code", 0.0, 1.0, "the reward code did not return a value"), *_stopped(result)]
    value = report.get("reward")
    if not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0, [_component("reward_code", 0.0, 1.0, f"not a finite number: {value!r}")]
    return float(value), [_component("reward_code", float(value), 1.0, str(report.get("detail", "")))]


# -- the code environment -----------------------------------------------------------------------

_FUNCTIONS: list[tuple[str, str, list[str]]] = [
    # (signature, a reference body, tests)
    ("def add(a, b):", "return a + b", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]),
    ("def double(x):", "return 2 * x", ["assert double(4) == 8", "assert double(0) == 0"]),
    ("def square(x):", "return x * x", ["assert square(3) == 9", "assert square(-2) == 4"]),
    ("def is_even(n):", "return n % 2 == 0", ["assert is_even(4)", "assert not is_even(7)"]),
    ("def last(xs):", "return xs[-1]", ["assert last([1, 2, 3]) == 3", "assert last('ab') == 'b'"]),
    ("def total(xs):", "return sum(xs)", ["assert total([1, 2, 3]) == 6", "assert total([]) == 0"]),
    ("def biggest(xs):", "return max(xs)", ["assert biggest([3, 9, 2]) == 9", "assert biggest([-5]) == -5"]),
    ("def reverse(s):", "return s[::-1]", ["assert reverse('abc') == 'cba'", "assert reverse('') == ''"]),
    ("def count_a(s):", "return s.count('a')", ["assert count_a('banana') == 3", "assert count_a('xyz') == 0"]),
    ("def minus(a, b):", "return a - b", ["assert minus(9, 4) == 5", "assert minus(1, 3) == -2"]),
    ("def half(n):", "return n // 2", ["assert half(9) == 4", "assert half(10) == 5"]),
    ("def first_two(xs):", "return xs[:2]", ["assert first_two([1, 2, 3]) == [1, 2]", "assert first_two([]) == []"]),
]


def code_environment(group_size: int = 8, max_new_tokens: int = 24, temperature: float = 1.0,
                     name: str = "python-functions", version: str = "v1") -> loop_pb2.Environment:
    """Small Python function tasks: the prompt is the signature and the indentation of its body,
    the completion is the body; the task's unit tests run in the sandbox."""
    tasks = []
    for signature, _, tests in _FUNCTIONS:
        prompt = f"{signature}\n    "
        body = "\n".join(f"def test_{i}():\n    {line}" for i, line in enumerate(tests))
        tasks.append(loop_pb2.TaskSpec(prompt_text=prompt, metadata={"solution_prefix": prompt, "tests": body}))
    return loop_pb2.Environment(
        name=name, version=version, tasks=tasks, group_size=group_size,
        unit_tests=loop_pb2.UnitTestScorer(test_code="", timeout_seconds=5.0),
        sampling=bus_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
    )


def reference_solutions() -> dict[str, str]:
    """Each task's prompt → a body that passes its tests (for tests of the scorer)."""
    return {f"{signature}\n    ": body for signature, body, _ in _FUNCTIONS}


def test_functions(source: str) -> list[str]:
    """The tests the harness runs from `source`: top-level `def test_*` (not async), each once.
    Raises SyntaxError for code that does not parse."""
    import ast

    return sorted({node.name for node in ast.parse(source).body
                   if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")})
