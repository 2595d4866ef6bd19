"""One learner process for every kind of run: the full model's runs (learner.learner), LoRA runs
(learner.adapters) and the Tinker API's models (tinker.worker) side by side. They take turns on
the device — one lock, whose waiters are served first come, first served, so a kind with work
waits for at most one step of each other kind — and the process reports one status.

TRAJECTORIES is read once: each group goes to the kind its run is (a run started with a LoRA spec
is a LoRA run; any other, the full model's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policyloop.bus import Delivery
from policyloop.contracts.v1 import bus_pb2, status_pb2

if TYPE_CHECKING:
    from policyloop.learner.adapters import AdapterLearner
    from policyloop.learner.learner import Learner
    from policyloop.state.catalog import RunRegistry


class RunKinds:
    """Whether a run is a LoRA run, from its definition (kept once known: a run's kind never changes)."""

    def __init__(self, runs: RunRegistry) -> None:
        self.runs = runs
        self._lora: dict[str, bool] = {}

    async def is_lora(self, run_id: str) -> bool:
        if run_id not in self._lora:
            definition = await self.runs.definition(run_id)
            if definition is None:
                return False  # not (yet) a run of the gateway's: the full model's loop (not kept)
            self._lora[run_id] = definition.HasField("lora")
        return self._lora[run_id]


class TrajectoryRouter:
    """The handler of the learner's TRAJECTORIES consumer when the process trains more than one kind."""

    def __init__(self, full_model: Learner | None, lora_runs: AdapterLearner | None, kinds: RunKinds | None) -> None:
        self.full_model, self.lora_runs, self.kinds = full_model, lora_runs, kinds

    async def admit(self, delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        run_id = delivery.message.trajectories[0].run_id  # every member's (validate_group)
        if self.full_model is None or (self.lora_runs is not None and self.kinds is not None
                                       and await self.kinds.is_lora(run_id)):
            await self.lora_runs.admit(delivery)  # type: ignore[union-attr]
        else:
            await self.full_model.admit(delivery)


def combined_status(advertised: status_pb2.LearnerStatus, full_model: Learner | None,
                    lora_runs: AdapterLearner | None) -> status_pb2.LearnerStatus:
    """The process's one status: the full model's figures (or what it advertises without one),
    and each LoRA run's adapter version."""
    status = full_model.current_status() if full_model is not None else advertised
    if lora_runs is not None:
        versions = {run_id: lora_runs.trainer.run(run_id).version for run_id in list(lora_runs.slots)
                    if run_id in lora_runs.trainer.runs}
        status.lora_run_versions.clear()
        status.lora_run_versions.update(versions)
    return status
