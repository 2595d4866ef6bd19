"""The embedded engine's side of the colocated weight sync (`policyloop.weights.broadcast`).

The engine joins a weight-update group as rank `rank_offset` (it is one TP rank), over gloo (nccl
only where CUDA is: the model itself stays on the CPU). Each /update_weights_from_distributed,
inside a /begin_weight_update … /end_weight_update session as SGLang 0.5.23 requires, receives its
tensors (one flattened uint8 buffer for load_format "flattened_bucket", else one broadcast per
tensor) on a daemon thread, then checks every name, shape and dtype against the served parameters
and copies them in place on the compute thread, between two decode steps. A request that fails
those checks still receives its tensors (the sender's broadcast must complete, and the group stays
in step for the next bucket) and answers success=false naming the tensor: the whole bucket is
dropped and the old weights keep serving. Requests refused before receiving (malformed, no
session, unknown group) leave the sender's broadcast waiting, as SGLang's do.
"""

from __future__ import annotations

import asyncio

from policyloop.engines.embedded.model import ServedModel
from policyloop.engines.embedded.scheduler import Scheduler
from policyloop.engines.embedded.weight_loading import load_received
from policyloop.engines.protocol import (
    ControlResult,
    InitWeightsUpdateGroupRequest,
    RequestError,
    UpdateWeightsFromDistributedRequest,
)
from policyloop.weights.broadcast.group import (
    WeightGroupError,
    WeightUpdateGroup,
    check_backend,
    in_daemon_thread,
    join_weight_update_group,
    receive_named_tensors,
)
from policyloop.weights.broadcast.layout import FLATTENED_BUCKET, Bucket, TensorSpec, parse_dtype


def _result(success: bool, message: str) -> ControlResult:
    return ControlResult(success=success, message=message)


class WeightReceiver:
    """Joined groups by name, the lock that keeps their collectives (join, receive, destroy) in
    request order, and whether a weight-update session is open."""

    def __init__(self, served: ServedModel, scheduler: Scheduler, *, group_timeout_s: float) -> None:
        self.served = served
        self.scheduler = scheduler
        self.group_timeout_s = group_timeout_s
        self.groups: dict[str, WeightUpdateGroup] = {}
        self._lock = asyncio.Lock()
        self._session = False

    async def join(self, parsed: InitWeightsUpdateGroupRequest) -> ControlResult:
        try:
            check_backend(parsed.backend)  # nccl without CUDA: refused before waiting for anyone
        except WeightGroupError as exc:
            return _result(False, f"Failed to initialize custom process group: {exc}.")
        # Shielded: a client that gives up must not leave a joined group untracked.
        return await asyncio.shield(asyncio.ensure_future(self._join(parsed)))

    async def _join(self, parsed: InitWeightsUpdateGroupRequest) -> ControlResult:
        async with self._lock:
            if parsed.group_name in self.groups:
                return _result(False, f"Failed to initialize custom process group: the group "
                                      f"{parsed.group_name!r} already exists.")
            try:
                group = await in_daemon_thread(lambda: join_weight_update_group(
                    master_address=parsed.master_address, master_port=parsed.master_port,
                    rank=parsed.rank_offset, world_size=parsed.world_size, group_name=parsed.group_name,
                    backend=parsed.backend, timeout_s=self.group_timeout_s), "engine-weights-join")
            except Exception as exc:  # no store, a member missing at the timeout, …
                return _result(False, f"Failed to initialize custom process group: {exc}.")
            self.groups[parsed.group_name] = group
            return _result(True, "Succeeded to initialize custom process group.")

    def begin(self) -> ControlResult:
        if self._session:
            return _result(False, "a weight-update session is already open; call end_weight_update() first")
        self._session = True
        return _result(True, "Success")

    def end(self) -> ControlResult:
        if not self._session:
            return _result(False, "no weight-update session is open; call begin_weight_update() first")
        self._session = False
        return _result(True, "Success")

    @staticmethod
    def specs(parsed: UpdateWeightsFromDistributedRequest) -> list[TensorSpec]:
        """What to allocate for the receive; RequestError when it cannot be received at all."""
        if parsed.load_format not in (None, FLATTENED_BUCKET):
            raise RequestError("load_format", f"expected null or {FLATTENED_BUCKET!r}, got {parsed.load_format!r}")
        specs = []
        for i, (name, dtype, shape) in enumerate(zip(parsed.names, parsed.dtypes, parsed.shapes, strict=True)):
            try:
                specs.append(TensorSpec(name, parse_dtype(dtype), tuple(shape)))
            except ValueError as exc:  # a name this torch build does not have
                raise RequestError(f"dtypes[{i}]", str(exc)) from None
        if parsed.load_format == FLATTENED_BUCKET:
            try:
                Bucket.layout(specs)
            except ValueError as exc:
                raise RequestError("dtypes", f"cannot lay out the flattened bucket: {exc}") from None
        return specs

    async def update(self, parsed: UpdateWeightsFromDistributedRequest, specs: list[TensorSpec]) -> ControlResult:
        # Refusals that happen before receiving, as in SGLang (the sender's broadcast then waits).
        if not self._session:
            return _result(False, "update_weights_from_distributed must run between begin_weight_update() and "
                                  "end_weight_update()")
        if parsed.group_name not in self.groups:
            return _result(False, f"Failed to receive weights: the group {parsed.group_name!r} is not initialized "
                                  f"(call init_weights_update_group first)")
        # Shielded: once receiving, the engine finishes the collective even if the client left.
        return await asyncio.shield(asyncio.ensure_future(self._receive_and_load(parsed, specs)))

    async def _receive_and_load(self, parsed: UpdateWeightsFromDistributedRequest, specs: list[TensorSpec]
                                ) -> ControlResult:
        async with self._lock:
            group = self.groups.get(parsed.group_name)
            if group is None:  # destroyed while this request waited for the lock
                return _result(False, f"Failed to receive weights: the group {parsed.group_name!r} is not "
                                      f"initialized")
            async with self.scheduler.weight_update(parsed.abort_all_requests):
                try:
                    received = await in_daemon_thread(
                        lambda: receive_named_tensors(group, specs, parsed.load_format), "engine-weights-receive")
                except Exception as exc:  # a member failed or timed out: this group is out of step
                    return _result(False, f"Failed to receive weights: {exc}")
                if parsed.flush_cache and self.scheduler.pending():
                    return _result(False, self.scheduler.flush_refusal("flush_cache"))
                async with self.scheduler.load_lock:
                    return await self.scheduler.compute(load_received, self.served, received, parsed)

    async def destroy(self, group_name: str) -> ControlResult:
        async with self._lock:  # after the collectives already queued on it
            group = self.groups.pop(group_name, None)
            if group is not None:
                group.close()
        if group is None:
            return _result(False, "The group to be destroyed does not exist.")
        return _result(True, "Succeeded to destroy custom process group.")

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
