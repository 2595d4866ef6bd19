"""The weight codec against damaged and hostile payloads, property-based.

Real deltas and keyframes (mixed dtypes, several frames per tensor, unchanged, reshaped, added
and dropped tensors) are damaged (bit flips, truncations, inserted, deleted and overwritten
bytes), their headers edited (any field set to any JSON value, plausible wrong values, relabelled
versions, random shapes and dtypes, tensors duplicated, dropped or reordered) and their frames
moved, dropped, duplicated or replaced. Whatever happens, `apply` either gives exactly the
expected weights at the expected version, or raises a CodecError and leaves the held weights as
they were (bytes, version, hashes). Anything it accepts is a valid safetensors file.

The default run is bounded and derandomized (it is part of `make test`); a long random run
(20,000 examples per property, about 3 minutes on 2 cores):

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest -p no:cacheprovider -q tests/unit/test_weight_codec_fuzz.py
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policyloop.weights import codec
from policyloop.weights.codec import TensorBytes, WeightSet
from tests.unit.test_weight_codec import SAFETENSORS_DTYPES, header_fields, replace_frames, reseal, same_bytes

_SLOW_MACHINE = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("policyloop-codec-fuzz", max_examples=400, deadline=None, derandomize=True,
                          database=None, suppress_health_check=_SLOW_MACHINE)
settings.register_profile("policyloop-codec-fuzz-long", max_examples=20_000, deadline=None, database=None,
                          print_blob=True, suppress_health_check=_SLOW_MACHINE)
FUZZ = settings.get_profile("policyloop-codec-fuzz-long" if os.environ.get("HYPOTHESIS_PROFILE") == "long"
                            else "policyloop-codec-fuzz")


# ---------------------------------------------------------------- real payloads


def _tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> TensorBytes:
    size = int(np.prod(shape, dtype=np.int64)) * codec.ITEMSIZE[dtype]
    return TensorBytes(dtype, shape, rng.integers(0, 256, size, dtype=np.uint8))


def _versions() -> tuple[WeightSet, WeightSet]:
    rng = np.random.default_rng(7)
    specs = {"embed": ("BF16", (40, 16)), "w": ("F32", (8, 8)), "u": ("U16", (5,)), "q": ("I64", (3, 2)),
             "s": ("F16", ()), "e": ("BOOL", (0, 3)), "c": ("C64", (4,)), "f8": ("F8_E4M3", (17,)),
             "kept": ("BF16", (6,)), "reshaped": ("F32", (4, 6)), "dropped": ("U8", (3,))}
    base = {name: _tensor(rng, dtype, shape) for name, (dtype, shape) in specs.items()}
    new = {name: TensorBytes(t.dtype, t.shape, t.data.copy()) for name, t in base.items() if name != "dropped"}
    for name, tensor in new.items():
        if name != "kept":
            hits = rng.random(tensor.data.size) < 0.1
            tensor.data[hits] ^= rng.integers(1, 256, int(hits.sum()), dtype=np.uint8)
    new["reshaped"] = TensorBytes("F32", (6, 4), new["reshaped"].data)
    new["added"] = _tensor(rng, "I32", (3, 3))
    return WeightSet.build(1, base), WeightSet.build(2, new)


class Case:
    """A real payload turning `base` into `new` (a plain class: a failing example prints its name)."""

    def __init__(self, name: str, base: WeightSet, new: WeightSet, payload: bytes, delta: bool) -> None:
        self.name, self.base, self.new, self.payload, self.delta = name, base, new, payload, delta

    def __repr__(self) -> str:
        return f"Case({self.name!r})"


def _cases() -> list[Case]:
    base, new = _versions()
    return [
        Case("delta", base, new, codec.encode(new, base, frame_bytes=64).payload, True),
        Case("keyframe", base, new, codec.encode(new, frame_bytes=64).payload, False),
        Case("raw keyframe", base, new, codec.encode(new, raw=True).payload, False),
        Case("raw delta", base, new, codec.encode(new, base, raw=True).payload, True),
    ]


CASES = _cases()


# ---------------------------------------------------------------- the property


def _snapshot(weights: WeightSet) -> tuple[int, dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str], str]:
    return (weights.version, {n: (t.dtype, t.shape, t.data.tobytes()) for n, t in weights.tensors.items()},
            dict(weights.digests), weights.manifest_hash)


def check(case: Case, payload: bytes, version: int, hold: bool = True) -> None:
    """Exactly `case.new` at `version`, or a CodecError with the held weights untouched."""
    try:
        codec.read_header(payload)
    except codec.CodecError:
        pass
    held = case.base.copy() if hold else None
    before = _snapshot(held) if held is not None else None
    try:
        result = codec.apply(held, payload)
    except codec.CodecError:
        if held is not None:
            assert _snapshot(held) == before, "a refused payload changed the held weights"
        return
    assert result.version == version
    assert same_bytes(result, case.new) and result.digests == case.new.digests
    assert result.manifest_hash == WeightSet(version, case.new.tensors, case.new.digests).manifest_hash
    if held is not None and codec.read_header(payload).kind == "delta":
        assert result is held
    elif held is not None:
        assert _snapshot(held) == before, "a keyframe changed the weights held beside it"
    safetensors.deserialize(payload)  # what the codec accepts, safetensors accepts


def test_the_intact_payloads_apply_exactly() -> None:
    for case in CASES:
        check(case, case.payload, case.new.version, hold=case.delta)
        assert codec.apply(case.base.copy() if case.delta else None, case.payload).version == 2


# ---------------------------------------------------------------- damaged bytes


def _position(data: st.DataObject, payload: bytes, end: int = 0) -> int:
    """Anywhere, or within the frames (most of a small payload's bytes are its JSON header)."""
    (length,) = struct.unpack("<Q", payload[:8])
    start = data.draw(st.sampled_from([0, min(8 + length, len(payload) - 1)]), label="region")
    return data.draw(st.integers(start, len(payload) - 1 + end), label="at")


def _flip(data: st.DataObject, payload: bytes) -> bytes:
    out = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        out[_position(data, payload)] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return bytes(out)


def _truncate(data: st.DataObject, payload: bytes) -> bytes:
    return payload[:_position(data, payload)]


def _insert(data: st.DataObject, payload: bytes) -> bytes:
    at = _position(data, payload, end=1)
    return payload[:at] + data.draw(st.binary(min_size=1, max_size=8), label="inserted") + payload[at:]


def _delete(data: st.DataObject, payload: bytes) -> bytes:
    at = _position(data, payload)
    return payload[:at] + payload[at + data.draw(st.integers(1, 16), label="deleted"):]


def _overwrite(data: st.DataObject, payload: bytes) -> bytes:
    at = _position(data, payload)
    patch = data.draw(st.binary(min_size=1, max_size=16), label="patch")
    return (payload[:at] + patch + payload[at + len(patch):])[:len(payload)]


DAMAGE: list[Callable[[st.DataObject, bytes], bytes]] = [_flip, _truncate, _insert, _delete, _overwrite]


@FUZZ
@given(case=st.sampled_from(CASES), damage=st.sampled_from(DAMAGE), data=st.data())
def test_damaged_bytes_apply_exactly_or_raise_a_codec_error(case: Case, damage, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    check(case, damage(data, case.payload), case.new.version, hold=case.delta or data.draw(st.booleans()))


# ---------------------------------------------------------------- edited headers

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)
HEX = st.text("0123456789abcdef", min_size=32, max_size=32)
DIMENSIONS = st.integers(-2, 2**64) | st.integers(0, 64)


def _values(entries: object, key: str) -> list[Any]:
    """`key` of each entry that has one (entries may have been edited into anything)."""
    return [t[key] for t in entries if isinstance(t, dict) and key in t] if isinstance(entries, list) else []


def _plausible(data: st.DataObject, key: str, value: Any, others: object) -> Any:
    """A wrong value of the right kind for a field (a buggy producer, not a random one)."""
    if key == "name":
        return data.draw(st.sampled_from(_values(others, "name") + ["", "ghost", "embed/plane0"]), label="name")
    if key == "dtype":
        return data.draw(st.sampled_from(SAFETENSORS_DTYPES + ["Q8", "bf16"]), label="dtype")
    if key == "shape":
        reordered = st.permutations(value) if isinstance(value, list) else st.nothing()
        return data.draw(st.lists(DIMENSIONS, max_size=4) | reordered, label="shape")
    if key == "encoding":
        return data.draw(st.sampled_from(["same", "xor", "full", "raw", "zip"]), label="encoding")
    if key in ("xxh3_128", "manifest_hash", "base_manifest_hash", "header_hash"):
        return data.draw(HEX | st.sampled_from(_values(others, "xxh3_128") + ["", "0" * 32]), label=key)
    if key == "kind":
        return data.draw(st.sampled_from(["delta", "keyframe"]), label="kind")
    if isinstance(value, int):
        return data.draw(st.integers(-2, 2**64) | st.integers(value - 3, value + 3), label=key)
    return data.draw(JSON_VALUES, label=key)


def _edit_entry(data: st.DataObject, meta: dict[str, Any]) -> None:
    tensors = meta["tensors"]
    index = data.draw(st.integers(0, len(tensors) - 1), label="tensor")
    entry = tensors[index]
    edits = ["field", "any", "drop field"] if entry else []  # an earlier edit may have emptied it
    how = data.draw(st.sampled_from(edits + ["extra field", "remove", "duplicate", "swap"]), label="entry edit")
    if how in ("field", "any", "drop field"):
        key = data.draw(st.sampled_from(sorted(entry)), label="field")
        if how == "drop field":
            del entry[key]
        else:
            entry[key] = _plausible(data, key, entry[key], tensors) if how == "field" else data.draw(JSON_VALUES)
    elif how == "extra field":
        entry[data.draw(st.text(max_size=6), label="key")] = data.draw(JSON_VALUES)
    elif how == "remove":
        del tensors[index]
    elif how == "duplicate":
        tensors.insert(data.draw(st.integers(0, len(tensors)), label="at"), dict(entry))
    else:
        other = data.draw(st.integers(0, len(tensors) - 1), label="other")
        tensors[index], tensors[other] = tensors[other], tensors[index]


def _edit_fields(data: st.DataObject, meta: dict[str, Any]) -> None:
    how = data.draw(st.sampled_from(["field", "any", "drop field", "extra field"]), label="header edit")
    key = data.draw(st.sampled_from(sorted(meta)), label="field")
    if how == "field":
        meta[key] = _plausible(data, key, meta[key], meta.get("tensors"))
    elif how == "any":
        meta[key] = data.draw(JSON_VALUES)
    elif how == "drop field":
        del meta[key]
    else:
        meta[data.draw(st.text(max_size=6), label="key")] = data.draw(JSON_VALUES)


def _save(payload: bytes, meta: dict[str, Any]) -> bytes:
    return safetensors.numpy.save(safetensors.numpy.load(payload), metadata={codec.METADATA_KEY: json.dumps(meta)})


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_edited_headers_apply_exactly_or_raise_a_codec_error(case: Case, data: st.DataObject) -> None:
    """A producer's mistakes, sealed or not: any field changed, tensors edited, dropped,
    duplicated or reordered. Only the header's own hash is recomputed, so the version and every
    tensor must still be the ones the manifest hash covers."""
    meta = header_fields(case.payload)
    edits = data.draw(st.lists(st.sampled_from([_edit_entry, _edit_fields]), min_size=1, max_size=3), label="edits")
    for edit in edits:
        tensors = meta.get("tensors")
        if edit is _edit_fields or isinstance(tensors, list) and tensors and all(isinstance(t, dict) for t in tensors):
            edit(data, meta)
    if data.draw(st.booleans(), label="sealed"):
        reseal(meta, ("header",))
    check(case, _save(case.payload, meta), case.new.version, hold=case.delta or data.draw(st.booleans()))


@FUZZ
@given(case=st.sampled_from(CASES), version=st.integers(-2, 2**64), base=st.integers(-2, 2**64) | st.just(None),
       seal=st.sampled_from([(), ("header",), ("manifest", "header")]))
def test_a_relabelled_version_is_refused_unless_relabelled_consistently(
        case: Case, version: int, base: int | None, seal: tuple[str, ...]) -> None:
    """Version 2's bytes labelled as another version (and maybe from another base): refused
    unless the editor recomputed every hash, in which case it is exactly those bytes at the new
    label (a consistent payload; the codec guards against damage, not against a forger)."""
    meta = header_fields(case.payload)
    meta["version"] = version
    if base is not None:
        meta["base_version"] = base
    reseal(meta, seal)
    check(case, _save(case.payload, meta), version if "manifest" in seal else case.new.version, hold=case.delta)


# ---------------------------------------------------------------- edited containers


def _frame_of_size(data: st.DataObject, size: int) -> np.ndarray:
    """A well-formed zstd frame of the right size but the wrong bytes: only the hashes catch it."""
    content = data.draw(st.binary(min_size=size, max_size=size), label="content")
    return np.frombuffer(zstandard.ZstdCompressor(level=1).compress(content), dtype=np.uint8).copy()


def _content_size(blob: np.ndarray) -> int:
    try:
        return int(zstandard.frame_content_size(blob.tobytes()))
    except zstandard.ZstdError:  # a raw entry, or one an earlier edit replaced
        return -1


def _edit_frames(data: st.DataObject, frames: dict[str, np.ndarray]) -> None:
    keys = sorted(frames)
    how = data.draw(st.sampled_from(["drop", "copy", "swap", "random", "same size", "bomb", "empty"]),
                    label="frame edit")
    key = data.draw(st.sampled_from(keys), label="frame")
    if how == "drop":
        del frames[key]
    elif how == "copy":
        target = data.draw(st.sampled_from(keys) | st.text(min_size=1, max_size=12), label="to")
        frames[target] = frames[key].copy()
    elif how == "swap":
        other = data.draw(st.sampled_from(keys), label="other")
        frames[key], frames[other] = frames[other], frames[key]
    elif how == "random":
        frames[key] = np.frombuffer(data.draw(st.binary(max_size=64), label="blob"), dtype=np.uint8).copy()
    elif how == "same size" and 0 <= _content_size(frames[key]) <= 4096:  # not one an earlier edit made huge
        frames[key] = _frame_of_size(data, _content_size(frames[key]))
    elif how == "bomb":
        declared = data.draw(st.integers(0, 2**62), label="declared")
        header = bytes.fromhex("28b52ffd") + bytes([0xE0]) + struct.pack("<Q", declared) + bytes([1, 0, 0])
        frames[key] = np.frombuffer(header, dtype=np.uint8).copy()
    else:
        frames[key] = np.zeros(0, dtype=np.uint8)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_edited_frames_apply_exactly_or_raise_a_codec_error(case: Case, data: st.DataObject) -> None:
    if not safetensors.numpy.load(case.payload):
        return

    def edit(frames: dict[str, np.ndarray]) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="frame edits")):
            if frames:
                _edit_frames(data, frames)

    check(case, replace_frames(case.payload, edit), case.new.version, hold=case.delta or data.draw(st.booleans()))
