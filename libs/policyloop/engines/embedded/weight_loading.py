"""New weights into the served model, in place, all or nothing: from a safetensors directory
(`/update_weights_from_disk`), from tensors sent in the request (`/update_weights_from_tensor`)
or from tensors received by broadcast (`/update_weights_from_distributed`). Every name and shape
is checked before anything is copied; any failure leaves the old weights and version serving.
Runs on the compute thread, between two decode steps."""

from __future__ import annotations

from pathlib import Path

import torch

from policyloop.engines.embedded.model import ServedModel
from policyloop.engines.protocol import (
    ControlResult,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResult,
)


def load_from_disk(served: ServedModel, req: UpdateWeightsFromDiskRequest) -> UpdateWeightsResult:
    def fail(message: str) -> UpdateWeightsResult:
        return _failed(served, message)

    if req.load_format not in (None, "auto", "safetensors"):
        return fail(f"load_format {req.load_format!r} is not supported (auto or safetensors)")
    path = Path(req.model_path)
    if not path.is_dir():
        return fail(f"{path} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return fail(f"no *.safetensors files in {path}")
    params = served.parameters()
    loaded, problem = _read_checked(files, params)
    if problem:
        return fail(problem)
    missing = _uncovered(params, loaded)
    if missing:
        return fail(f"missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}")
    served.model_path = str(path)
    return _copy_in(served, params, loaded, req.weight_version)


def load_sent(served: ServedModel, tensors: dict[str, torch.Tensor], req: UpdateWeightsFromTensorRequest
              ) -> UpdateWeightsResult:
    """The tensors of /update_weights_from_tensor (any of the model's parameters, as SGLang takes
    them), each checked by name, shape and kind before any is copied."""
    if req.selector == "draft":
        return _failed(served, "the embedded engine has no draft model (selector 'draft')")
    params = served.parameters()
    for name, tensor in tensors.items():
        target = params.get(name)
        if target is None:
            return _failed(served, f"{name!r} is not a parameter of the served model")
        problem = _mismatch(name, tensor, target, "sent")
        if problem:
            return _failed(served, problem)
    return _copy_in(served, params, tensors, req.weight_version)


def _failed(served: ServedModel, message: str) -> UpdateWeightsResult:
    return UpdateWeightsResult(success=False, message=f"Failed to update weights: {message}. The old weights "
                                                      f"(version {served.weight_version}) keep serving.")


def _mismatch(name: str, tensor: torch.Tensor, target: torch.Tensor, source: str) -> str:
    if tuple(tensor.shape) != tuple(target.shape):
        return (f"shape mismatch for {name!r}: {tuple(tensor.shape)} {source}, {tuple(target.shape)} in the served "
                f"model")
    if tensor.is_floating_point() != target.is_floating_point():
        return f"dtype mismatch for {name!r}: {tensor.dtype} {source}, the served model has {target.dtype}"
    return ""


def _copy_in(served: ServedModel, params: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor],
             weight_version: str | None) -> UpdateWeightsResult:
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor)  # casts to the parameter's dtype
    message = "Succeeded to update model weights."
    if weight_version is not None:
        served.weight_version = weight_version
        message += f" Weight version updated to {weight_version}."
    return UpdateWeightsResult(success=True, message=message)


def _read_checked(files: list[Path], params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the files, each a parameter of the served model with its shape; or what is wrong."""
    from safetensors import safe_open

    loaded: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in params:
                        return {}, f"{file.name} holds {name!r}, which the served model does not have"
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        return {}, (f"shape mismatch for {name!r}: {tuple(tensor.shape)} in {file.name}, "
                                    f"{tuple(params[name].shape)} in the served model")
                    loaded[name] = tensor
    except Exception as exc:  # unreadable or truncated file
        return {}, f"cannot read the safetensors files ({exc})"
    return loaded, ""


def _uncovered(params: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    """Parameters nothing was loaded for. Tied parameters (e.g. lm_head and embeddings) are saved
    once: a name is covered when any name sharing its storage was loaded."""
    storage: dict[int, list[str]] = {}
    for name, tensor in params.items():
        storage.setdefault(tensor.data_ptr(), []).append(name)
    return [name for name, tensor in params.items() if not any(n in loaded for n in storage[tensor.data_ptr()])]


def load_received(served: ServedModel, received: list[tuple[str, torch.Tensor]],
                  req: UpdateWeightsFromDistributedRequest) -> ControlResult:
    """Copies received tensors into the served parameters after checking all of them: one bad
    tensor drops the whole bucket."""

    def fail(message: str) -> ControlResult:
        return ControlResult(success=False, message=f"Failed to update parameter online: {message}. The old weights "
                                                    f"of these tensors (version {served.weight_version}) keep serving.")

    if req.selector == "draft":
        return fail("the embedded engine has no draft model (selector 'draft')")
    params = served.parameters()
    for name, tensor in received:
        target = params.get(name)
        if target is None:
            return fail(f"{name!r} is not a parameter of the served model")
        if tuple(tensor.shape) != tuple(target.shape):
            return fail(f"shape mismatch for {name!r}: received {list(tensor.shape)}, the served model has "
                        f"{list(target.shape)}")
        if tensor.is_floating_point() != target.is_floating_point():
            return fail(f"dtype mismatch for {name!r}: received {tensor.dtype}, the served model has "
                        f"{target.dtype}")
    with torch.no_grad():
        for name, tensor in received:
            params[name].copy_(tensor)  # casts to the parameter's dtype, as a disk load does
    message = "Succeeded to update parameter online."
    if req.weight_version is not None:
        served.weight_version = req.weight_version
        message += f" Weight version updated to {req.weight_version}."
    return ControlResult(success=True, message=message)
