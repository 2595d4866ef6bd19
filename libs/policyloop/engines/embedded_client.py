"""The client of the embedded engine: SGLang's protocol (SGLangClient) and the engine's own routes
for a version staged beside the served one and swapped in at a step boundary. SGLang 0.5.23 has
no such routes; with SGLang a version goes pause → update → continue."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from policyloop.engines.protocol import (
    SAFETENSORS_FORMAT,
    ActivateStagedWeightsRequest,
    ActivateStagedWeightsResult,
    StageWeightsFromDiskRequest,
    StageWeightsFromTensorRequest,
    StageWeightsResult,
)
from policyloop.engines.sglang_client import EngineProtocolError, SGLangClient, WeightUpdateError

R = TypeVar("R", StageWeightsResult, ActivateStagedWeightsResult)


class EmbeddedEngineClient(SGLangClient):
    """SGLangClient plus staging and activation (the embedded engine only)."""

    async def stage_weights_from_disk(self, model_path: str, weight_version: str) -> StageWeightsResult:
        """Stages the weights in `model_path` as `weight_version` while the engine keeps generating
        with the weights it serves; WeightUpdateError with the engine's reason when refused."""
        req = StageWeightsFromDiskRequest(model_path=model_path, weight_version=str(weight_version))
        return await self._weights_call("/stage_weights_from_disk", req.to_json(), StageWeightsResult.from_json,
                                        idempotent=True)

    async def stage_weights_from_tensor(self, safetensors: bytes, weight_version: str) -> StageWeightsResult:
        """Stages the tensors of one safetensors file sent in the request, as stage_weights_from_disk."""
        req = StageWeightsFromTensorRequest(serialized_named_tensors=[safetensors], load_format=SAFETENSORS_FORMAT,
                                            weight_version=str(weight_version))
        return await self._weights_call("/stage_weights_from_tensor", req.to_json(), StageWeightsResult.from_json,
                                        idempotent=True)

    async def activate_staged_weights(self, weight_version: str) -> ActivateStagedWeightsResult:
        """Swaps the staged `weight_version` in at the engine's next step boundary and checks that
        /model_info then reports it. Not resent: a second activation finds nothing staged."""
        req = ActivateStagedWeightsRequest(weight_version=str(weight_version))
        result = await self._weights_call("/activate_staged_weights", req.to_json(),
                                          ActivateStagedWeightsResult.from_json, idempotent=False)
        served = (await self.model_info()).weight_version
        if served != str(weight_version):
            raise WeightUpdateError(f"activate_staged_weights({weight_version!r}) succeeded but the engine reports "
                                    f"weight_version {served!r}", 200, "")
        return result

    async def _weights_call(self, path: str, payload: dict[str, Any], parse: Callable[[Any], R], *,
                            idempotent: bool) -> R:
        status, body = await self._call("POST", path, payload, idempotent=idempotent)
        try:
            result = parse(json.loads(body))
        except ValueError:
            self._raise_for_status("POST", path, status, body)  # a refused body: SGLang's ErrorResponse
            raise EngineProtocolError(f"{path}: unexpected answer {body[:200]!r}", status, body) from None
        if not result.success or status >= 400:
            raise WeightUpdateError(f"POST {path} failed: {result.message}", status, body)
        return result
