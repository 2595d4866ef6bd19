"""Exact weight deltas: per tensor, the XOR of the raw bytes against the base version, split into
byte planes, each plane compressed by zstd (level 1) in independent frames.

RL steps at small learning rates leave most served (bf16) weights bit-identical, so the XOR is
mostly zero bytes, and splitting it into byte planes puts the rare changed mantissa bytes in one
plane and the nearly-always-zero sign/exponent bytes in another — both compress far better than
the interleaved bytes would. Exact by construction: applying XOR(new, base) to base gives new,
bit for bit, for any dtype; XOR is its own inverse, which is how a failed apply is undone.

A payload is a safetensors container whose tensors are the zstd frames (uint8), named
`<tensor>/plane<p>/frame<f>` (or `<tensor>/raw` for the uncompressed encoding). Its
`__metadata__` has one key, `policyloop.weights`, holding canonical JSON (sorted keys, no
spaces) with everything needed to check it before touching any weights: the codec tag, the kind
(delta or keyframe), base and new version, the base version's manifest hash (so a delta is
applied only to exactly the weights it was made from, never twice), the frame size, per tensor
its name, dtype, shape, encoding, frame count and the xxh3-128 of its new bytes, the manifest
hash of the new version (its number and every tensor's name, dtype, shape and hash) and the
header's own hash. One key, canonical JSON: the same weights always encode to the same bytes.

Per-tensor encodings:
- `same`  unchanged since the base: header and hash only.
- `xor`   XOR against the base, byte planes, zstd.
- `full`  the new bytes, byte planes, zstd (a keyframe, or a tensor whose XOR would not be smaller).
- `raw`   the new bytes as they are (snapshots and the full-weights baseline: no compression cost).

Reading trusts nothing: every header field, the container's layout and every frame's declared
size are checked (O(header), nothing decompressed) before anything is allocated, and anything
wrong with a payload raises a CodecError.

Work is spread over a thread pool by frame: zstd, numpy and xxhash release the GIL.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import safetensors.numpy
import xxhash
import zstandard

CODEC = "policyloop.xor-planes-zstd/2"
# safetensors keeps `__metadata__` in a hash map whose order varies from save to save, so the
# codec's header is one canonical JSON string under one key.
METADATA_KEY = "policyloop.weights"
DEFAULT_FRAME_BYTES = 4 * 1024 * 1024
MAX_FRAME_BYTES = 1 << 30
MAX_HEADER_BYTES = 100_000_000    # safetensors refuses longer headers
MAX_VERSION = (1 << 63) - 1       # versions travel as int64
MAX_DIMS = 64
ZSTD_LEVEL = 1
# A tensor whose XOR compresses below this fraction of its raw size is taken as a delta without
# also trying a keyframe: trained weights do not compress that far as keyframes (bf16 ≈ 0.7,
# fp32 ≈ 0.8). An AdamW step changes every element, so an fp32 XOR comes to about 0.6: trying the
# keyframe too would double the encoding work for nothing.
_TRY_KEYFRAME_ABOVE = 0.65

Encoding = Literal["same", "xor", "full", "raw"]
Kind = Literal["delta", "keyframe"]
ENCODINGS: tuple[Encoding, ...] = ("same", "xor", "full", "raw")

# safetensors dtype names → bytes per element: every whole-byte dtype of the format.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
# safetensors dtypes narrower than a byte (bits per element): their elements are not whole bytes,
# so they have no byte planes.
SUB_BYTE_BITS: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


# The most bytes a payload may declare its version's tensors to take unless the caller sets a
# bound: more than this machine's memory can never be applied.
DEFAULT_MAX_BYTES = _physical_memory()


class CodecError(Exception):
    """A payload cannot be applied. The message names what is wrong (and which tensor)."""


class WrongBase(CodecError):
    """The delta was made from other weights than the ones held (version or manifest differ)."""


class CorruptPayload(CodecError):
    """The payload is truncated, damaged or inconsistent with its own header."""


class HashMismatch(CodecError):
    """A tensor decoded to bytes whose xxh3-128 is not the one the learner recorded, or the
    header's manifest hash is not the one of the version it describes."""


class ManifestMismatch(CodecError):
    """The payload names a tensor the holder does not have, or changes a dtype or shape."""


class TooLarge(CodecError):
    """The payload declares more bytes of weights than the caller's bound (`max_bytes`)."""


def tensor_digest(data: np.ndarray | bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_digest(entries: Iterable[tuple[str, str, tuple[int, ...] | list[int], str]], *, version: int) -> str:
    """One hash for a whole version: its number, and every tensor's name, dtype, shape and hash
    (sorted by name). Equal manifest hashes mean the same version of the same weights."""
    tensors = sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in entries)
    return xxhash.xxh3_128_hexdigest(_canonical({"version": version, "tensors": tensors}))


