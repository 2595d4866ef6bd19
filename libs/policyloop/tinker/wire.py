"""Between the Tinker API's protobuf tensors and numpy: the inputs of a forward_backward
request, and the per-datum outputs of its result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from policyloop.contracts.v1 import tinker_wire_pb2 as wire

NUMPY_DTYPES: dict[int, np.dtype] = {
    wire.DTYPE_FLOAT32: np.dtype("<f4"), wire.DTYPE_INT64: np.dtype("<i8"), wire.DTYPE_INT32: np.dtype("<i4"),
}
WIRE_DTYPES = {np.dtype("float32"): wire.DTYPE_FLOAT32, np.dtype("int64"): wire.DTYPE_INT64,
               np.dtype("int32"): wire.DTYPE_INT32}


class WireError(ValueError):
    """A request the Tinker API cannot take; the message names the part (data[i].loss_fn_inputs.x)."""


def tensor_array(tensor: wire.Tensor, where: str) -> np.ndarray:
    """A wire Tensor as a numpy array of its shape (dense or CSR)."""
    dtype = NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {wire.DType.Name(tensor.dtype)} is not float32, int64 or int32")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{where}: negative dimension in shape {list(shape)}")
    count = int(np.prod(shape)) if shape else None
    if tensor.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"{where}: a CSR tensor must be 2-D, got shape {list(shape)}")
        csr = tensor.sparse_csr
        values = _frombuffer(csr.values, dtype, f"{where}.sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where}.sparse_csr.crow_indices")
        cols = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where}.sparse_csr.col_indices")
        rows, width = shape
        if len(crow) != rows + 1 or len(cols) != len(values) or crow[0] != 0 or crow[-1] != len(values) \
                or np.any(np.diff(crow) < 0) or np.any((cols < 0) | (cols >= width)):
            raise WireError(f"{where}: inconsistent CSR indices for shape {list(shape)}")
        dense = np.zeros(shape, dtype=dtype)
        dense[np.repeat(np.arange(rows), np.diff(crow)), cols] = values
        return dense
    values = _frombuffer(tensor.dense, dtype, f"{where}.dense")
    if count is None:
        return values
    if values.size != count:
        raise WireError(f"{where}: {values.size} values do not fill shape {list(shape)}")
    return values.reshape(shape)


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes are not whole {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))


@dataclass(frozen=True)
class Example:
    """One datum: the model's input tokens, and its loss inputs by name (aligned with the input:
    position i holds what concerns the token that follows position i)."""

    tokens: np.ndarray                  # int64 (N,)
    inputs: Mapping[str, np.ndarray]


def examples(request: wire.ForwardBackwardRequest, vocab_size: int) -> list[Example]:
    if not request.data:
        raise WireError("data: empty")
    out = []
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        parts = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"{where}.model_input[{j}]: {kind} chunks are not supported (text models only)")
            parts.append(_frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"{where}.model_input[{j}]"))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        if tokens.size == 0:
            raise WireError(f"{where}.model_input: no tokens")
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            raise WireError(f"{where}.model_input: token ids outside the vocabulary [0, {vocab_size})")
        inputs = {name: tensor_array(datum.loss_fn_inputs[name], f"{where}.loss_fn_inputs.{name}")
                  for name in sorted(datum.loss_fn_inputs)}
        for name, array in inputs.items():
            if array.ndim != 1 or array.shape[0] != tokens.size:
                raise WireError(f"{where}.loss_fn_inputs.{name}: shape {list(array.shape)}, expected [{tokens.size}] "
                                f"(one per input token)")
        for name, array in inputs.items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise WireError(f"{where}.loss_fn_inputs.{name}: not finite (NaN or infinity)")
        target = inputs.get("target_tokens")
        if target is not None and target.dtype.kind != "i":
            raise WireError(f"{where}.loss_fn_inputs.target_tokens: token ids are integers (int64), got {target.dtype}")
        if target is not None and (target.min() < 0 or target.max() >= vocab_size):
            raise WireError(f"{where}.loss_fn_inputs.target_tokens: ids outside the vocabulary [0, {vocab_size})")
        out.append(Example(tokens, inputs))
    return out


def batched(arrays: Sequence[np.ndarray]) -> wire.BatchedTensor:
    """Per-datum 1-D arrays of one field as the result's BatchedTensor."""
    dtype = arrays[0].dtype if arrays else np.dtype("float32")
    raw = [np.ascontiguousarray(a, dtype=dtype.newbyteorder("<")).tobytes() for a in arrays]
    offsets = np.cumsum([0, *(len(r) for r in raw)], dtype="<i8")
    return wire.BatchedTensor(data=b"".join(raw), offsets=offsets.tobytes(), dtype=WIRE_DTYPES[dtype])


def output(outputs: Mapping[str, Sequence[np.ndarray]], metrics: Mapping[str, float],
           output_type: str = "ArrayRecord") -> wire.ForwardBackwardOutput:
    count = len(next(iter(outputs.values()))) if outputs else 0
    record = wire.ArrayRecord(type_tag=output_type, num_datums=count,
                              fields={name: batched(arrays) for name, arrays in outputs.items()})
    return wire.ForwardBackwardOutput(loss_fn_output_type=output_type, loss_fn_outputs=[record],
                                      metrics=dict(metrics))


def loss_config(request: wire.ForwardBackwardRequest) -> dict[str, float | str]:
    """loss_fn_config, v2 preferred (it also carries strings)."""
    config: dict[str, float | str] = dict(request.loss_fn_config)
    for name, value in request.loss_fn_config_v2.items():
        config[name] = value.number if value.WhichOneof("value") == "number" else value.text
    return config
