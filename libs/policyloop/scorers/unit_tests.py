"""The unit-test scorer. The completion (after the task's metadata `solution_prefix`, e.g. a
function signature) is `solution.py`; the scorer's `test_code` plus the task's metadata `tests`
are `tests.py`, whose `test_*` functions call the functions `solution.py` defines (and see its
plain-data constants). The reward is the fraction of tests that pass; a solution that does not
load, the tests that timed out or crashed, and the limit that stopped the job are in the
breakdown.

The tests run in the harness's process and the solution in a child process, with plain data
between them (policyloop/scorers/unit_test_harness.py): the report, its nonce and the tests are out
of the solution's reach, a test's share of the time budget bounds each call, and a solution that
times out or crashes fails that test and is started again for the next. Tests are the top-level
`def test_*` functions of tests.py (each name once); the gateway refuses test code without any
(`test_functions`)."""

from __future__ import annotations

import json
from importlib import resources

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.answer import answer_text
from policyloop.scorers.sandboxed import DEFAULT_TIMEOUT_S, CodeJob, code_job, limits, new_nonce, reported, why_stopped
from policyloop.scorers.score import Score, component

TEST_HARNESS = resources.files("policyloop.scorers").joinpath("unit_test_harness.py").read_bytes()
# Time for the job's own start (bwrap, two interpreters) and report, beyond the tests' budget.
START_MARGIN_S = 2.0


def unit_test_job(traj: bus_pb2.Trajectory) -> CodeJob:
    scorer = traj.scorer.unit_tests
    budget = scorer.timeout_seconds or DEFAULT_TIMEOUT_S
    nonce = new_nonce()
    solution = traj.metadata.get("solution_prefix", "") + answer_text(traj)
    tests = scorer.test_code + "\n" + traj.metadata.get("tests", "") + "\n"
    files = {"solution.py": solution.encode(), "tests.py": tests.encode(), "harness.py": TEST_HARNESS}
    stdin = nonce + "\n" + json.dumps({"budget_s": budget}) + "\n"
    return code_job(traj, files, stdin, nonce, limits(budget + START_MARGIN_S))


def unit_test_score(traj: bus_pb2.Trajectory, job: CodeJob, result: bus_pb2.SandboxResult) -> Score:
    report = reported(result, job.nonce)
    if report is None:
        return 0.0, [component("tests_passed", 0.0, 1.0, "the tests did not run to the end"), *why_stopped(result)]
    if not report.get("compiled"):
        return 0.0, [component("compiled", 0.0, 0.0, str(report.get("error", ""))),
                     component("tests_passed", 0.0, 1.0, "the solution did not load")]
    tests = [t for t in report.get("tests") or [] if isinstance(t, list) and len(t) == 4]
    passed = sum(1 for _, ok, _, _ in tests if ok is True)
    fraction = passed / len(tests) if tests else 0.0
    failed = "; ".join(f"{name}: {error}" for name, ok, error, _ in tests if ok is not True)[:500]
    breakdown = [component("compiled", 1.0, 0.0, ""),
                 component("tests_passed", fraction, 1.0,
                           f"{passed}/{len(tests)} passed" + (f" ({failed})" if failed else ""))]
    for kind, name in (("timeout", "tests_timed_out"), ("crash", "tests_crashed")):
        names = [str(test) for test, _, _, how in tests if how == kind]
        if names:
            breakdown.append(component(name, float(len(names)), 0.0, ", ".join(names)[:300]))
    if report.get("error"):
        breakdown.append(component("tests_error", 1.0, 0.0, str(report["error"])[:300]))
    return fraction, breakdown
