"""Environments written as programs: a team's class with `reset(task)` and `step(action)` (see
envs/program_worker.py for what it is given and returns), run out of process in a sandbox
session per episode, so that one process keeps the episode's state and no user code runs in a
service. The episode itself is envs/chat_env.py's; this module gives it the session.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING

from google.protobuf import json_format

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs.chat_env import ChatTemplate, EnvironmentEpisode, EnvironmentFailed
from policyloop.sandbox.session import Session, SessionEnded

if TYPE_CHECKING:
    from policyloop.bus import Bus

WORKER = "program_worker.py"
PACKAGE_DIR = "env"
DEFAULT_STEP_SECONDS = 10.0
DEFAULT_EPISODE_SECONDS = 60.0
SESSION_KIND = "program"


@functools.cache
def worker_source() -> bytes:
    """The worker every session runs (read once per process)."""
    return resources.files("policyloop.envs").joinpath(WORKER).read_bytes()


def program_job(program: bus_pb2.EnvironmentProgram, *, job_id: str, run_id: str) -> bus_pb2.SandboxJob:
    """The session's job: the worker and the program's files, under the program's limits."""
    episode_s = program.episode_seconds or DEFAULT_EPISODE_SECONDS
    files = {WORKER: worker_source()}
    files |= {f"{PACKAGE_DIR}/{path}": content for path, content in program.files.items()}
    job = bus_pb2.SandboxJob(
        job_id=job_id, run_id=run_id, files=files, command=["python3", "-I", WORKER, program.entry],
        limits=bus_pb2.SandboxLimits(wall_seconds=episode_s, cpu_seconds=episode_s,
                                     memory_bytes=program.memory_bytes, max_output_bytes=1024 * 1024))
    if program.requirements or program.wheels:
        job.dependencies.CopyFrom(bus_pb2.SandboxDependencies(requirements=program.requirements,
                                                              wheels=program.wheels))
    return job


class ProgramClient:
    """Typed requests to the program in a session; its failures become EnvironmentFailed."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def ask(self, request: bus_pb2.EnvRequest) -> bus_pb2.EnvReply:
        line = json_format.MessageToJson(request, preserving_proto_field_name=True, indent=None).encode()
        kind = request.WhichOneof("kind")
        try:
            answer = await self.session.step(line)
        except SessionEnded as exc:
            raise EnvironmentFailed(str(exc)) from exc
        except TimeoutError as exc:
            raise EnvironmentFailed(f"no sandbox session: {exc}") from exc
        reply = bus_pb2.EnvReply()
        try:
            json_format.Parse(answer, reply)
        except json_format.ParseError as exc:
            raise EnvironmentFailed(f"a malformed answer to {kind}: {exc}") from exc
        if reply.error:
            raise EnvironmentFailed(f"the environment failed on {kind}: {reply.error}")
        return reply


@asynccontextmanager
async def program_episode(bus: Bus, program: bus_pb2.EnvironmentProgram, reset: bus_pb2.EnvReset, *,
                          template: ChatTemplate, job_id: str, run_id: str, open_timeout_s: float
                          ) -> AsyncIterator[tuple[EnvironmentEpisode, list[int]]]:
    """An episode of `program` in a sandbox session of its own, reset with `reset`: the episode and
    its prompt's token ids. The session is closed on exit, however the episode ended."""
    job = program_job(program, job_id=job_id, run_id=run_id)
    async with Session(bus, job, kind=SESSION_KIND, step_seconds=program.step_seconds or DEFAULT_STEP_SECONDS,
                       open_timeout_s=open_timeout_s) as session:
        episode = EnvironmentEpisode(ProgramClient(session), template)
        yield episode, await episode.open(reset)