def header_digest(fields: Mapping[str, Any]) -> str:
    """The hash a payload's header carries of its own canonical content (all but `header_hash`)."""
    return xxhash.xxh3_128_hexdigest(_canonical({k: v for k, v in fields.items() if k != "header_hash"}))


def _dtype_itemsize(dtype: str) -> int:
    if dtype in SUB_BYTE_BITS:
        raise ValueError(f"dtype {dtype!r} has {SUB_BYTE_BITS[dtype]}-bit elements; the codec carries whole-byte "
                         f"dtypes only: {sorted(ITEMSIZE)}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(ITEMSIZE)}")
    return ITEMSIZE[dtype]


@dataclass
class TensorBytes:
    """One tensor as raw little-endian bytes (a 1-D, C-contiguous uint8 array)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        _dtype_itemsize(self.dtype)
        self.shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {list(self.shape)} has a negative dimension")
        if self.data.dtype != np.uint8 or self.data.ndim != 1 or not self.data.flags.c_contiguous:
            raise ValueError("data must be a 1-D C-contiguous uint8 array")
        if self.data.nbytes != self.numel * self.itemsize:
            raise ValueError(f"{self.data.nbytes} bytes do not hold a {self.dtype} tensor of shape {self.shape}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: no overflow


@dataclass
class WeightSet:
    """A version's weights held in memory, with each tensor's hash and the manifest hash."""

    version: int
    tensors: dict[str, TensorBytes]
    digests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, version: int, tensors: Mapping[str, TensorBytes], pool: Executor | None = None) -> WeightSet:
        names = list(tensors)
        digests = list(_pool(pool).map(lambda n: tensor_digest(tensors[n].data), names))
        return cls(version, dict(tensors), dict(zip(names, digests, strict=True)))

    @property
    def manifest_hash(self) -> str:
        """The one place a version's manifest hash is computed (covers the version number)."""
        return manifest_digest(((n, t.dtype, t.shape, self.digests[n]) for n, t in self.tensors.items()),
                               version=self.version)

    @property
    def raw_bytes(self) -> int:
        return sum(t.data.nbytes for t in self.tensors.values())

    def copy(self) -> WeightSet:
        return WeightSet(self.version, {n: TensorBytes(t.dtype, t.shape, t.data.copy()) for n, t in
                                        self.tensors.items()}, dict(self.digests))


@dataclass(frozen=True)
class EncodeStats:
    kind: Kind
    raw_bytes: int
    payload_bytes: int
    tensors: dict[str, int]            # count per encoding
    changed_elements: int              # elements whose bytes differ from the base (deltas)
    total_elements: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(1, self.payload_bytes)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(1, self.total_elements)


@dataclass(frozen=True)
class Encoded:
    payload: bytes
    stats: EncodeStats


@dataclass(frozen=True)
class PayloadHeader:
    """What a payload's header says, checked against itself and the container (nothing is
    decompressed)."""

    kind: Kind
    version: int
    base_version: int
    base_manifest_hash: str
    manifest_hash: str
    frame_elements: dict[str, int]
    tensors: list[dict[str, Any]]
    frame_bytes: int
    header_hash: str


_thread_state = threading.local()
_shared_pool: ThreadPoolExecutor | None = None
_shared_pool_lock = threading.Lock()


def default_pool() -> ThreadPoolExecutor:
    """One pool per process, a thread per core: the codec's work is GIL-free C."""
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None:
            _shared_pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="weights-codec")
        return _shared_pool


def _pool(pool: Executor | None) -> Executor:
    return pool if pool is not None else default_pool()


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe: one per thread.
    if not hasattr(_thread_state, "compressor"):
        _thread_state.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        _thread_state.decompressor = zstandard.ZstdDecompressor()
    return _thread_state.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    _compressor()
    return _thread_state.decompressor


