"""Between torch tensors and the codec's raw bytes (torch-side services only: the publisher
never imports torch)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from policyloop.weights.codec import TensorBytes, WeightSet

# torch dtypes → the safetensors names (as safetensors.torch writes them) of the codec's dtypes.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8",
    torch.uint16: "U16", torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.uint32: "U32", torch.int32: "I32", torch.float32: "F32",
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype the codec carries."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"{dtype} has no whole-byte safetensors dtype the weight codec carries (sub-byte and "
                         f"packed dtypes such as torch.float4_e2m1fn_x2, and complex128, have none); the codec "
                         f"carries {sorted(str(d) for d in DTYPE_NAMES)}") from None


def _refuse_without_dense_bytes(tensor: torch.Tensor, name: str) -> None:
    """Refuses a tensor that holds no dense array of its elements: torch's own errors for these
    (NotImplementedError for meta, RuntimeErrors for sparse layouts) name neither the tensor nor
    what to do."""
    if tensor.is_meta:
        raise ValueError(f"{name}: a meta tensor has no data (its weights were never materialized: load or "
                         "initialize them before sending)")
    if tensor.is_nested:
        raise ValueError(f"{name}: a nested tensor has no single shape the weight codec can carry")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: a {tensor.layout} tensor; the weight codec carries dense (torch.strided) "
                         "tensors: send tensor.to_dense()")


def to_bytes(tensor: torch.Tensor, name: str = "tensor") -> TensorBytes:
    """A CPU copy of the tensor's bytes (the learner keeps training its own); `name` names it in
    a refusal (ValueError) of a tensor the codec cannot carry."""
    _refuse_without_dense_bytes(tensor, name)
    try:
        dtype = dtype_name(tensor.dtype)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().copy() if flat.numel() else np.empty(0, dtype=np.uint8)
    return TensorBytes(dtype, tuple(tensor.shape), data)


def to_tensor(tensor: TensorBytes) -> torch.Tensor:
    """A torch view of the bytes (no copy)."""
    if tensor.data.size == 0:
        return torch.empty(tensor.shape, dtype=TORCH_DTYPES[tensor.dtype])
    return torch.from_numpy(tensor.data).view(TORCH_DTYPES[tensor.dtype]).reshape(tensor.shape)


def weight_set(version: int, tensors: Mapping[str, torch.Tensor]) -> WeightSet:
    """The tensors as a version; a ValueError naming the tensor for one the codec cannot carry
    (meta, nested, sparse or another non-dense layout, a dtype without whole bytes)."""
    return WeightSet.build(version, {name: to_bytes(t, name) for name, t in tensors.items()})


def safetensors_bytes(weights: WeightSet) -> bytes:
    """The weights as the bytes of a plain safetensors file (sent to an engine in a request)."""
    return safetensors.torch.save({name: to_tensor(t) for name, t in weights.tensors.items()},
                                  metadata={"format": "pt", "policy_version": str(weights.version)})


def save_safetensors(weights: WeightSet, path: Path) -> None:
    """Writes the weights as a plain safetensors file (e.g. model.safetensors of an HF directory)."""
    safetensors.torch.save_file({name: to_tensor(t) for name, t in weights.tensors.items()}, str(path),
                                metadata={"format": "pt", "policy_version": str(weights.version)})


def write_version_dir(root: Path, base: Path, weights: WeightSet) -> Path:
    """A Hugging Face directory for the held weights: the base config plus model.safetensors."""
    target = root / f"v{weights.version:09d}"
    tmp = root / f".v{weights.version:09d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    save_safetensors(weights, tmp / "model.safetensors")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
