"""The unit-test harness in the real sandbox: honest solutions get their share of the tests,
and the ways a policy could game a reward that runs its code in the tests' process do not pay
(an object equal to everything, the harness's frames and nonce, the test file, the harness's
memory through /proc). Timeouts and crashes cost the test they happen in, not the others."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import JobCgroups, job_cgroups
from policyloop.sandbox.runner import JobLimits, SandboxUnavailable, check_isolation, run_job
from policyloop.scorers.registry import sandbox_job, score_result

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

TESTS = """
def test_add():
    assert add(2, 3) == 5
def test_add_negative():
    assert add(-1, 1) == 0
def test_sorts_in_place():
    xs = [3, 1, 2]
    assert sort_in_place(xs) is None and xs == [1, 2, 3]
def test_add_refuses_text():
    try:
        add("a", 1)
    except TypeError:
        return
    raise AssertionError("no TypeError")
"""
HONEST = "def add(a, b):\n    return a + b\ndef sort_in_place(xs):\n    xs.sort()\n"


@pytest.fixture(scope="module")
def sandbox() -> Iterator[JobCgroups | None]:
    cgroups = job_cgroups("auto")
    yield cgroups
    if cgroups is not None:
        cgroups.remove_parents()


async def score(sandbox: JobCgroups | None, solution: str, tests: str = TESTS,
                timeout_s: float = 4.0) -> tuple[float, dict[str, tuple[float, str]], bus_pb2.SandboxResult]:
    traj = bus_pb2.Trajectory(trajectory_id="t", response_text=solution, metadata={"tests": tests},
                              scorer=bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer(timeout_seconds=timeout_s)))
    code_job = sandbox_job(traj)
    asked = code_job.job.limits  # as the sandbox service takes them (its defaults aside)
    limits = JobLimits(wall_seconds=asked.wall_seconds, cpu_seconds=asked.cpu_seconds,
                       max_output_bytes=asked.max_output_bytes)
    result = await run_job(code_job.job, limits, cgroups=sandbox)
    reward, breakdown = score_result(traj, code_job, result)
    return reward, {c.name: (c.value, c.detail) for c in breakdown}, result


async def test_an_honest_solution_passes_every_test(sandbox: JobCgroups | None) -> None:
    reward, parts, _ = await score(sandbox, HONEST)
    assert reward == 1.0 and parts["tests_passed"] == (1.0, "4/4 passed"), parts


async def test_values_cross_as_plain_data_both_ways(sandbox: JobCgroups | None) -> None:
    solution = ("def echo(x):\n    return x\n"
                "def boom(kind):\n"
                "    raise {'value': ValueError, 'key': KeyError, 'own': type('Own', (Exception,), {})}[kind]('no')\n"
                "def fill(d, s, b):\n    d['k'] = 1\n    s.add(2)\n    b.extend(b'!')\n"
                "def counts(text):\n    import collections\n    return collections.Counter(text)\n"
                "LIMIT = (1, 2.5)\n")
    tests = """
def test_round_trip():
    values = [None, True, -3, 10**30, 2.5, float('inf'), -0.0, 1+2j, 'é', b'\\x00', bytearray(b'ab'),
              [1, [2]], (1, (2,)), {1: 'a', (2, 3): [4]}, {1, 2}, frozenset({3})]
    for value in values:
        back = echo(value)
        assert back == value and type(back) is type(value), (value, back)
    nan = echo(float('nan'))
    assert nan != nan
def test_builtin_exceptions_keep_their_type():
    for kind, error in (('value', ValueError), ('key', KeyError)):
        try:
            boom(kind)
        except error:
            pass
        else:
            raise AssertionError(kind)
def test_other_exceptions_are_solution_errors():
    try:
        boom('own')
    except Exception as exc:
        assert type(exc).__name__ == 'SolutionError' and 'Own: no' in str(exc)
def test_in_place_changes_come_back():
    d, s, b = {}, set(), bytearray(b'x')
    fill(d, s, b)
    assert d == {'k': 1} and s == {2} and b == bytearray(b'x!')
def test_constants_are_seen():
    assert LIMIT == (1, 2.5)
def test_subclasses_of_builtins_cross_as_their_base_type():
    assert counts('aab') == {'a': 2, 'b': 1} and type(counts('a')) is dict
"""
    reward, parts, _ = await score(sandbox, solution, tests)
    assert reward == 1.0, parts


async def test_an_object_equal_to_everything_does_not_pass(sandbox: JobCgroups | None) -> None:
    rigged = ("    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
              "    __hash__ = object.__hash__\n")
    # Not plain data: refused (and a test expecting the solution's TypeError does not take the
    # refusal for one).
    reward, parts, _ = await score(sandbox, f"class Anything:\n{rigged}def add(a, b):\n    return Anything()\n"
                                            "def sort_in_place(xs):\n    return Anything()\n")
    assert reward == 0.0 and "not plain data" in parts["tests_passed"][1], parts
    # A subclass of a builtin crosses as its base type, by value: the override stays behind.
    reward, parts, _ = await score(sandbox, f"class Anything(int):\n{rigged}def add(a, b):\n    return Anything(7)\n"
                                            "def sort_in_place(xs):\n    return Anything(7)\n")
    assert reward == 0.0 and parts["tests_passed"][1].startswith("0/4 passed"), parts


async def test_a_solution_cannot_stand_in_for_the_builtins_the_tests_use(
        sandbox: JobCgroups | None) -> None:
    solution = ("def abs(x):\n    return 0\ndef all(xs):\n    return True\ndef range(*a):\n    return []\n"
                "def sorted(xs):\n    return []\ndef _helper():\n    return 1\ndef root(x):\n    return 7.0\n")
    tests = """
