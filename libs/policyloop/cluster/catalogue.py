"""Every service of the loop, how it is started, and what it listens on. `policyloop serve`,
`policyloop up` and the compose.yaml test all read this one table."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceEntry:
    name: str
    module: str            # python -m <module> starts it
    grpc: bool             # serves gRPC (health over the gRPC health protocol)
    needs_torch: bool      # image / extra with torch
    description: str


SERVICES: tuple[ServiceEntry, ...] = (
    ServiceEntry("gateway", "policyloop.services.gateway", True, False,
                 "gRPC LoopService: environments and runs in, Tasks onto TASKS."),
    ServiceEntry("rollout", "policyloop.services.rollout", False, True,
                 "Tasks in, sampled Rollouts out (one per group member)."),
    ServiceEntry("reward", "policyloop.services.reward", False, False,
                 "Rollouts in, scored Trajectories out."),
    ServiceEntry("sandbox", "policyloop.services.sandbox", False, False,
                 "Runs jobs from SANDBOX in isolation and replies with the result."),
    ServiceEntry("learner", "policyloop.services.learner", False, True,
                 "Trajectories in, new policy versions out."),
    ServiceEntry("publisher", "policyloop.services.publisher", True, False,
                 "gRPC WeightService: stores versions, serves them, announces them on WEIGHTS."),
    ServiceEntry("tinker", "policyloop.services.tinker", False, True,
                 "The Tinker HTTP API: users' own training loops (the learner with tinker=true trains)."),
    ServiceEntry("evaluator", "policyloop.services.evaluator", False, True,
                 "Scores each k-th version on its runs' eval splits, on an engine of its own; promotes by rule."),
)

SERVICE_NAMES: tuple[str, ...] = tuple(s.name for s in SERVICES)


def entry(name: str) -> ServiceEntry:
    for service in SERVICES:
        if service.name == name:
            return service
    raise KeyError(f"unknown service {name!r}; one of {', '.join(SERVICE_NAMES)}")


def service_main(name: str):  # type: ignore[no-untyped-def]
    """The service's `main(argv) -> exit code`."""
    return importlib.import_module(entry(name).module + ".service").main
