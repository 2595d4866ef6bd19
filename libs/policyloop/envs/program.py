"""Environments written as programs: a team's class with `reset(task)` and `step(action)` (see
envs/program_worker.py for what it is given and returns), run out of process in a sandbox
session per episode, so that one process keeps the episode's state and no user code runs in a
service. The episode itself is envs/chat_env.py's; this module gives it the session.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING, Protocol

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
def worker_source(name: str = WORKER) -> bytes:
    """A worker sessions run (read once per process)."""
    return resources.files("policyloop.envs").joinpath(name).read_bytes()


class Package(Protocol):
    """What a session runs besides its worker (EnvironmentProgram, VerifiersEnvironment)."""
    files: Mapping[str, bytes]
    episode_seconds: float
    memory_bytes: int
    requirements: Sequence[str]
    wheels: Mapping[str, bytes]


def package_job(package: Package, *, worker: str, arguments: Sequence[str], job_id: str, run_id: str,
                step_seconds: float, default_episode_s: float = DEFAULT_EPISODE_SECONDS,
                default_memory_bytes: int = 0, requirements: Sequence[str] = ()) -> bus_pb2.SandboxJob:
    """A session's job: `worker` with `arguments`, the package's files under env/, its limits (a
    step's among them) and dependencies (with `requirements` added)."""
    episode_s = package.episode_seconds or default_episode_s
    files = {worker: worker_source(worker)} | {f"{PACKAGE_DIR}/{path}": c for path, c in package.files.items()}
    job = bus_pb2.SandboxJob(
        job_id=job_id, run_id=run_id, files=files, command=["python3", "-I", worker, *arguments],
        limits=bus_pb2.SandboxLimits(wall_seconds=episode_s, cpu_seconds=episode_s, max_output_bytes=1024 * 1024,
                                     memory_bytes=package.memory_bytes or default_memory_bytes),
        session=bus_pb2.SandboxSession(step_seconds=step_seconds))
    needed = [*requirements, *package.requirements]
    if needed or package.wheels:
        job.dependencies.CopyFrom(bus_pb2.SandboxDependencies(requirements=needed, wheels=package.wheels))
    return job


def program_job(program: bus_pb2.EnvironmentProgram, *, job_id: str, run_id: str) -> bus_pb2.SandboxJob:
    """The session's job: the worker and the program's files, under the program's limits."""
    return package_job(program, worker=WORKER, arguments=[program.entry], job_id=job_id, run_id=run_id,
                       step_seconds=program.step_seconds or DEFAULT_STEP_SECONDS)


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
async def session_episode(bus: Bus, job: bus_pb2.SandboxJob, reset: bus_pb2.EnvReset, *, template: ChatTemplate,
                          open_timeout_s: float) -> AsyncIterator[tuple[EnvironmentEpisode, list[int]]]:
    """An episode of the environment `job` runs (program_job, verifiers_job), in a sandbox session
    of its own under the job's step limit, reset with `reset`: the episode and its prompt's token
    ids. The session is closed on exit, however the episode ended."""
    async with Session(bus, job, kind=SESSION_KIND, step_seconds=job.session.step_seconds,
                       open_timeout_s=open_timeout_s) as session:
        episode = EnvironmentEpisode(ProgramClient(session), template)
        yield episode, await episode.open(reset)
