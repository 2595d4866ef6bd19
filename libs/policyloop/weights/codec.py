"""Exact weight deltas: per tensor, the XOR of the raw bytes against the base version, split into
byte planes, each plane compressed by zstd (level 1) in independent frames.

RL steps at small learning rates leave most served (bf16) weights bit-identical, so the XOR is
mostly zero bytes, and splitting it into byte planes puts the rare changed mantissa bytes in one
plane and the nearly-always-zero sign/exponent bytes in another — both compress far better than
the interleaved bytes would. Exact by construction: applying XOR(new, base) to base gives new,
bit for bit, for any dtype; XOR is its own inverse, which is how a failed apply is undone.

A payload is a safetensors container whose tensors are the zstd frames (uint8), named
`<tensor>/plane<p>/frame<f>` (or `<tensor>/raw` for the uncompressed encoding). Its
`__metadata__` says everything needed to check it before touching any weights: the codec tag,
the kind (delta or keyframe), base and new version, the base version's manifest hash (so a
delta is applied only to exactly the weights it was made from, never twice), and per tensor its
name, dtype, shape, encoding and the xxh3-128 of its new bytes, plus the manifest hash of the
whole new version.

Per-tensor encodings:
- `same`  unchanged since the base: header and hash only.
- `xor`   XOR against the base, byte planes, zstd.
- `full`  the new bytes, byte planes, zstd (a keyframe, or a tensor whose XOR would not be smaller).
- `raw`   the new bytes as they are (snapshots and the full-weights baseline: no compression cost).

Work is spread over a thread pool by frame: zstd, numpy and xxhash release the GIL.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import safetensors.numpy
import xxhash
import zstandard

CODEC = "policyloop.xor-planes-zstd/1"
DEFAULT_FRAME_BYTES = 4 * 1024 * 1024
ZSTD_LEVEL = 1
# A tensor whose XOR compresses below this fraction of its raw size is taken as a delta without
# also trying a keyframe: weights never compress that far as keyframes (bf16 ≈ 0.7).
_TRY_KEYFRAME_ABOVE = 1 / 8

Encoding = Literal["same", "xor", "full", "raw"]
Kind = Literal["delta", "keyframe"]

# safetensors dtype names → bytes per element.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


class CodecError(Exception):
    """A payload cannot be applied. The message names what is wrong (and which tensor)."""


class WrongBase(CodecError):
    """The delta was made from other weights than the ones held (version or manifest differ)."""


class CorruptPayload(CodecError):
    """The payload is truncated, damaged or inconsistent with its own header."""


class HashMismatch(CodecError):
    """A tensor decoded to bytes whose xxh3-128 is not the one the learner recorded."""


class ManifestMismatch(CodecError):
    """The payload names a tensor the holder does not have, or changes a dtype or shape."""


def tensor_digest(data: np.ndarray | bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def manifest_digest(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """One hash for a whole version: names, dtypes, shapes and tensor hashes, sorted by name."""
    canonical = json.dumps(sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in entries),
                           separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canonical.encode())


@dataclass
class TensorBytes:
    """One tensor as raw little-endian bytes (a 1-D, C-contiguous uint8 array)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        self.shape = tuple(int(d) for d in self.shape)
        if self.data.dtype != np.uint8 or self.data.ndim != 1 or not self.data.flags.c_contiguous:
            raise ValueError("data must be a 1-D C-contiguous uint8 array")
        if self.data.nbytes != self.numel * self.itemsize:
            raise ValueError(f"{self.data.nbytes} bytes do not hold a {self.dtype} tensor of shape {self.shape}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


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
        return manifest_digest((n, t.dtype, t.shape, self.digests[n]) for n, t in self.tensors.items())

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
    """What a payload's `__metadata__` says, read without decompressing anything."""

    kind: Kind
    version: int
    base_version: int
    base_manifest_hash: str
    manifest_hash: str
    frame_elements: dict[str, int]
    tensors: list[dict[str, Any]]


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


def _chunks(numel: int, frame_elements: int) -> list[tuple[int, int]]:
    """Element ranges of a tensor's frames (at least one, even for an empty tensor)."""
    return [(s, min(numel, s + frame_elements)) for s in range(0, numel, frame_elements)] or [(0, 0)]


def _frame_elements(itemsize: int, frame_bytes: int) -> int:
    return max(1, frame_bytes // itemsize)


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
    if k not in _UINT_BY_SIZE:
        raise ValueError(f"tensor {plan.name!r}: {k}-byte elements are not supported")
    changed = 0
    if xor:
        assert plan.base is not None
        chunk = np.bitwise_xor(new, plan.base.data[start * k:end * k])
        changed = int(np.count_nonzero(chunk.view(_UINT_BY_SIZE[k])))
    else:
        chunk = new
    compressor = _compressor()
    return [compressor.compress(plane) for plane in _split_planes(chunk, k)], changed


def encode(target: WeightSet, base: WeightSet | None = None, *, raw: bool = False, pool: Executor | None = None,
           frame_bytes: int = DEFAULT_FRAME_BYTES) -> Encoded:
    """The payload that turns `base` into `target` (a keyframe when `base` is None).

    `raw=True` makes a keyframe of uncompressed bytes (for snapshots and the full-weights
    baseline). Tensors missing from the base or of another dtype/shape go as keyframes."""
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
    metadata = {
        "codec": CODEC,
        "kind": kind,
        "version": str(target.version),
        "base_version": str(base.version if base is not None else 0),
        "base_manifest_hash": base.manifest_hash if base is not None else "",
        "manifest_hash": target.manifest_hash,
        "frame_bytes": str(frame_bytes),
        "tensors": json.dumps(entries, separators=(",", ":")),
    }
    payload = safetensors.numpy.save(arrays, metadata=metadata)
    counts = {e: sum(1 for p in plans if p.encoding == e) for e in ("same", "xor", "full", "raw")}
    return Encoded(payload, EncodeStats(
        kind=kind, raw_bytes=target.raw_bytes, payload_bytes=len(payload), tensors=counts,
        changed_elements=sum(p.changed for p in plans), total_elements=sum(p.target.numel for p in plans),
    ))


def _size(frames: list[list[bytes]]) -> int:
    return sum(len(blob) for planes in frames for blob in planes)


# ---------------------------------------------------------------- decoding


def read_header(payload: bytes | memoryview) -> PayloadHeader:
    """The payload's header, checked for shape; nothing is decompressed."""
    if len(payload) < 8:
        raise CorruptPayload(f"payload: {len(payload)} bytes cannot hold a safetensors header")
    (length,) = struct.unpack("<Q", bytes(payload[:8]))
    if length > len(payload) - 8:
        raise CorruptPayload(f"payload: header claims {length} bytes but only {len(payload) - 8} follow (truncated)")
    try:
        header = json.loads(bytes(payload[8:8 + length]))
        meta = header["__metadata__"]
        if meta.get("codec") != CODEC:
            raise CorruptPayload(f"payload: codec {meta.get('codec')!r} is not {CODEC!r}")
        kind = meta["kind"]
        if kind not in ("delta", "keyframe"):
            raise CorruptPayload(f"payload: kind {kind!r} is neither delta nor keyframe")
        frame_bytes = int(meta["frame_bytes"])
        tensors = json.loads(meta["tensors"])
        return PayloadHeader(
            kind=kind, version=int(meta["version"]), base_version=int(meta["base_version"]),
            base_manifest_hash=meta["base_manifest_hash"], manifest_hash=meta["manifest_hash"],
            frame_elements={t["name"]: _frame_elements(ITEMSIZE[t["dtype"]], frame_bytes) for t in tensors},
            tensors=tensors,
        )
    except CorruptPayload:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptPayload(f"payload: the header is not a {CODEC} header ({exc!r})") from exc


@dataclass
class _ApplyJob:
    name: str
    encoding: Encoding
    itemsize: int
    start: int
    end: int
    blobs: list[np.ndarray]
    target: np.ndarray        # the held array (xor, in place) or a new array (full/raw)


def _decode_frame(job: _ApplyJob) -> None:
    k = job.itemsize
    expected = job.end - job.start
    if job.encoding == "raw":
        if job.blobs[0].size != expected * k:
            raise CorruptPayload(f"tensor {job.name!r}: raw bytes are {job.blobs[0].size}, expected {expected * k}")
        job.target[:] = job.blobs[0]
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


def apply(held: WeightSet | None, payload: bytes, *, pool: Executor | None = None) -> WeightSet:
    """Applies a payload: a keyframe gives new weights; a delta changes `held` in place.

    All or nothing: the payload is checked against `held` before anything is touched, and if a
    frame fails to decompress or a tensor's hash differs after applying, every XOR already
    applied is applied again (XOR undoes itself) so `held` is left exactly as it was."""
    executor = _pool(pool)
    header = read_header(payload)
    if header.kind == "delta":
        if held is None:
            raise WrongBase(f"delta from version {header.base_version} needs those weights; none are held")
        if held.version != header.base_version:
            raise WrongBase(f"delta base is version {header.base_version}, the held weights are version {held.version}")
        if held.manifest_hash != header.base_manifest_hash:
            raise WrongBase(f"delta base manifest {header.base_manifest_hash} differs from the held weights' "
                            f"{held.manifest_hash} (same version number, other weights)")
    try:
        frames = safetensors.numpy.load(payload)
    except Exception as exc:  # safetensors raises its own error types for malformed bodies
        raise CorruptPayload(f"payload: not a readable safetensors container ({exc})") from exc

    jobs: list[_ApplyJob] = []
    result: dict[str, TensorBytes] = {}
    digests: dict[str, str] = {}
    changed: list[str] = []
    for entry in header.tensors:
        name, dtype, shape, encoding = entry["name"], entry["dtype"], tuple(entry["shape"]), entry["encoding"]
        digests[name] = entry["xxh3_128"]
        if encoding in ("same", "xor"):
            if held is None or name not in held.tensors:
                raise ManifestMismatch(f"tensor {name!r}: the payload has it as {encoding} but it is not held")
            current = held.tensors[name]
            if current.dtype != dtype or current.shape != shape:
                raise ManifestMismatch(f"tensor {name!r}: payload says {dtype}{list(shape)}, held is "
                                       f"{current.dtype}{list(current.shape)}")
            if encoding == "same":
                if held.digests[name] != entry["xxh3_128"]:
                    raise HashMismatch(f"tensor {name!r}: marked unchanged but the held hash "
                                       f"{held.digests[name]} is not {entry['xxh3_128']}")
                result[name] = current
                continue
            target = current.data
        elif encoding in ("full", "raw"):
            if dtype not in ITEMSIZE:
                raise CorruptPayload(f"tensor {name!r}: unknown dtype {dtype!r}")
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            target = np.empty(numel * ITEMSIZE[dtype], dtype=np.uint8)
        else:
            raise CorruptPayload(f"tensor {name!r}: unknown encoding {encoding!r}")
        tensor = TensorBytes(dtype, shape, target)
        result[name] = tensor
        changed.append(name)
        if encoding == "raw":
            jobs.append(_ApplyJob(name, encoding, tensor.itemsize, 0, tensor.numel,
                                  [_frame(frames, f"{name}/raw")], target))
            continue
        spans = _chunks(tensor.numel, header.frame_elements[name])
        if int(entry.get("frames", -1)) != len(spans):
            raise CorruptPayload(f"tensor {name!r}: {entry.get('frames')} frames listed, {len(spans)} expected")
        for f, (start, end) in enumerate(spans):
            blobs = [_frame(frames, f"{name}/plane{p}/frame{f}") for p in range(tensor.itemsize)]
            jobs.append(_ApplyJob(name, encoding, tensor.itemsize, start, end, blobs, target))

    applied: list[_ApplyJob] = []
    futures = [(job, executor.submit(_decode_frame, job)) for job in jobs]
    error: CodecError | None = None
    for job, future in futures:
        try:
            future.result()
            if job.encoding == "xor":
                applied.append(job)
        except CodecError as exc:
            error = error or exc
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
    new = WeightSet(header.version, result, digests)
    if new.manifest_hash != header.manifest_hash:
        # Every tensor matched its own hash, so only a tampered header can get here; undo as well.
        list(executor.map(_decode_frame, applied))
        raise HashMismatch(f"manifest: the decoded version hashes to {new.manifest_hash}, the header says "
                           f"{header.manifest_hash}")
    if held is not None and header.kind == "delta":
        held.version, held.tensors, held.digests = new.version, new.tensors, new.digests
        return held
    return new


def _frame(frames: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    try:
        return frames[key]
    except KeyError:
        raise CorruptPayload(f"payload: frame {key!r} is missing") from None
