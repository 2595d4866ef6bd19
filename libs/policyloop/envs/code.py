"""The code environment: small Python functions to complete, scored by unit tests in the sandbox
(policyloop.scorers.unit_tests). Each task's prompt is a function's signature and the indentation
of its body; its metadata carries `solution_prefix` (the prompt, which the completion continues)
and `tests` (its own `test_*` functions)."""

from __future__ import annotations

from policyloop.contracts.v1 import bus_pb2, loop_pb2

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
        unit_tests=bus_pb2.UnitTestScorer(test_code="", timeout_seconds=5.0),
        sampling=bus_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
    )


def reference_solutions() -> dict[str, str]:
    """Each task's prompt → a body that passes its tests (for tests of the scorer)."""
    return {f"{signature}\n    ": body for signature, body, _ in _FUNCTIONS}
