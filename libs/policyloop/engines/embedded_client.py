"""The client of the embedded engine: SGLang's protocol (SGLangClient) and the engine's own routes
for a version staged beside the served one and swapped in at a step boundary. SGLang 0.5.23 has
no such routes; with SGLang a version goes pause → update → continue."""

from __future__ import annotations

from policyloop.engines.protocol import (
    SAFETENSORS_FORMAT,
    ActivateStagedWeightsRequest,
    ActivateStagedWeightsResult,
    StageWeightsFromDiskRequest,
    StageWeightsFromTensorRequest,
    StageWeightsResult,
)
from policyloop.engines.sglang_client import SGLangClient


class EmbeddedEngineClient(SGLangClient):
    """SGLangClient plus staging and activation (the embedded engine only)."""

    async def stage_weights_from_disk(self, model_path: str, weight_version: str) -> StageWeightsResult:
        """Stages the weights in `model_path` as `weight_version` while the engine keeps generating
        with the weights it serves; WeightUpdateError with the engine's reason when refused."""
        req = StageWeightsFromDiskRequest(model_path=model_path, weight_version=str(weight_version))
        return await self._succeeded("/stage_weights_from_disk", req.to_json(), StageWeightsResult.from_json,
                                     f"stage_weights_from_disk({model_path!r})", idempotent=True)

    async def stage_weights_from_tensor(self, safetensors: bytes, weight_version: str) -> StageWeightsResult:
        """Stages the tensors of one safetensors file sent in the request, as stage_weights_from_disk."""
        req = StageWeightsFromTensorRequest(serialized_named_tensors=[safetensors], load_format=SAFETENSORS_FORMAT,
                                            weight_version=str(weight_version))
        return await self._succeeded("/stage_weights_from_tensor", req.to_json(), StageWeightsResult.from_json,
                                     "stage_weights_from_tensor", idempotent=True)

    async def activate_staged_weights(self, weight_version: str) -> ActivateStagedWeightsResult:
        """Swaps the staged `weight_version` in at the engine's next step boundary and checks that
        /model_info then reports it. Not resent: a second activation finds nothing staged."""
        req = ActivateStagedWeightsRequest(weight_version=str(weight_version))
        return await self._versioned_update("/activate_staged_weights", req.to_json(),
                                            ActivateStagedWeightsResult.from_json,
                                            f"activate_staged_weights({weight_version!r})", str(weight_version),
                                            idempotent=False)