_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _split_planes(chunk: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Byte p of every element, for each p (little-endian: plane 0 holds the lowest bytes).
    Shifts on whole words run faster than strided byte copies."""
    if itemsize == 1:
        return [chunk]
    words = chunk.view(_UINT_BY_SIZE[itemsize])
    return [(words >> (8 * p)).astype(np.uint8) if p else words.astype(np.uint8) for p in range(itemsize)]


def _join_planes(planes: list[np.ndarray], itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return planes[0]
    word = _UINT_BY_SIZE[itemsize]
    out = planes[0].astype(word)
    for p in range(1, itemsize):
        out |= np.left_shift(planes[p], 8 * p, dtype=word)
    return out.view(np.uint8)


def _frame_elements(itemsize: int, frame_bytes: int) -> int:
    return max(1, frame_bytes // itemsize)


def _frame_count(numel: int, frame_elements: int) -> int:
    """A tensor's frames: at least one, even for an empty tensor."""
    return max(1, -(-numel // frame_elements))


def _frame_span(numel: int, frame_elements: int, index: int) -> tuple[int, int]:
    start = index * frame_elements
    return start, min(numel, start + frame_elements)


def _chunks(numel: int, frame_elements: int) -> list[tuple[int, int]]:
    """Element ranges of a tensor's frames."""
    return [_frame_span(numel, frame_elements, f) for f in range(_frame_count(numel, frame_elements))]


# ---------------------------------------------------------------- encoding


@dataclass
class _TensorPlan:
    name: str
    target: TensorBytes
    base: TensorBytes | None
    digest: str
    encoding: Encoding
    frames: list[tuple[int, int]]
    results: list[list[bytes]] = field(default_factory=list)   # per frame, per plane
    changed: int = 0


def _encode_frame(plan: _TensorPlan, index: int, xor: bool) -> tuple[list[bytes], int]:
    start, end = plan.frames[index]
    k = plan.target.itemsize
    new = plan.target.data[start * k:end * k]
    changed = 0
    if xor:
        assert plan.base is not None
        chunk = np.bitwise_xor(new, plan.base.data[start * k:end * k])
        changed = int(np.count_nonzero(chunk.view(_UINT_BY_SIZE[k])))
    else:
        chunk = new
    compressor = _compressor()
    return [compressor.compress(plane) for plane in _split_planes(chunk, k)], changed


def _check_encodable(weights: WeightSet, what: str) -> None:
    """What encode is given must make a header that read_header accepts."""
    version = weights.version
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"{what}: version {version!r} is not an integer in [0, {MAX_VERSION}]")
    for name, tensor in weights.tensors.items():
        if not isinstance(name, str) or not name or not _is_utf8(name):
            raise ValueError(f"{what}: tensor name {name!r} must be a non-empty UTF-8 string")
        if len(tensor.shape) > MAX_DIMS:
            raise ValueError(f"{what}: tensor {name!r} has {len(tensor.shape)} dimensions, more than {MAX_DIMS}")
        if name not in weights.digests:
            raise ValueError(f"{what}: tensor {name!r} has no digest (build the WeightSet with WeightSet.build)")


def encode(target: WeightSet, base: WeightSet | None = None, *, raw: bool = False, pool: Executor | None = None,
           frame_bytes: int = DEFAULT_FRAME_BYTES) -> Encoded:
    """The payload that turns `base` into `target` (a keyframe when `base` is None).

    `raw=True` makes a keyframe of uncompressed bytes (for snapshots and the full-weights
    baseline). Tensors missing from the base or of another dtype/shape go as keyframes. The same
    weights and base always give the same bytes."""
    if isinstance(frame_bytes, bool) or not isinstance(frame_bytes, int) or not 1 <= frame_bytes <= MAX_FRAME_BYTES:
        raise ValueError(f"frame_bytes {frame_bytes!r} is not an integer in [1, {MAX_FRAME_BYTES}]")
    _check_encodable(target, "target")
    if base is not None:
        _check_encodable(base, "base")
    executor = _pool(pool)
    kind: Kind = "keyframe" if base is None else "delta"
    plans: list[_TensorPlan] = []
    for name, tensor in target.tensors.items():
        digest = target.digests[name]
        held = base.tensors.get(name) if base is not None else None
        comparable = held is not None and held.dtype == tensor.dtype and held.shape == tensor.shape
        if raw:
            encoding: Encoding = "raw"
        elif comparable and base is not None and base.digests.get(name) == digest:
            encoding = "same"
        elif comparable:
            encoding = "xor"
        else:
            encoding = "full"
        frames = _chunks(tensor.numel, _frame_elements(tensor.itemsize, frame_bytes))
        plans.append(_TensorPlan(name, tensor, held if comparable else None, digest, encoding, frames))

    def run(selected: list[_TensorPlan], xor: bool) -> None:
        jobs = [(plan, i) for plan in selected for i in range(len(plan.frames))]
        outputs = list(executor.map(lambda job: _encode_frame(job[0], job[1], xor), jobs))
        for plan in selected:
            plan.results, plan.changed = [], 0
        for (plan, _), (planes, changed) in zip(jobs, outputs, strict=True):
            plan.results.append(planes)
            plan.changed += changed

    run([p for p in plans if p.encoding == "xor"], xor=True)
    # A delta that barely compresses may be beaten by the keyframe: try it and keep the smaller.
    retry = [p for p in plans if p.encoding == "xor"
             and _size(p.results) > _TRY_KEYFRAME_ABOVE * p.target.data.nbytes]
    xor_results = {p.name: (p.results, p.changed) for p in retry}
    run(retry + [p for p in plans if p.encoding == "full"], xor=False)
    for plan in retry:
        xor_frames, changed = xor_results[plan.name]
        if _size(xor_frames) <= _size(plan.results):
            plan.results, plan.changed = xor_frames, changed
        else:
            plan.encoding, plan.changed = "full", changed
    for plan in plans:
        if plan.encoding == "full" and plan.name not in xor_results:
            plan.changed = plan.target.numel

    payload = _container(plans, target, base, kind, frame_bytes)
    counts = {e: sum(1 for p in plans if p.encoding == e) for e in ENCODINGS}
    return Encoded(payload, EncodeStats(
        kind=kind, raw_bytes=target.raw_bytes, payload_bytes=len(payload), tensors=counts,
        changed_elements=sum(p.changed for p in plans), total_elements=sum(p.target.numel for p in plans),
    ))


def _container(plans: list[_TensorPlan], target: WeightSet, base: WeightSet | None, kind: Kind,
               frame_bytes: int) -> bytes:
    """The safetensors payload of encoded plans: their frames, and the header that names them."""
    arrays: dict[str, np.ndarray] = {}
    entries: list[dict[str, Any]] = []
    for plan in plans:
        entry: dict[str, Any] = {"name": plan.name, "dtype": plan.target.dtype, "shape": list(plan.target.shape),
                                 "encoding": plan.encoding, "xxh3_128": plan.digest}
        if plan.encoding == "raw":
            arrays[f"{plan.name}/raw"] = plan.target.data
        elif plan.encoding in ("xor", "full"):
            entry["frames"] = len(plan.frames)
            for f, planes in enumerate(plan.results):
                for p, blob in enumerate(planes):
                    arrays[f"{plan.name}/plane{p}/frame{f}"] = np.frombuffer(blob, dtype=np.uint8)
        entries.append(entry)
    fields: dict[str, Any] = {
        "codec": CODEC,
        "kind": kind,
        "version": target.version,
        "base_version": base.version if base is not None else 0,
        "base_manifest_hash": base.manifest_hash if base is not None else "",
        "manifest_hash": target.manifest_hash,
        "frame_bytes": frame_bytes,
        "tensors": entries,
    }
    fields["header_hash"] = header_digest(fields)
    payload = safetensors.numpy.save(arrays, metadata={METADATA_KEY: _canonical(fields).decode()})
    return payload


def _size(frames: list[list[bytes]]) -> int:
    return sum(len(blob) for planes in frames for blob in planes)


# ---------------------------------------------------------------- reading and checking a payload
#
# Everything below refuses with a CodecError; sizes are Python ints (no overflow), and every
# declared size is checked against what the container holds before anything is allocated.

_HEADER_FIELDS = frozenset({"codec", "kind", "version", "base_version", "base_manifest_hash", "manifest_hash",
                            "frame_bytes", "tensors", "header_hash"})
_ENTRY_FIELDS: dict[str, frozenset[str]] = {
    "same": frozenset({"name", "dtype", "shape", "encoding", "xxh3_128"}),
    "raw": frozenset({"name", "dtype", "shape", "encoding", "xxh3_128"}),
    "xor": frozenset({"name", "dtype", "shape", "encoding", "xxh3_128", "frames"}),
    "full": frozenset({"name", "dtype", "shape", "encoding", "xxh3_128", "frames"}),
}
_HEX = frozenset("0123456789abcdef")


def _show(value: object) -> str:
    """A value for an error message, cut short (a hostile header can hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(value: object, what: str, low: int, high: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    raise CorruptPayload(f"{what}: {_show(value)} is not an integer in [{low}, {high}]")


def _digest(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) != 32 or not set(value) <= _HEX:
        raise CorruptPayload(f"{what}: {_show(value)} is not an xxh3-128 (32 lower-case hex digits)")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would keep the last silently; safetensors refuses
            raise ValueError(f"key {_show(key)} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json(data: bytes | str, what: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptPayload(f"payload: {what} is not valid JSON ({_show(str(exc))})") from None


@dataclass(frozen=True)
class _Container:
    """A safetensors file checked as safetensors checks it: its metadata, and each entry's bytes
    (views of the payload: nothing is copied)."""

    metadata: dict[str, str]
    entries: dict[str, memoryview]


def _entry_span(key: str, value: object) -> tuple[int, int]:
    """The byte range of one container entry: 1-D uint8, its size matching its offsets."""
    if not isinstance(value, dict) or value.keys() != {"dtype", "shape", "data_offsets"}:
        raise CorruptPayload(f"payload: entry {_show(key)} is not a safetensors tensor entry")
    shape, offsets = value["shape"], value["data_offsets"]
    if value["dtype"] != "U8":
        raise CorruptPayload(f"payload: entry {_show(key)} has dtype {_show(value['dtype'])}, frames are U8")
    if not isinstance(shape, list) or len(shape) != 1 or not _is_int(shape[0]) or shape[0] < 0:
        raise CorruptPayload(f"payload: entry {_show(key)} has shape {_show(shape)}, frames are 1-D")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != shape[0]:
        raise CorruptPayload(f"payload: entry {_show(key)} has data_offsets {_show(offsets)} for shape {shape}")
    return offsets[0], offsets[1]


def _read_container(payload: bytes | bytearray | memoryview) -> _Container:
    view = memoryview(payload).cast("B")
    if len(view) < 8:
        raise CorruptPayload(f"payload: {len(view)} bytes cannot hold a safetensors header")
    (length,) = struct.unpack_from("<Q", view)
    if length > len(view) - 8:
        raise CorruptPayload(f"payload: header claims {length} bytes but only {len(view) - 8} follow (truncated)")
    if length > MAX_HEADER_BYTES:
        raise CorruptPayload(f"payload: header of {length} bytes, safetensors allows {MAX_HEADER_BYTES}")
    raw_header = bytes(view[8:8 + length])
    if not raw_header.startswith(b"{"):
        raise CorruptPayload("payload: the safetensors header is not a JSON object")
    header = _json(raw_header, "the safetensors header")
    if not isinstance(header, dict):
        raise CorruptPayload("payload: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptPayload("payload: __metadata__ does not map names to strings")
    body = view[8 + length:]
    spans = sorted((_entry_span(key, value), key) for key, value in header.items())
    # The entries must tile the data exactly: no gap, no overlap, nothing after (as safetensors).
    position = 0
    for (begin, end), key in spans:
        if begin != position:
            raise CorruptPayload(f"payload: entry {_show(key)} starts at byte {begin} of the data, expected "
                                 f"{position} (a gap or an overlap)")
        position = end
    if position != len(body):
        raise CorruptPayload(f"payload: the entries end at byte {position} of the data, which has {len(body)} "
                             "(truncated or padded)")
    return _Container(metadata, {key: body[begin:end] for (begin, end), key in spans})


@dataclass(frozen=True)
class _Entry:
    """One tensor of a header, checked."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    digest: str
    frames: int               # zstd frames per plane (xor/full), else 0
    itemsize: int
    numel: int
    frame_elements: int
    fields: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _entry_name(index: int, raw: dict[str, Any]) -> str:
    name = raw.get("name")
    if not isinstance(name, str) or not name or not _is_utf8(name):
        raise CorruptPayload(f"tensors[{index}]: name {_show(name)} is not a non-empty UTF-8 string")
    return name


def _entry_dtype(what: str, dtype: object) -> int:
    if not isinstance(dtype, str):
        raise CorruptPayload(f"{what}: dtype {_show(dtype)} is not a string")
    try:
        return _dtype_itemsize(dtype)
    except ValueError as exc:
        raise CorruptPayload(f"{what}: {exc}") from None


def _entry_shape(what: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise CorruptPayload(f"{what}: shape {_show(shape)} is not a list of at most {MAX_DIMS} dimensions")
    for axis, size in enumerate(shape):
        _integer(size, f"{what}: shape[{axis}]", 0, MAX_VERSION)
    return tuple(shape)


def _check_entry(index: int, raw: object, kind: str, frame_bytes: int) -> _Entry:
    if not isinstance(raw, dict):
        raise CorruptPayload(f"tensors[{index}]: {_show(raw)} is not an object")
    name = _entry_name(index, raw)
    what = f"tensor {name!r}"
    encoding = raw.get("encoding")
    if encoding not in ENCODINGS:
        raise CorruptPayload(f"{what}: encoding {_show(encoding)} is not one of {list(ENCODINGS)}")
    if kind == "keyframe" and encoding not in ("full", "raw"):
        raise CorruptPayload(f"{what}: encoding {encoding!r} needs a base, and a keyframe has none")
    expected = _ENTRY_FIELDS[encoding]
    if raw.keys() != expected:
        odd = sorted(set(raw) ^ expected)
        raise CorruptPayload(f"{what}: fields {_show(odd)} missing or unknown for encoding {encoding!r}")
    itemsize = _entry_dtype(what, raw["dtype"])
    shape = _entry_shape(what, raw["shape"])
    numel = math.prod(shape)
    frame_elements = _frame_elements(itemsize, frame_bytes)
    frames = 0
    if encoding in ("xor", "full"):
        frames = _frame_count(numel, frame_elements)
        if not _is_int(raw["frames"]) or raw["frames"] != frames:
            raise CorruptPayload(f"{what}: frames is {_show(raw['frames'])}, {frames} frames of {frame_elements} "
                                 f"elements hold shape {list(shape)}")
    digest = _digest(raw["xxh3_128"], f"{what}: xxh3_128")
    return _Entry(name, raw["dtype"], shape, encoding, digest, frames, itemsize, numel, frame_elements, raw)


def _check_entries(tensors: object, kind: str, frame_bytes: int, max_bytes: int) -> list[_Entry]:
    if not isinstance(tensors, list):
        raise CorruptPayload(f"header: tensors {_show(tensors)} is not a list")
    entries: list[_Entry] = []
    names: set[str] = set()
    total = 0
    for index, raw in enumerate(tensors):
        entry = _check_entry(index, raw, kind, frame_bytes)
        if entry.name in names:
            raise CorruptPayload(f"tensor {entry.name!r}: listed twice")
        names.add(entry.name)
        total += entry.nbytes
        if total > max_bytes:
            raise TooLarge(f"tensor {entry.name!r}: the tensors up to this one take {total} bytes, more than "
                           f"max_bytes={max_bytes}")
        entries.append(entry)
    return entries


def _check_fields(fields: object, max_bytes: int) -> tuple[PayloadHeader, list[_Entry]]:
    """Every field of the codec header, then its own hash, then the manifest hash against the
    version and the tensors it lists (a relabelled version fails here)."""
    if not isinstance(fields, dict):
        raise CorruptPayload(f"header: {_show(fields)} is not an object")
    if fields.get("codec") != CODEC:
        raise CorruptPayload(f"payload: codec {_show(fields.get('codec'))} is not {CODEC!r}")
    if fields.keys() != _HEADER_FIELDS:
        raise CorruptPayload(f"header: fields {_show(sorted(set(fields) ^ _HEADER_FIELDS))} missing or unknown")
    kind = fields["kind"]
    if kind not in ("delta", "keyframe"):
        raise CorruptPayload(f"header: kind {_show(kind)} is neither delta nor keyframe")
    version = _integer(fields["version"], "header: version", 0, MAX_VERSION)
    base_version = _integer(fields["base_version"], "header: base_version", 0, MAX_VERSION)
    frame_bytes = _integer(fields["frame_bytes"], "header: frame_bytes", 1, MAX_FRAME_BYTES)
    manifest_hash = _digest(fields["manifest_hash"], "header: manifest_hash")
    header_hash = _digest(fields["header_hash"], "header: header_hash")
    base_manifest_hash = fields["base_manifest_hash"]
    if kind == "delta":
        _digest(base_manifest_hash, "header: base_manifest_hash")
    elif base_version != 0 or base_manifest_hash != "":
        raise CorruptPayload(f"header: a keyframe has base_version 0 and no base_manifest_hash, not "
                             f"{base_version} and {_show(base_manifest_hash)}")
    entries = _check_entries(fields["tensors"], kind, frame_bytes, max_bytes)
    actual = header_digest(fields)
    if actual != header_hash:
        raise CorruptPayload(f"header: its content hashes to {actual}, header_hash says {header_hash} (an edited "
                             "or damaged header)")
    declared = manifest_digest(((e.name, e.dtype, e.shape, e.digest) for e in entries), version=version)
    if declared != manifest_hash:
        raise HashMismatch(f"manifest: version {version} with these tensors hashes to {declared}, the header says "
                           f"{manifest_hash} (a relabelled version or an edited header)")
    header = PayloadHeader(
        kind=kind, version=version, base_version=base_version, base_manifest_hash=base_manifest_hash,
        manifest_hash=manifest_hash, frame_elements={e.name: e.frame_elements for e in entries},
        tensors=[e.fields for e in entries], frame_bytes=frame_bytes, header_hash=header_hash,
    )
    return header, entries


@dataclass(frozen=True)
class _Span:
    """One frame of a tensor: its elements and its blobs (one per plane, or the raw bytes)."""

    start: int
    end: int
    blobs: list[memoryview]


def _expected_frames(entry: _Entry) -> Iterator[tuple[int, int, list[str]]]:
    """Each frame's element range and container keys, lazily: a hostile frame count stops at the
    first key the container does not have."""
    if entry.encoding == "raw":
        yield 0, entry.numel, [f"{entry.name}/raw"]
    elif entry.encoding in ("xor", "full"):
        for f in range(entry.frames):
            start, end = _frame_span(entry.numel, entry.frame_elements, f)
            yield start, end, [f"{entry.name}/plane{p}/frame{f}" for p in range(entry.itemsize)]


def _check_blob(entry: _Entry, key: str, blob: memoryview, start: int, end: int) -> None:
    """A frame's size as declared, read from its zstd header without decompressing."""
    if entry.encoding == "raw":
        if len(blob) != entry.nbytes:
            raise CorruptPayload(f"tensor {entry.name!r}: {key!r} holds {len(blob)} bytes, {entry.dtype}"
                                 f"{list(entry.shape)} takes {entry.nbytes}")
        return
    try:
        size = zstandard.frame_content_size(blob)
    except zstandard.ZstdError:
        raise CorruptPayload(f"tensor {entry.name!r}: frame {key!r} does not start with a zstd frame header") from None
    if size != end - start:
        raise CorruptPayload(f"tensor {entry.name!r}: frame {key!r} declares {size} bytes, elements {start}..{end} "
                             f"need {end - start}")


def _locate(entries: list[_Entry], container: _Container) -> dict[str, list[_Span]]:
    """Every tensor's frames, found in the container and checked for size; the container must
    hold exactly those entries (names are unique, so no two tensors share a key)."""
    spans: dict[str, list[_Span]] = {}
    used: set[str] = set()
    for entry in entries:
        found: list[_Span] = []
        for start, end, keys in _expected_frames(entry):
            blobs = []
            for key in keys:
                blob = container.entries.get(key)
                if blob is None:
                    raise CorruptPayload(f"tensor {entry.name!r}: frame {key!r} is missing")
                _check_blob(entry, key, blob, start, end)
                used.add(key)
                blobs.append(blob)
            found.append(_Span(start, end, blobs))
        spans[entry.name] = found
    if len(used) != len(container.entries):
        extra = next(key for key in container.entries if key not in used)
        raise CorruptPayload(f"payload: entry {_show(extra)} belongs to no tensor of the header")
    return spans


def _read(payload: bytes | bytearray | memoryview, max_bytes: int
          ) -> tuple[PayloadHeader, list[_Entry], dict[str, list[_Span]]]:
    container = _read_container(payload)
    if "codec" in container.metadata:  # a payload of another layout names its codec at the top
        raise CorruptPayload(f"payload: codec {_show(container.metadata['codec'])} is not {CODEC!r}")
    if container.metadata.keys() != {METADATA_KEY}:
        raise CorruptPayload(f"payload: __metadata__ holds {_show(sorted(container.metadata))}, a {CODEC} payload "
                             f"holds only {METADATA_KEY!r}")
    header, entries = _check_fields(_json(container.metadata[METADATA_KEY], "the codec header"), max_bytes)
    return header, entries, _locate(entries, container)


def read_header(payload: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> PayloadHeader:
    """The payload's header, checked against itself (every field, its own hash, the manifest
    hash) and the container (every frame present, of the size its elements need); nothing is
    decompressed. `max_bytes` bounds the bytes the version's tensors may take (TooLarge)."""
    return _read(payload, max_bytes)[0]


@dataclass
class _ApplyJob:
    name: str
    encoding: Encoding
    itemsize: int
    start: int
    end: int
    blobs: list[memoryview]
    target: np.ndarray        # the held array (xor, in place) or a new array (full/raw)


def _decode_frame(job: _ApplyJob) -> None:
    k = job.itemsize
    expected = job.end - job.start
    if job.encoding == "raw":
        job.target[:] = np.frombuffer(job.blobs[0], dtype=np.uint8)
        return
    planes = []
    decompressor = _decompressor()
    for p, blob in enumerate(job.blobs):
        try:
            plane = decompressor.decompress(blob, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise CorruptPayload(f"tensor {job.name!r}: plane {p} of elements {job.start}..{job.end} "
                                 f"does not decompress ({exc})") from exc
        if len(plane) != expected:
            raise CorruptPayload(f"tensor {job.name!r}: plane {p} of elements {job.start}..{job.end} "
                                 f"holds {len(plane)} bytes, expected {expected}")
        planes.append(np.frombuffer(plane, dtype=np.uint8))
    values = _join_planes(planes, k)
    segment = job.target[job.start * k:job.end * k]
    if job.encoding == "xor":
        np.bitwise_xor(segment, values, out=segment)
    else:
        segment[:] = values


def _check_base(held: WeightSet | None, header: PayloadHeader) -> None:
    if held is None:
        raise WrongBase(f"delta from version {header.base_version} needs those weights; none are held")
    if held.version != header.base_version:
        raise WrongBase(f"delta base is version {header.base_version}, the held weights are version {held.version}")
    if held.manifest_hash != header.base_manifest_hash:
        raise WrongBase(f"delta base manifest {header.base_manifest_hash} differs from the held weights' "
                        f"{held.manifest_hash} (same version number, other weights)")


def _held_tensor(held: WeightSet | None, entry: _Entry) -> TensorBytes:
    """The held tensor a `same` or `xor` entry refers to: of the entry's dtype and shape, and for
    `same`, of the entry's hash."""
    if held is None or entry.name not in held.tensors:
        raise ManifestMismatch(f"tensor {entry.name!r}: the payload has it as {entry.encoding} but it is not held")
    current = held.tensors[entry.name]
    if current.dtype != entry.dtype or current.shape != entry.shape:
        raise ManifestMismatch(f"tensor {entry.name!r}: payload says {entry.dtype}{list(entry.shape)}, held is "
                               f"{current.dtype}{list(current.shape)}")
    if entry.encoding == "same" and held.digests.get(entry.name) != entry.digest:
        raise HashMismatch(f"tensor {entry.name!r}: marked unchanged but the held hash "
                           f"{held.digests.get(entry.name)} is not {entry.digest}")
    return current


def _plan_apply(held: WeightSet | None, entries: list[_Entry], spans: dict[str, list[_Span]]
                ) -> tuple[dict[str, TensorBytes], list[str], list[_ApplyJob]]:
    """The tensors of the new version, the names of those to decode, and the frames to decode.
    Every entry is checked against the held weights before anything is allocated."""
    held_tensors = {e.name: _held_tensor(held, e) for e in entries if e.encoding in ("same", "xor")}
    result: dict[str, TensorBytes] = {}
    changed: list[str] = []
    jobs: list[_ApplyJob] = []
    for entry in entries:
        current = held_tensors.get(entry.name)
        if current is None:
            current = TensorBytes(entry.dtype, entry.shape, np.empty(entry.nbytes, dtype=np.uint8))
        result[entry.name] = current
        if entry.encoding == "same":
            continue
        changed.append(entry.name)
        jobs.extend(_ApplyJob(entry.name, entry.encoding, entry.itemsize, span.start, span.end, span.blobs,
                              current.data) for span in spans[entry.name])
    return result, changed, jobs


def _run_jobs(executor: Executor, jobs: list[_ApplyJob]) -> tuple[list[_ApplyJob], BaseException | None]:
    """Decodes every frame; returns the in-place (xor) jobs that were applied, and the first error."""
    futures = [executor.submit(_decode_frame, job) for job in jobs]
    wait(futures)  # none may still be writing when an undo starts
    errors = [f.exception() for f in futures]
    applied = [job for job, error in zip(jobs, errors, strict=True) if error is None and job.encoding == "xor"]
    return applied, next((error for error in errors if error is not None), None)


def apply(held: WeightSet | None, payload: bytes | bytearray | memoryview, *, pool: Executor | None = None,
          max_bytes: int = DEFAULT_MAX_BYTES) -> WeightSet:
    """Applies a payload: a keyframe gives new weights; a delta changes `held` in place.

    All or nothing: the payload is checked (read_header) and checked against `held` before
    anything is touched, and if a frame fails to decompress or a tensor's hash differs after
    applying, every XOR already applied is applied again (XOR undoes itself) so `held` is left
    exactly as it was. Anything wrong with the payload raises a CodecError; `max_bytes` bounds
    the bytes the new version's tensors may declare (TooLarge)."""
    executor = _pool(pool)
    header, entries, spans = _read(payload, max_bytes)
    if header.kind == "delta":
        _check_base(held, header)
    result, changed, jobs = _plan_apply(held, entries, spans)
    digests = {entry.name: entry.digest for entry in entries}
    applied, error = _run_jobs(executor, jobs)
    if error is None:
        actual = list(executor.map(lambda n: tensor_digest(result[n].data), changed))
        for name, digest in zip(changed, actual, strict=True):
            if digest != digests[name]:
                error = HashMismatch(f"tensor {name!r}: decoded bytes hash to {digest}, the learner's are "
                                     f"{digests[name]}")
                break
    if error is not None:
        list(executor.map(_decode_frame, applied))  # undo: XOR the same frames again
        raise error
    # Each tensor matched its hash and the header's manifest matched its entries and version, so
    # the new weights are exactly the version the header names.
    if held is not None and header.kind == "delta":
        held.version, held.tensors, held.digests = header.version, result, digests
        return held
    return WeightSet(header.version, result, digests)
