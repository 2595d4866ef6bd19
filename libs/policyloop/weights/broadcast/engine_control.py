"""What the broadcast sender needs of an engine: SGLang's weight-sync and pause routes, as a
protocol. `policyloop.engines.sglang_client.SGLangClient` implements it for SGLang and the embedded
engine alike; the sender knows nothing else of engines, so this package never imports them."""

from __future__ import annotations

from typing import Any, Literal, Protocol, get_args

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
"""SGLang's /pause_generation modes: end requests now, free their cache, or keep them in place."""

BackendName = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default name of the weight-update group."""


class EngineControlError(Exception):
    """An engine refused a control call or could not be reached (an engine client's errors derive
    from it, so the sender can tell an engine's failure from its own)."""


class WeightSyncError(RuntimeError):
    """A weight update did not complete: an engine refused or failed it, or the group broke."""


class EngineControl(Protocol):
    """One engine, as the colocated sender drives it. Every call raises EngineControlError when the
    engine refuses; none may be resent once it could have reached the engine."""

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str, backend: str) -> Any: ...

    async def begin_weight_update(self) -> Any: ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str, load_format: str | None,
                                              weight_version: str | None, flush_cache: bool) -> Any: ...

    async def end_weight_update(self) -> Any: ...

    async def destroy_weights_update_group(self, group_name: str) -> Any: ...

    async def pause_generation(self, mode: str) -> None: ...

    async def continue_generation(self) -> None: ...