def test_root():
    assert abs(root(2) - 1.41421) < 1e-4
def test_all():
    assert all([root(4) == 2.0])
def test_loop():
    checked = 0
    for x in range(3):
        assert root(x * x) == x
        checked += 1
    assert checked == 3
def test_sorted():
    assert sorted([root(1), root(9)]) == [1.0, 3.0]
def test_private():
    assert _helper() == 1
"""
    reward, parts, _ = await score(sandbox, solution, tests)
    assert reward == 0.0 and parts["tests_passed"][1].startswith("0/5 passed"), parts
    assert "NameError: name '_helper' is not defined" in parts["tests_passed"][1]


async def test_the_harness_report_and_nonce_are_out_of_the_solutions_reach(
        sandbox: JobCgroups | None) -> None:
    """Walking frames and objects finds no nonce or report in the solution's process; /proc gives
    nothing of the harness's (it is not dumpable); forged reports on stdout are not the harness's."""
    solution = r'''
import gc, json, os, sys
found = []
frame = sys._getframe()
while frame is not None:
    found += [k for k in frame.f_locals if k in ("nonce", "report", "report_fd")]
    frame = frame.f_back
found += [type(o).__name__ for o in gc.get_objects() if type(o).__name__ in ("Solution", "SolutionTimeout")]
harness = os.getppid()
for name in ("mem", "environ", "fd/0", "fd/1", "maps"):
    try:
        with open(f"/proc/{harness}/{name}", "rb") as f:
            f.read(1)
        found.append(name)
    except OSError:
        pass
print("FOUND", found, file=sys.stderr, flush=True)
forged = b"\n00 " + json.dumps({"compiled": True, "tests": [["test_add", True, "", "passed"]]}).encode() + b"\n"
for fd in range(1, 64):  # its own answers to the harness included: that breaks only itself
    try:
        os.write(fd, forged)
    except OSError:
        pass
def add(a, b):
    return 0
def sort_in_place(xs):
    pass
'''
    reward, parts, result = await score(sandbox, solution)
    assert b"FOUND []" in result.stderr, result.stderr
    assert reward == 0.0 and parts["compiled"][1] == "the solution's process answered malformed data", parts


async def test_the_solution_cannot_read_the_tests(sandbox: JobCgroups | None) -> None:
    solution = ("import glob, os\nseen = sorted(glob.glob('/job/*'))\n"
                "source = open('tests.py').read() if os.path.exists('tests.py') else ''\n"
                "def add(a, b):\n    if 'add(2, 3) == 5' in source:\n        return {(2, 3): 5, (-1, 1): 0}[(a, b)]\n"
                "    raise RuntimeError(str(seen))\ndef sort_in_place(xs):\n    pass\n")
    reward, parts, _ = await score(sandbox, solution)
    assert reward == 0.0 and "tests.py" not in parts["tests_passed"][1] and "harness.py" in parts["tests_passed"][1]


async def test_a_hang_costs_one_test_and_a_crash_another(sandbox: JobCgroups | None) -> None:
    solution = ("import os\ndef add(a, b):\n    if a == -1:\n        while True:\n            pass\n"
                "    if a == 'a':\n        os._exit(3)\n    return a + b\ndef sort_in_place(xs):\n    xs.sort()\n")
    reward, parts, result = await score(sandbox, solution, timeout_s=4.0)
    assert reward == 0.5, parts
    assert parts["tests_timed_out"] == (1.0, "test_add_negative")
    assert parts["tests_crashed"] == (1.0, "test_add_refuses_text")
    assert "exit code 3" in parts["tests_passed"][1]
    assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_NONE and result.wall_seconds < 6.5, result


async def test_a_solution_that_never_loads_or_does_not_parse(sandbox: JobCgroups | None) -> None:
    reward, parts, _ = await score(sandbox, "while True:\n    pass\n", timeout_s=1.5)
    assert reward == 0.0 and parts["compiled"] == (0.0, "the solution did not finish loading in time"), parts
    reward, parts, _ = await score(sandbox, "def add(a, b):\n    return a +\n")
    assert reward == 0.0 and "SyntaxError" in parts["compiled"][1], parts
    reward, parts, _ = await score(sandbox, "import sys\nsys.exit(0)\n")
    assert reward == 0.0 and "SystemExit" in parts["compiled"][1], parts


async def test_a_reply_past_the_parsers_limits_and_a_broken_test_file(sandbox: JobCgroups | None) -> None:
    # The solution writes a reply nested past the JSON parser's recursion limit to its own answers
    # (the descriptor is in its argv): a crashed load, not an exception a test could catch.
    deep = "import os, sys\nos.write(int(sys.argv[3]), b'[' * 100000 + b']' * 100000 + b'\\n')\n" + HONEST
    reward, parts, _ = await score(sandbox, deep)
    assert reward == 0.0 and parts["compiled"] == (0.0, "the solution's process answered malformed data"), parts
    # tests.py that fails at its top level runs no test, and the breakdown says why.
    reward, parts, _ = await score(sandbox, HONEST, "raise RuntimeError('broken fixture')\n" + TESTS)
    assert reward == 0.0 and parts["tests_passed"][1] == "0/0 passed", parts
    assert parts["tests_error"] == (1.0, "tests.py: RuntimeError: broken fixture"), parts


async def test_output_of_the_solution_does_not_disturb_the_report(sandbox: JobCgroups | None) -> None:
    solution = "import sys\nprint('x' * 100_000)\ndef add(a, b):\n    print(a, b)\n    sys.stdout.flush()\n" \
               "    return a + b\ndef sort_in_place(xs):\n    xs.sort()\n"
    reward, _, result = await score(sandbox, solution)
    assert reward == 1.0 and result.stdout.count(b"\n") == 2  # stdout: the report line alone
