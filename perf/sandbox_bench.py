"""Sandbox cost on this machine: wall time per job and jobs per second for a trivial job
(`python3 -c pass`), one at a time and two side by side, with a cgroup per job and on rlimits
alone; the wall time of scoring one completion with the unit-test harness (two interpreters,
four tests); and a session's (sandbox/session.py) time to its first answer and per step, on a
process that keeps a running total; and a session whose process spends `--prepare-s` of CPU
getting ready (as a verifiers environment's imports do), run fresh and forked from a prepared
process (sandbox/forked.py). Runs the runner directly (no bus: a session step on the cluster adds
one NATS request/reply). Prints JSON with medians.

    .venv/bin/python perf/sandbox_bench.py --jobs 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.cgroups import JobCgroups, job_cgroups
from policyloop.sandbox.forked import ForkedSessions
from policyloop.sandbox.runner import DEFAULT_UIDS, JobLimits, check_isolation, run_job
from policyloop.scorers.registry import sandbox_job, score_result
from policyloop.telemetry.logging import configure_logging

TESTS = "".join(f"def test_{i}():\n    assert add({i}, 1) == {i + 1}\n" for i in range(4))


async def trivial_jobs(cgroups: JobCgroups | None, jobs: int, side_by_side: int) -> dict:
    job = bus_pb2.SandboxJob(job_id="pass", command=["python3", "-c", "pass"])
    walls: list[float] = []
    started = time.perf_counter()
    for _ in range(jobs // side_by_side):
        results = await asyncio.gather(*(run_job(job, JobLimits(), cgroups=cgroups)
                                         for _ in range(side_by_side)))
        assert all(r.exit_code == 0 for r in results), results
        walls += [r.wall_seconds for r in results]
    elapsed = time.perf_counter() - started
    return {"job_wall_ms_median": round(1000 * statistics.median(walls), 1),
            "jobs_per_s": round(len(walls) / elapsed, 1)}


async def scoring(cgroups: JobCgroups | None, jobs: int) -> dict:
    walls, cpus = [], []
    for i in range(jobs):
        traj = bus_pb2.Trajectory(trajectory_id=f"t{i}", response_text="def add(a, b):\n    return a + b\n",
                                  metadata={"tests": TESTS},
                                  scorer=bus_pb2.Scorer(unit_tests=bus_pb2.UnitTestScorer(timeout_seconds=5)))
        code_job = sandbox_job(traj)
        result = await run_job(code_job.job, JobLimits(wall_seconds=10, cpu_seconds=10), cgroups=cgroups)
        assert score_result(traj, code_job, result)[0] == 1.0, result
        walls.append(result.wall_seconds)
        cpus.append(result.cpu_seconds)
    return {"score_wall_ms_median": round(1000 * statistics.median(walls), 1),
            "score_cpu_ms_median": round(1000 * statistics.median(cpus), 1)}


SESSION = b"import sys\ntotal = 0\nfor line in sys.stdin:\n    total += int(line)\n    print(total, flush=True)\n"


class TimedSteps:
    """A session's conversation: `steps` lines, each answer timed."""

    def __init__(self, steps: int) -> None:
        self.steps, self.times = steps, []  # type: ignore[var-annotated]

    async def run(self, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> int:
        for i in range(self.steps):
            sent = time.perf_counter()
            stdin.write(b"%d\n" % i)
            await stdin.drain()
            assert int(await stdout.readline()) == i * (i + 1) // 2
            self.times.append(time.perf_counter() - sent)
        stdin.close()
        return bus_pb2.SANDBOX_LIMIT_NONE


async def sessions(cgroups: JobCgroups | None, count: int, steps: int) -> dict:
    job = bus_pb2.SandboxJob(job_id="session", files={"total.py": SESSION}, command=["python3", "-I", "total.py"])
    first, later, walls = [], [], []
    for _ in range(count):
        talk = TimedSteps(steps)
        result = await run_job(job, JobLimits(), cgroups=cgroups, conversation=talk)
        assert result.exit_code == 0 and not result.error, result
        first.append(talk.times[0])
        later += talk.times[1:]
        walls.append(result.wall_seconds)
    later.sort()
    return {"first_answer_ms_median": round(1000 * statistics.median(first), 1),
            "step_ms_median": round(1000 * statistics.median(later), 3),
            "step_ms_p99": round(1000 * later[int(0.99 * (len(later) - 1))], 3),
            "session_wall_ms_median": round(1000 * statistics.median(walls), 1), "steps_per_session": steps}


PREPARED = b"""import sys, time
def prepare(seconds):
    ends = time.process_time() + float(seconds)  # getting ready: imports, loading
    while time.process_time() < ends:
        pass
    def episode():
        total = 0
        for line in sys.stdin:
            total += int(line)
            print(total, flush=True)
        return 0
    return episode
if __name__ == "__main__":
    sys.exit(prepare(sys.argv[1])())
"""


async def prepared_sessions(cgroups: JobCgroups | None, count: int, prepare_s: float) -> dict:
    """The same session run fresh (its process prepares every time) and forked from a prepared one."""
    job = bus_pb2.SandboxJob(job_id="prepared", files={"prepared.py": PREPARED},
                             command=["python3", "-I", "prepared.py", str(prepare_s)],
                             session=bus_pb2.SandboxSession(prepared=True))
    limits = JobLimits(wall_seconds=30, cpu_seconds=30)
    forked = ForkedSessions(instance="bench", uids=DEFAULT_UIDS, cgroups=cgroups)
    report = {}
    try:
        for name, run in (("fresh", lambda talk: run_job(job, limits, cgroups=cgroups, conversation=talk)),
                          ("forked", lambda talk: forked.run(job, limits, talk))):
            walls, cpus = [], []
            for _ in range(count + (name == "forked")):  # the first forked one prepares: not counted
                result = await run(TimedSteps(10))
                assert result.exit_code == 0 and not result.error, result
                walls.append(result.wall_seconds)
                cpus.append(result.cpu_seconds)
            walls, cpus = walls[-count:], cpus[-count:]
            report[name] = {"session_wall_ms_median": round(1000 * statistics.median(walls), 1),
                            "session_cpu_ms_median": round(1000 * statistics.median(cpus), 1)}
    finally:
        await forked.close()
    return {"prepare_cpu_s": prepare_s, "steps_per_session": 10, **report}


async def main(jobs: int, prepare_s: float) -> dict:
    check_isolation()
    cgroups = job_cgroups("auto")
    report: dict = {"jobs": jobs}
    try:
        for name, mode in (("cgroup", cgroups), ("rlimit", None)):
            if name == "cgroup" and mode is None:
                report[name] = "unavailable here"
                continue
            report[name] = {
                "one_at_a_time": await trivial_jobs(mode, jobs, 1),
                "two_side_by_side": await trivial_jobs(mode, jobs, 2),
                "unit_test_scoring": await scoring(mode, max(4, jobs // 4)),
                "sessions": await sessions(mode, max(4, jobs // 4), 50),
                "prepared_sessions": await prepared_sessions(mode, max(4, jobs // 4), prepare_s),
            }
    finally:
        if cgroups is not None:
            cgroups.remove_parents()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40, help="trivial jobs per configuration")
    parser.add_argument("--prepare-s", type=float, default=1.0, help="CPU seconds a prepared session's process "
                                                                     "spends getting ready")
    args = parser.parse_args()
    configure_logging(service="perf", run_id="", instance="sandbox_bench", level="WARNING")  # stdout: JSON only
    print(json.dumps(asyncio.run(main(args.jobs, args.prepare_s)), indent=2))
