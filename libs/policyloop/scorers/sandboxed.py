"""What the code scorers share: a sandbox job with a nonce, and reading its result.

Code scorers never run code in the reward service's process: the scorer builds a SandboxJob,
the sandbox service runs it, and the harness inside the job writes its report on stdout after
a nonce only the reward service knows (a completion that prints a report cannot forge it)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.score import component

DEFAULT_TIMEOUT_S = 10.0
MAX_OUTPUT_BYTES = 256 * 1024


@dataclass(frozen=True)
class CodeJob:
    job: bus_pb2.SandboxJob
    nonce: str


def new_nonce() -> str:
    return secrets.token_hex(16)


def code_job(traj: bus_pb2.Trajectory, files: dict[str, bytes], stdin: str, nonce: str,
             limits: bus_pb2.SandboxLimits) -> CodeJob:
    """The job that runs `harness.py` among `files` to score `traj`."""
    job = bus_pb2.SandboxJob(job_id=f"score:{traj.trajectory_id}", run_id=traj.run_id, files=files,
                             command=["python3", "-I", "harness.py"], stdin=stdin.encode(), limits=limits)
    return CodeJob(job, nonce)


def limits(seconds: float) -> bus_pb2.SandboxLimits:
    return bus_pb2.SandboxLimits(wall_seconds=seconds, cpu_seconds=seconds, max_output_bytes=MAX_OUTPUT_BYTES)


def reported(result: bus_pb2.SandboxResult, nonce: str) -> dict | None:
    """The harness's report (the line after the nonce), or None when there is none."""
    for line in reversed(result.stdout.decode(errors="replace").splitlines()):
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None


def why_stopped(result: bus_pb2.SandboxResult) -> list[bus_pb2.RewardComponent]:
    """Why the job did not report: the limit that fired, or the crash."""
    if result.error:
        return [component("sandbox_error", 1.0, 0.0, result.error)]
    if result.limit_hit != bus_pb2.SANDBOX_LIMIT_NONE:
        limit = bus_pb2.SandboxLimit.Name(result.limit_hit).removeprefix("SANDBOX_LIMIT_").lower()
        return [component(f"limit_{limit}", 1.0, 0.0, f"stopped by the {limit} limit after "
                                                        f"{result.wall_seconds:.1f}s")]
    tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return [component("crashed", 1.0, 0.0, f"exit code {result.exit_code}: {tail[0][:300]}")]
