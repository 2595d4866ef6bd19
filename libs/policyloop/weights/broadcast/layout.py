"""Where every tensor's bytes sit in a broadcast bucket (pure: no process group, no engine).

SGLang 0.5.23 receives `load_format="flattened_bucket"` with `FlattenedTensorBucket.empty(names,
dtypes, shapes)`: one 1-D torch.uint8 buffer of the summed byte sizes, every tensor's raw bytes
back to back in the order of `names`, no padding, and it refuses a tensor whose byte offset is not
a multiple of its dtype's size; it broadcasts that buffer from rank 0 and views each slice as
`dtype` and `shape`. The planner puts one dtype in each bucket, so every offset is aligned by
construction and the bucket means the same to older SGLang releases that concatenated tensors of
the bucket's dtype. Dtypes travel by name: SGLang resolves them with getattr(torch, name).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's load_format for a bucket broadcast as one flattened uint8 buffer."""

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16" (what SGLang's receiver passes to getattr(torch, …))."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" → torch.bfloat16; ValueError for a name that is not a torch dtype."""
    value = getattr(torch, name, None) if name and not name.startswith("_") else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate a tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(int(d) for d in tensor.shape))


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket and where its bytes sit in the flattened buffer."""

    spec: TensorSpec
    offset: int  # in bytes, from the start of the buffer

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast together as one uint8 buffer: each one's bytes at `offset`, back to
    back in order, `nbytes` in all (SGLang's FlattenedTensorBucket layout)."""

    entries: tuple[BucketEntry, ...]
    nbytes: int

    @classmethod
    def layout(cls, specs: Sequence[TensorSpec]) -> Bucket:
        """Lays `specs` out in order. Raises ValueError for an empty bucket, a negative dimension,
        or a tensor whose offset is not a multiple of its element size (SGLang refuses those:
        the receiver views each slice as its dtype)."""
        if not specs:
            raise ValueError("a bucket needs at least one tensor")
        entries = []
        offset = 0
        for spec in specs:
            if any(d < 0 for d in spec.shape):
                raise ValueError(f"{spec.name!r}: negative dimension in shape {spec.shape}")
            if offset % spec.dtype.itemsize:
                raise ValueError(f"{spec.name!r}: byte offset {offset} is not aligned to its {dtype_name(spec.dtype)} "
                                 f"elements ({spec.dtype.itemsize} bytes)")
            entries.append(BucketEntry(spec, offset))
            offset += spec.nbytes
        return cls(tuple(entries), offset)

    @property
    def specs(self) -> list[TensorSpec]:
        return [e.spec for e in self.entries]

    @property
    def names(self) -> list[str]:
        return [e.spec.name for e in self.entries]

    @property
    def dtype_names(self) -> list[str]:
        return [dtype_name(e.spec.dtype) for e in self.entries]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(e.spec.shape) for e in self.entries]


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Groups tensors into buckets of at most `bucket_bytes`, one dtype per bucket.

    Tensors keep their order within each dtype (one bucket per dtype fills at a time); a bucket
    is emitted when the next tensor of its dtype would not fit, and a tensor larger than the
    limit goes alone into its own bucket. Buckets come out in the order they were closed, the
    ones still open at the end last (in the order their dtype first appeared)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    open_buckets: dict[torch.dtype, list[TensorSpec]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    planned: list[Bucket] = []
    for spec in specs:
        current = open_buckets.setdefault(spec.dtype, [])
        if current and open_bytes[spec.dtype] + spec.nbytes > bucket_bytes:
            planned.append(Bucket.layout(current))
            current = open_buckets[spec.dtype] = []
        if spec.nbytes > bucket_bytes:  # too big for any bucket: alone (after what came before it)
            planned.append(Bucket.layout([spec]))
            continue
        current.append(spec)
        open_bytes[spec.dtype] = sum(s.nbytes for s in current)
    planned.extend(Bucket.layout(rest) for rest in open_buckets.values() if rest)
    return planned


def flatten_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """The bucket's uint8 buffer: each tensor's raw bytes (contiguous, native byte order) at its
    offset. `tensors` must hold every entry's name with the planned dtype and shape."""
    first = tensors[bucket.entries[0].spec.name] if bucket.entries else None
    target = torch.device(device) if device is not None else (first.device if first is not None else "cpu")
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=target)
    for entry in bucket.entries:
        spec = entry.spec
        tensor = tensors.get(spec.name)
        if tensor is None:
            raise KeyError(f"{spec.name!r}: no tensor given for this bucket entry")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name!r}: planned {dtype_name(spec.dtype)}{list(spec.shape)}, got "
                             f"{dtype_name(tensor.dtype)}{list(tensor.shape)}")
        buffer[entry.offset:entry.end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unflatten_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received buffer, in bucket order: views into `buffer` (no copy),
    with each entry's dtype and shape and exactly the bytes that were sent."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != bucket.nbytes:
        raise ValueError(f"expected a 1-D uint8 buffer of {bucket.nbytes} bytes, got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    return [(e.spec.name, buffer[e.offset:e.end].view(e.spec.dtype).reshape(e.spec.shape)) for e in bucket.entries]


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each engine's first rank and the world size, with the sender as rank 0: engines with
    tp_sizes [2, 2] get offsets [1, 3] in a world of 5."""
    if any(tp < 1 for tp in tp_sizes):
        raise ValueError(f"tp sizes must be >= 1, got {list(tp_sizes)}")
    offsets = []
    next_rank = 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank
