"""Environments that drive their episodes (a team's program, an OpenEnv server, a verifiers
environment): one way in for the rollout replicas and the evaluator, whichever kind a task names."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from policyloop.contracts.v1 import bus_pb2, loop_pb2
from policyloop.envs.chat_env import ChatTemplate, EnvironmentEpisode
from policyloop.envs.openenv_env import openenv_episode
from policyloop.envs.program import program_job, session_episode
from policyloop.envs.verifiers_env import verifiers_job

if TYPE_CHECKING:
    from policyloop.bus import Bus

Driver = bus_pb2.EnvironmentProgram | bus_pb2.OpenEnvServer | bus_pb2.VerifiersEnvironment
# The kinds of environment that drive their episodes: the `driver` oneof of Task and Environment
# (a test holds the two and docs/environments.md's list to this).
DRIVER_KINDS: tuple[str, ...] = tuple(f.name for f in loop_pb2.Environment.DESCRIPTOR.oneofs_by_name["driver"].fields)


def driver_of(holder: bus_pb2.Task | loop_pb2.Environment) -> Driver | None:
    """The environment that drives `holder`'s episodes (its `driver` oneof), or None (the replica
    drives them)."""
    kind = holder.WhichOneof("driver")
    return None if kind is None else getattr(holder, kind)  # type: ignore[no-any-return]


def set_driver(holder: bus_pb2.Task | loop_pb2.Environment, driver: Driver) -> None:
    """Names `driver` as what drives `holder`'s episodes (the `driver` field of its type)."""
    for field in holder.DESCRIPTOR.oneofs_by_name["driver"].fields:
        if field.message_type is driver.DESCRIPTOR:
            getattr(holder, field.name).CopyFrom(driver)
            return
    raise TypeError(f"{type(driver).__name__} does not drive episodes")


def open_environment(bus: Bus, driver: Driver, reset: bus_pb2.EnvReset, *, template: ChatTemplate, job_id: str,
                     run_id: str, open_timeout_s: float
                     ) -> AbstractAsyncContextManager[tuple[EnvironmentEpisode, list[int]]]:
    """An episode of `driver`'s environment, reset with `reset`: the episode and its prompt's ids."""
    if isinstance(driver, bus_pb2.OpenEnvServer):
        return openenv_episode(driver, reset, template=template)
    make_job = program_job if isinstance(driver, bus_pb2.EnvironmentProgram) else verifiers_job
    return session_episode(bus, make_job(driver, job_id=job_id, run_id=run_id), reset,  # type: ignore[arg-type]
                           template=template, open_timeout_s=open_timeout_s)
