"""New weights into the served model, all or nothing: in place from a safetensors directory
(`/update_weights_from_disk`), from tensors sent in the request (`/update_weights_from_tensor`)
or from tensors received by broadcast (`/update_weights_from_distributed`); or staged beside the
served weights from either of the first two (`/stage_weights_from_*`, while generation goes on)
and swapped in by `/activate_staged_weights`. Every name and shape is checked before anything is
copied or staged; any failure leaves the old weights and version serving. Copies and swaps run on
the compute thread, between two decode steps; staging runs beside it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from policyloop.engines.embedded.model import ServedModel
from policyloop.engines.protocol import (
    ActivateStagedWeightsResult,
    ControlResult,
    StageWeightsFromDiskRequest,
    StageWeightsFromTensorRequest,
    StageWeightsResult,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResult,
)


def load_from_disk(served: ServedModel, req: UpdateWeightsFromDiskRequest) -> UpdateWeightsResult:
    if req.load_format not in (None, "auto", "safetensors"):
        return _failed(served, f"load_format {req.load_format!r} is not supported (auto or safetensors)")
    params = served.parameters()
    loaded, problem = _checked_directory(params, Path(req.model_path))
    if problem:
        return _failed(served, problem)
    served.model_path = req.model_path
    return _copy_in(served, params, loaded, req.weight_version)


def _checked_directory(params: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the directory's safetensors files, each one of `params` (the served model's)
    with its shape, every parameter covered; or what is wrong."""
    if not path.is_dir():
        return {}, f"{path} is not a directory"
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return {}, f"no *.safetensors files in {path}"
    loaded, problem = _read_checked(files, params)
    if problem:
        return {}, problem
    missing = _uncovered(params, loaded)
    if missing:
        return {}, f"missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}"
    return loaded, ""


def load_sent(served: ServedModel, tensors: dict[str, torch.Tensor], req: UpdateWeightsFromTensorRequest
              ) -> UpdateWeightsResult:
    """The tensors of /update_weights_from_tensor (any of the model's parameters, as SGLang takes
    them), each checked by name, shape and kind before any is copied."""
    if req.selector == "draft":
        return _failed(served, "the embedded engine has no draft model (selector 'draft')")
    params = served.parameters()
    problem = _sent_problem(params, tensors)
    if problem:
        return _failed(served, problem)
    return _copy_in(served, params, tensors, req.weight_version)


def _sent_problem(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> str:
    for name, tensor in tensors.items():
        target = params.get(name)
        if target is None:
            return f"{name!r} is not a parameter of the served model"
        problem = _mismatch(name, tensor, target, "sent")
        if problem:
            return problem
    return ""


@dataclass(frozen=True)
class StagedWeights:
    """A version placed beside the served weights: each served tensor with its replacement, already
    on the served device in the served dtype, so activating is a swap of storage, not a copy."""
    version: str
    swaps: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (served parameter or buffer, its replacement)
    bytes: int
    model_path: str | None


def stage_from_disk(served: ServedModel, req: StageWeightsFromDiskRequest) -> StageWeightsResult:
    """Reads and checks a directory's weights and stages them (off the compute thread)."""
    started = time.perf_counter()
    params = served.parameters()
    loaded, problem = _checked_directory(params, Path(req.model_path))
    if problem:
        return _not_staged(served, problem)
    return _stage(served, params, loaded, req.weight_version, req.model_path, started)


def stage_sent(served: ServedModel, tensors: dict[str, torch.Tensor], req: StageWeightsFromTensorRequest,
               started: float) -> StageWeightsResult:
    """Checks the tensors sent and stages them (off the compute thread); `started`: when decoding
    the request began, which is part of preparing."""
    params = served.parameters()
    problem = _sent_problem(params, tensors)
    if problem:
        return _not_staged(served, problem)
    return _stage(served, params, tensors, req.weight_version, None, started)


def _stage(served: ServedModel, params: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], version: str,
           model_path: str | None, started: float) -> StageWeightsResult:
    served.staged = None  # an earlier stage goes before this one is made: never two beside the served weights
    objects = served.parameter_objects()
    by_storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in loaded.items():
        # A Parameter's storage is swapped (tied names share the object, so one swap serves them
        # all); anything else in the state dict (a persistent buffer) is copied at activation.
        target = objects.get(name, params[name])
        # A copy, made here: a tensor read from a file maps it, and its pages would otherwise be
        # read in by the first decode step after the swap.
        replacement = tensor.detach().to(device=target.device, dtype=target.dtype, copy=True,
                                          memory_format=torch.contiguous_format)
        by_storage[params[name].data_ptr()] = (target, replacement)  # the last of tied names wins, as copies do
    swaps = tuple(by_storage.values())
    staged = StagedWeights(version=version, swaps=swaps, model_path=model_path,
                           bytes=sum(t.numel() * t.element_size() for _, t in swaps))
    served.staged = staged
    return StageWeightsResult(success=True, message=f"Staged version {version}.", weight_version=version,
                              tensors=len(swaps), bytes=staged.bytes, prepare_s=time.perf_counter() - started)


def _not_staged(served: ServedModel, message: str) -> StageWeightsResult:
    return StageWeightsResult(success=False, message=f"Failed to stage weights: {message}. Version "
                                                     f"{served.weight_version} keeps serving; nothing was staged.")


def activate_staged(served: ServedModel, version: str) -> tuple[ActivateStagedWeightsResult, list[torch.Tensor]]:
    """Swaps the staged version in (on the compute thread, between two decode steps): each served
    parameter takes its replacement's storage, so the pause is a pointer per tensor, whatever the
    model's size. Returns the answer and the tensors replaced: the caller drops them off the compute
    thread, since freeing a model's worth of memory takes as long as the swap should not."""
    staged: StagedWeights | None = served.staged
    if staged is None or staged.version != version:
        what = "nothing is staged" if staged is None else f"version {staged.version} is staged"
        return ActivateStagedWeightsResult(success=False, message=f"Failed to activate version {version}: {what}. "
                                                                  f"Version {served.weight_version} keeps serving."), []
    retired: list[torch.Tensor] = []
    started = time.perf_counter()
    with torch.no_grad():
        for target, replacement in staged.swaps:
            if isinstance(target, torch.nn.Parameter):
                retired.append(target.data)
                target.data = replacement
            else:
                target.copy_(replacement)
    served.weight_version = staged.version
    pause_s = time.perf_counter() - started
    served.staged = None
    if staged.model_path is not None:
        served.model_path = staged.model_path
    return ActivateStagedWeightsResult(success=True, message=f"Version {version} serves.", weight_version=version,
                                       pause_s=pause_s), retired


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
    served.staged = None  # staged against the weights replaced now
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
    served.staged = None
    message = "Succeeded to update parameter online."
    if req.weight_version is not None:
        served.weight_version = req.weight_version
        message += f" Weight version updated to {req.weight_version}."
    return ControlResult(success=True, message=message)
