"""The delta codec: exact for every dtype and shape, compact when little changed, and loud —
each way a payload can be wrong is detected, named, and leaves the held weights untouched."""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from policyloop.weights import codec
from policyloop.weights.codec import TensorBytes, WeightSet
from tests.helpers import perturbed, random_weights


def same_bytes(a: WeightSet, b: WeightSet) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[n].dtype == b.tensors[n].dtype and a.tensors[n].shape == b.tensors[n].shape
        and np.array_equal(a.tensors[n].data, b.tensors[n].data) for n in a.tensors)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "I8"])
def test_delta_and_keyframe_reproduce_the_bytes_exactly(dtype: str) -> None:
    shapes = {"matrix": (37, 53), "vector": (7,), "scalar": (), "empty": (0, 4), "cube": (3, 5, 2)}
    base = random_weights(1, shapes=shapes, dtype=dtype)
    new = perturbed(base, 2, fraction=0.05)
    delta = codec.encode(new, base, frame_bytes=256)  # small frames: several per tensor
    held = base.copy()
    applied = codec.apply(held, delta.payload)
    assert applied is held and held.version == 2 and same_bytes(held, new)
    assert held.manifest_hash == new.manifest_hash
    keyframe = codec.encode(new)
    assert keyframe.stats.kind == "keyframe" and same_bytes(codec.apply(None, keyframe.payload), new)
    raw = codec.encode(new, raw=True)
    assert raw.stats.tensors["raw"] == len(shapes) and same_bytes(codec.apply(None, raw.payload), new)


def test_unchanged_tensors_carry_only_their_hash_and_deltas_are_small() -> None:
    base = random_weights(1, shapes={"big": (512, 512), "fixed": (512, 512)})
    tensors = base.copy().tensors
    hits = np.random.default_rng(2).random(512 * 512) < 0.02
    big = tensors["big"].data.reshape(-1, 2)
    big[hits, 0] ^= 1  # a low mantissa bit of 2% of the bf16 elements, like an RL step
    new = WeightSet.build(2, tensors)
    delta = codec.encode(new, base)
    assert delta.stats.tensors == {"same": 1, "xor": 1, "full": 0, "raw": 0}
    assert delta.stats.changed_elements == int(hits.sum())
    assert delta.stats.ratio > 25
    frames = safetensors.numpy.load(delta.payload)
    assert not any(name.startswith("fixed/") for name in frames)
    header = codec.read_header(delta.payload)
    assert {t["name"]: t["encoding"] for t in header.tensors} == {"big": "xor", "fixed": "same"}
    assert (header.kind, header.version, header.base_version) == ("delta", 2, 1)
    assert header.base_manifest_hash == base.manifest_hash and header.manifest_hash == new.manifest_hash


def test_a_tensor_whose_delta_would_be_bigger_goes_as_a_keyframe() -> None:
    base = random_weights(1, shapes={"zeros": (4096,), "other": (16,)})
    base.tensors["zeros"].data[:] = 0
    base = WeightSet.build(1, base.tensors)
    new = random_weights(2, seed=5, shapes={"zeros": (4096,), "other": (16,)})
    new.tensors["zeros"].data[:] = 7  # from zeros to a constant: the keyframe compresses, so does the XOR
    new.tensors["zeros"].data[::3] = 0  # …but XOR against zeros is the value itself: no gain either way
    new = WeightSet.build(2, new.tensors)
    delta = codec.encode(new, base)
    assert same_bytes(codec.apply(base.copy(), delta.payload), new)
    header = codec.read_header(delta.payload)
    sizes = {t["name"]: t["encoding"] for t in header.tensors}
    assert sizes["zeros"] in ("xor", "full")
    # A tensor that changed dtype or shape cannot be XORed: it goes as a keyframe.
    reshaped = WeightSet.build(3, {"zeros": TensorBytes("BF16", (2048, 2), new.tensors["zeros"].data.copy()),
                                   "other": new.tensors["other"]})
    header = codec.read_header(codec.encode(reshaped, new).payload)
    assert {t["name"]: t["encoding"] for t in header.tensors}["zeros"] == "full"


def test_a_tensor_reset_to_zeros_goes_as_a_keyframe_and_a_trained_one_as_xor() -> None:
    rng = np.random.default_rng(3)
    values = rng.standard_normal(8192).astype(np.float32)
    base = WeightSet.build(1, {"reset": TensorBytes("F32", (8192,), values.view(np.uint8).copy()),
                               "trained": TensorBytes("F32", (8192,), values.view(np.uint8).copy())})
    stepped = values + np.float32(1e-4) * np.sign(rng.standard_normal(8192)).astype(np.float32)  # every element
    new = WeightSet.build(2, {"reset": TensorBytes("F32", (8192,), np.zeros(8192 * 4, dtype=np.uint8)),
                              "trained": TensorBytes("F32", (8192,), stepped.view(np.uint8).copy())})
    delta = codec.encode(new, base)
    assert same_bytes(codec.apply(base.copy(), delta.payload), new)
    encodings = {t["name"]: t["encoding"] for t in codec.read_header(delta.payload).tensors}
    # XOR against random values is those values (incompressible); zeros compress to nothing.
    assert encodings == {"reset": "full", "trained": "xor"}
    assert delta.stats.changed_elements == 2 * 8192


def test_wrong_base_is_refused_by_version_and_by_manifest() -> None:
    base = random_weights(1)
    new = perturbed(base, 2)
    delta = codec.encode(new, base).payload
    with pytest.raises(codec.WrongBase, match="delta base is version 1, the held weights are version 2"):
        codec.apply(new.copy(), delta)  # applying twice is refused
    impostor = perturbed(base, 1, seed=9)  # same version number, other bytes
    with pytest.raises(codec.WrongBase, match="same version number, other weights"):
        codec.apply(impostor, delta)
    with pytest.raises(codec.WrongBase, match="none are held"):
        codec.apply(None, delta)


def header_fields(payload: bytes) -> dict[str, Any]:
    """The codec header a payload carries (its one `__metadata__` key)."""
    (length,) = struct.unpack("<Q", payload[:8])
    return json.loads(json.loads(payload[8:8 + length])["__metadata__"][codec.METADATA_KEY])


def reseal(meta: dict[str, Any], seal: tuple[str, ...]) -> None:
    """Recomputes what a producer computes: the manifest hash and/or the header's own hash."""
    if "manifest" in seal:
        meta["manifest_hash"] = codec.manifest_digest(
            ((t["name"], t["dtype"], t["shape"], t["xxh3_128"]) for t in meta["tensors"]), version=meta["version"])
    if "header" in seal:
        meta["header_hash"] = codec.header_digest(meta)


def rewrite(payload: bytes, edit, *, seal: tuple[str, ...] = ("manifest", "header")) -> bytes:  # type: ignore[no-untyped-def]
    """The payload with its header edited (a forged or buggy producer). `edit(meta, tensors,
    frames)` changes the header fields, its tensor entries or the frames; the header is then
    sealed again as a producer would (`seal`: which hashes to recompute)."""
    frames = safetensors.numpy.load(payload)
    meta = header_fields(payload)
    tensors = meta["tensors"]
    edit(meta, tensors, frames)
    reseal(meta, seal)
    return safetensors.numpy.save(frames, metadata={codec.METADATA_KEY: json.dumps(meta)})


def replace_frames(payload: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """The payload with its frames edited and its metadata kept as it is."""
    (length,) = struct.unpack("<Q", payload[:8])
    metadata = json.loads(payload[8:8 + length])["__metadata__"]
    frames = safetensors.numpy.load(payload)
    edit(frames)
    return safetensors.numpy.save(frames, metadata=metadata)


def assert_untouched(held: WeightSet, original: WeightSet) -> None:
    assert held.version == original.version and same_bytes(held, original)
    assert held.manifest_hash == original.manifest_hash


def test_every_corruption_is_named_and_leaves_the_held_weights_as_they_were() -> None:
    base = random_weights(1)
    new = perturbed(base, 2, fraction=0.1)
    payload = codec.encode(new, base, frame_bytes=1024).payload

    def flip_frame(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        blob = frames["embed/plane0/frame3"]
        blob[len(blob) // 2] ^= 0x40

    def wrong_hash(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        next(t for t in tensors if t["name"] == "norm")["xxh3_128"] = "0" * 32

    def unknown_tensor(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        entry = next(t for t in tensors if t["name"] == "norm")
        entry["name"] = "ghost"
        for key in [k for k in frames if k.startswith("norm/")]:
            frames["ghost" + key[4:]] = frames.pop(key)

    def shape_change(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        next(t for t in tensors if t["name"] == "layer.0.w")["shape"] = [32, 128]

    def missing_frame(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        del frames["layer.0.w/plane1/frame0"]

    cases = [
        (flip_frame, (codec.CorruptPayload, codec.HashMismatch), "embed"),
        (wrong_hash, codec.HashMismatch, "tensor 'norm'"),
        (unknown_tensor, codec.ManifestMismatch, "tensor 'ghost'"),
        (shape_change, codec.ManifestMismatch, "tensor 'layer.0.w': payload says BF16[32, 128]"),
        (missing_frame, codec.CorruptPayload, "layer.0.w/plane1/frame0"),
    ]
    for edit, error, named in cases:
        held = base.copy()
        with pytest.raises(error) as caught:
            codec.apply(held, rewrite(payload, edit))
        assert named in str(caught.value), edit.__name__
        assert_untouched(held, base)
    for cut in (3, 100, len(payload) // 2, len(payload) - 1):
        held = base.copy()
        with pytest.raises(codec.CorruptPayload):
            codec.apply(held, payload[:cut])
        assert_untouched(held, base)
    garbage = bytearray(payload)
    garbage[8:20] = b"not json at all!"[:12]
    with pytest.raises(codec.CorruptPayload, match="header"):
        codec.apply(base.copy(), bytes(garbage))
    # The intact payload still applies after all that.
    assert same_bytes(codec.apply(base.copy(), payload), new)


def test_a_failure_late_in_the_apply_undoes_the_tensors_already_changed() -> None:
    base = random_weights(1, shapes={f"t{i}": (256, 8) for i in range(6)})
    new = perturbed(base, 2, fraction=0.3)

    def last_hash_wrong(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        tensors[-1]["xxh3_128"] = "f" * 32

    held = base.copy()
    with pytest.raises(codec.HashMismatch, match="tensor 't5'"):
        codec.apply(held, rewrite(codec.encode(new, base).payload, last_hash_wrong))
    assert_untouched(held, base)


def test_manifest_hash_depends_on_every_name_shape_and_byte() -> None:
    w = random_weights(1)
    assert w.manifest_hash == random_weights(1).manifest_hash
    assert w.manifest_hash != perturbed(w, 1, fraction=0.001).manifest_hash
    renamed = WeightSet.build(1, {("x" if n == "norm" else n): t for n, t in w.tensors.items()})
    assert renamed.manifest_hash != w.manifest_hash


def test_chained_deltas_stay_exact() -> None:
    weights = random_weights(1, shapes={"a": (128, 32), "b": (50,)}, dtype="F32")
    held = weights.copy()
    for version in range(2, 60):
        nxt = perturbed(weights, version, fraction=0.01, seed=version)
        held = codec.apply(held, codec.encode(nxt, weights).payload)
        weights = nxt
    assert same_bytes(held, weights) and held.version == 59


def test_tensor_bytes_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(ValueError, match="dtype 'Q8'"):
        TensorBytes("Q8", (2,), np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="do not hold a F32 tensor of shape"):
        TensorBytes("F32", (3,), np.zeros(8, dtype=np.uint8))
    with pytest.raises(ValueError, match="1-D C-contiguous uint8"):
        TensorBytes("F32", (2,), np.zeros(2, dtype=np.float32))


# ---------------------------------------------------------------- hostile headers: only codec errors


def _delta_and_keyframe() -> tuple[WeightSet, WeightSet, bytes, bytes]:
    base = random_weights(1)
    new = perturbed(base, 2, fraction=0.1)
    return base, new, codec.encode(new, base, frame_bytes=1024).payload, codec.encode(new, frame_bytes=1024).payload


_DELETE = object()


def _tensor_field(name: str, key: str, value: object = _DELETE):  # type: ignore[no-untyped-def]
    """An edit that sets (or deletes) one field of one tensor entry."""
    def edit(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        entry = next(t for t in tensors if t["name"] == name)
        if value is _DELETE:
            del entry[key]
        else:
            entry[key] = value
    return edit


def _field(key: str, value: object = _DELETE):  # type: ignore[no-untyped-def]
    """An edit that sets (or deletes) one header field."""
    def edit(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        if value is _DELETE:
            del meta[key]
        else:
            meta[key] = value
    return edit


def _duplicate_first(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
    tensors.append(dict(tensors[0]))


def _entry_not_an_object(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
    tensors[0] = "embed"


HOSTILE_HEADERS = [
    # (what, edit, fragment of the message)
    ("negative dimension", _tensor_field("embed", "shape", [-1, 64]), "tensor 'embed': shape[0]: -1"),
    ("shape not a list", _tensor_field("embed", "shape", "300x64"), "tensor 'embed': shape"),
    ("boolean dimension", _tensor_field("embed", "shape", [True, 64]), "tensor 'embed': shape[0]"),
    ("float dimension", _tensor_field("embed", "shape", [300.0, 64]), "tensor 'embed': shape[0]"),
    ("dimension past int64", _tensor_field("embed", "shape", [2**64, 0]), "tensor 'embed': shape[0]"),
    ("too many dimensions", _tensor_field("embed", "shape", [1] * 65), "tensor 'embed': shape"),
    ("unknown dtype", _tensor_field("embed", "dtype", "Q8"), "tensor 'embed': dtype 'Q8'"),
    ("sub-byte dtype", _tensor_field("embed", "dtype", "F4"), "tensor 'embed': dtype 'F4' has 4-bit elements"),
    ("dtype not a string", _tensor_field("embed", "dtype", 2), "tensor 'embed': dtype 2"),
    ("unknown encoding", _tensor_field("embed", "encoding", "zip"), "tensor 'embed': encoding 'zip'"),
    ("empty name", _tensor_field("embed", "name", ""), "tensors[0]: name ''"),
    ("name not a string", _tensor_field("embed", "name", 7), "tensors[0]: name 7"),
    ("duplicated tensor", _duplicate_first, "tensor 'embed': listed twice"),
    ("entry not an object", _entry_not_an_object, "tensors[0]"),
    ("missing field", _tensor_field("norm", "xxh3_128"), "tensor 'norm': fields ['xxh3_128']"),
    ("unknown field", _tensor_field("norm", "extra", 1), "tensor 'norm': fields ['extra']"),
    ("hash not lower-case hex", _tensor_field("norm", "xxh3_128", "A" * 32), "tensor 'norm': xxh3_128"),
    ("short hash", _tensor_field("norm", "xxh3_128", "ab"), "tensor 'norm': xxh3_128"),
    ("frames inconsistent with the shape", _tensor_field("embed", "frames", 1), "tensor 'embed': frames is 1"),
    ("frames not an integer", _tensor_field("embed", "frames", "38"), "tensor 'embed': frames is '38'"),
    ("frame_bytes zero", _field("frame_bytes", 0), "header: frame_bytes: 0"),
    ("frame_bytes huge", _field("frame_bytes", 2**40), "header: frame_bytes"),
    ("frame_bytes a string", _field("frame_bytes", "1024"), "header: frame_bytes: '1024'"),
    ("negative version", _field("version", -1), "header: version: -1"),
    ("version a string", _field("version", "2"), "header: version: '2'"),
    ("version a float", _field("version", 2.0), "header: version: 2.0"),
    ("version past int64", _field("version", 2**63), "header: version"),
    ("version null", _field("version", None), "header: version: None"),
    ("negative base version", _field("base_version", -3), "header: base_version: -3"),
    ("base manifest not a hash", _field("base_manifest_hash", "xyz"), "header: base_manifest_hash"),
    ("unknown kind", _field("kind", "snapshot"), "header: kind 'snapshot'"),
    ("other codec", _field("codec", "policyloop.xor-planes-zstd/1"), "codec 'policyloop.xor-planes-zstd/1'"),
    ("tensors not a list", _field("tensors", {}), "header: tensors {}"),
    ("missing header field", _field("frame_bytes"), "header: fields ['frame_bytes']"),
    ("unknown header field", _field("note", "x"), "header: fields ['note']"),
]


@pytest.mark.parametrize(("what", "edit", "named"), HOSTILE_HEADERS, ids=[c[0] for c in HOSTILE_HEADERS])
def test_a_malformed_header_raises_a_codec_error_naming_the_field(what: str, edit, named: str) -> None:  # type: ignore[no-untyped-def]
    base, _, delta, _ = _delta_and_keyframe()
    payload = rewrite(delta, edit, seal=("header",))  # a producer that seals what it wrote
    with pytest.raises(codec.CorruptPayload) as caught:
        codec.read_header(payload)
    assert named in str(caught.value)
    held = base.copy()
    with pytest.raises(codec.CorruptPayload, match=re.escape(named)):
        codec.apply(held, payload)
    assert_untouched(held, base)


def test_a_keyframe_takes_no_base_and_no_unchanged_tensors() -> None:
    _, new, _, keyframe = _delta_and_keyframe()
    cases = [
        (_tensor_field("norm", "encoding", "same"), "tensor 'norm': encoding 'same' needs a base"),
        (_field("base_version", 1), "header: a keyframe has base_version 0"),
    ]
    for edit, named in cases:
        with pytest.raises(codec.CorruptPayload, match=re.escape(named)):
            codec.apply(None, rewrite(keyframe, edit))
    assert same_bytes(codec.apply(None, keyframe), new)


def _container(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def _safetensors_header(entries: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    return json.dumps({"__metadata__": metadata or {}, **entries}).encode()


def test_a_damaged_container_raises_a_codec_error() -> None:
    _, _, delta, _ = _delta_and_keyframe()
    (length,) = struct.unpack("<Q", delta[:8])
    header = json.loads(delta[8:8 + length])
    body = delta[8 + length:]
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]

    def edited(change) -> bytes:  # type: ignore[no-untyped-def]
        copy = json.loads(json.dumps(header))
        change(copy)
        return _container(json.dumps(copy).encode(), body)

    def overlap(h) -> None:  # type: ignore[no-untyped-def]
        h[second]["data_offsets"][0] -= 1
        h[second]["shape"][0] += 1

    def two_keys(h) -> None:  # type: ignore[no-untyped-def]
        h["__metadata__"]["format"] = "np"

    cases = [
        (_container(b"{}" + b" " * 6, b""), "holds []"),                                 # not a codec payload
        (_container(b"[]"), "not a JSON object"),
        (_container(b"{" * 100_000), "not valid JSON"),                                 # nesting past the parser
        (_container(b'{"a":1,"a":2}'), "appears twice"),
        (_container(b'{"__metadata__":{"x":NaN}}'), "not valid JSON"),
        (_container(b"{\xff}"), "not valid JSON"),
        (struct.pack("<Q", 2**63) + b"{}", "header claims"),
        (edited(lambda h: h[first].update(dtype="F32")), "frames are U8"),
        (edited(lambda h: h[first].update(shape=[1, 2])), "frames are 1-D"),
        (edited(lambda h: h[first].update(data_offsets=[0])), "data_offsets"),
        (edited(overlap), "a gap or an overlap"),
        (edited(lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]})),
         "entry 'extra' belongs to no tensor"),
        (edited(two_keys), "__metadata__ holds ['format', 'policyloop.weights']"),
        (edited(lambda h: h["__metadata__"].update({codec.METADATA_KEY: 5})), "__metadata__ does not map"),
        (_container(json.dumps(header).encode(), body + b"\0"), "which has"),           # padded
    ]
    for payload, named in cases:
        with pytest.raises(codec.CorruptPayload, match=re.escape(named)):
            codec.apply(None, payload)


def test_a_huge_declared_shape_fails_before_anything_is_allocated() -> None:
    """A keyframe declaring 2**40 elements: refused by the caller's bound, and under a bound that
    allows it, by the container not holding the frames that shape needs."""
    _, _, _, keyframe = _delta_and_keyframe()

    def huge(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        tensors[0]["shape"] = [2**20, 2**20]

    def huge_with_frames(meta, tensors, frames) -> None:  # type: ignore[no-untyped-def]
        huge(meta, tensors, frames)
        tensors[0]["frames"] = 2**41 // 1024

    tracemalloc.start()
    try:
        with pytest.raises(codec.TooLarge, match="tensor 'embed'.*max_bytes"):
            codec.apply(None, rewrite(keyframe, huge_with_frames))
        with pytest.raises(codec.CorruptPayload, match=r"tensor 'embed': frames is 38, 2147483648 frames"):
            codec.apply(None, rewrite(keyframe, huge), max_bytes=2**50)
        # Every whole frame of the first tensor is there; the last one is too short for the shape.
        with pytest.raises(codec.CorruptPayload, match=r"'embed/plane0/frame37' declares 256 bytes"):
            codec.apply(None, rewrite(keyframe, huge_with_frames), max_bytes=2**50)
        assert tracemalloc.get_traced_memory()[1] < 20 * 2**20
    finally:
        tracemalloc.stop()


def _zstd_frame_declaring(size: int) -> np.ndarray:
    """A zstd frame header declaring `size` bytes of content, then an empty last raw block."""
    frame = bytes.fromhex("28b52ffd") + bytes([0xE0]) + struct.pack("<Q", size) + bytes([1, 0, 0])
    return np.frombuffer(frame, dtype=np.uint8).copy()


def test_a_frame_declaring_a_huge_size_is_refused_before_decompressing() -> None:
    base, _, delta, _ = _delta_and_keyframe()

    def bomb(frames) -> None:  # type: ignore[no-untyped-def]
        frames["embed/plane1/frame2"] = _zstd_frame_declaring(2**44)

    def not_zstd(frames) -> None:  # type: ignore[no-untyped-def]
        frames["embed/plane1/frame2"] = np.zeros(3, dtype=np.uint8)

    for edit, named in ((bomb, "declares 17592186044416 bytes"), (not_zstd, "does not start with a zstd frame")):
        held = base.copy()
        with pytest.raises(codec.CorruptPayload, match=f"tensor 'embed': frame 'embed/plane1/frame2' {named}"):
            codec.apply(held, replace_frames(delta, edit))
        assert_untouched(held, base)


def test_max_bytes_bounds_what_a_payload_may_declare() -> None:
    base, new, delta, keyframe = _delta_and_keyframe()
    for payload, held in ((delta, base.copy()), (keyframe, None)):
        with pytest.raises(codec.TooLarge):
            codec.read_header(payload, max_bytes=new.raw_bytes - 1)
        with pytest.raises(codec.TooLarge):
            codec.apply(held, payload, max_bytes=new.raw_bytes - 1)
        assert same_bytes(codec.apply(held, payload, max_bytes=new.raw_bytes), new)


# ---------------------------------------------------------------- every dtype

# Every dtype safetensors 0.8.0 knows.
SAFETENSORS_DTYPES = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
                      "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # no byte planes: refused by name


def test_the_codec_knows_every_safetensors_dtype() -> None:
    assert set(codec.ITEMSIZE) == set(SAFETENSORS_DTYPES) - set(SUB_BYTE_BITS)
    assert codec.SUB_BYTE_BITS == SUB_BYTE_BITS


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES)
def test_every_safetensors_dtype_round_trips_or_is_refused_by_name(dtype: str) -> None:
    if dtype in SUB_BYTE_BITS:
        with pytest.raises(ValueError, match=f"dtype '{dtype}' has {SUB_BYTE_BITS[dtype]}-bit elements"):
            TensorBytes(dtype, (8,), np.zeros(8, dtype=np.uint8))
        return
    shapes = {"matrix": (9, 7), "scalar": (), "empty": (0, 3)}
    base = random_weights(1, shapes=shapes, dtype=dtype)
    new = perturbed(base, 2, fraction=0.2)
    assert same_bytes(codec.apply(base.copy(), codec.encode(new, base, frame_bytes=16).payload), new)
    assert same_bytes(codec.apply(None, codec.encode(new).payload), new)
    assert same_bytes(codec.apply(None, codec.encode(new, raw=True).payload), new)


def test_torch_dtypes_round_trip_through_torch_io_unsigned_included() -> None:
    torch = pytest.importorskip("torch")
    from policyloop.weights import torch_io

    for name in ("uint16", "uint32", "uint64"):
        assert getattr(torch, name) in torch_io.DTYPE_NAMES
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in torch_io.DTYPE_NAMES:
        raw = torch.randint(0, 256, (6 * dtype.itemsize * 5,), dtype=torch.uint8, generator=generator)
        tensors[str(dtype)] = raw.view(dtype).reshape(6, 5)
    base = torch_io.weight_set(1, tensors)
    changed = {n: t.clone() for n, t in tensors.items()}
    for t in changed.values():
        t.view(torch.uint8).view(-1)[::7] ^= 1
    new = torch_io.weight_set(2, changed)
    for payload, held in ((codec.encode(new, base).payload, base.copy()), (codec.encode(new).payload, None)):
        applied = codec.apply(held, payload)
        assert applied.version == 2 and applied.manifest_hash == new.manifest_hash
        for n, t in changed.items():
            back = torch_io.to_tensor(applied.tensors[n])
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)), n


def test_a_torch_dtype_the_codec_cannot_carry_is_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    from policyloop.weights import torch_io

    with pytest.raises(ValueError, match="torch.float4_e2m1fn_x2"):
        torch_io.to_bytes(torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))
    with pytest.raises(ValueError, match="torch.complex128"):
        torch_io.to_bytes(torch.zeros(2, dtype=torch.complex128))


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's beta/prototype notes for sparse CSR, nested, qint8
def test_a_tensor_without_dense_bytes_is_refused_naming_it() -> None:
    """Meta, sparse and nested tensors are refused with a ValueError that names the tensor (torch
    alone raises NotImplementedError or RuntimeErrors that name neither it nor the way out)."""
    torch = pytest.importorskip("torch")
    from policyloop.weights import torch_io

    dense = torch.eye(3)
    refused = {
        "meta": (torch.empty(3, 3, device="meta"), "meta tensor has no data"),
        "sparse_coo": (dense.to_sparse(), "torch.sparse_coo tensor.*to_dense"),
        "sparse_csr": (dense.to_sparse_csr(), "torch.sparse_csr tensor.*to_dense"),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
        "quantized": (torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), "torch.qint8"),
    }
    for kind, (tensor, says) in refused.items():
        name = f"model.layers.0.{kind}.weight"
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: .*{says}"):
            torch_io.weight_set(1, {"model.embed.weight": dense, name: tensor})
    # What stays carried: a transposed (non-contiguous) view, a parameter that requires grad.
    carried = torch_io.weight_set(1, {"t": dense.t(), "p": torch.nn.Parameter(dense.clone())})
    assert torch.equal(torch_io.to_tensor(carried.tensors["t"]), dense.t())


# ---------------------------------------------------------------- version labels and determinism


def test_the_manifest_hash_covers_the_version_number() -> None:
    w = random_weights(1)
    assert WeightSet.build(2, w.tensors).manifest_hash != w.manifest_hash
    assert WeightSet.build(1, w.tensors).manifest_hash == w.manifest_hash


def test_a_relabelled_version_is_detected() -> None:
    """A delta or keyframe of version 2 whose header says version 3: whether the editor left the
    header's own hash as it was or recomputed it, the version is not applied."""
    base, _, delta, keyframe = _delta_and_keyframe()
    relabel = _field("version", 3)
    for payload, held_weights in ((delta, base), (keyframe, None)):
        for seal, error, named in (((), codec.CorruptPayload, "header_hash says"),
                                   (("header",), codec.HashMismatch, "manifest: version 3")):
            held = held_weights.copy() if held_weights is not None else None
            with pytest.raises(error, match=named):
                codec.read_header(rewrite(payload, relabel, seal=seal))
            with pytest.raises(error, match=named):
                codec.apply(held, rewrite(payload, relabel, seal=seal))
            if held is not None and held_weights is not None:
                assert_untouched(held, held_weights)


def test_a_relabelled_base_is_detected() -> None:
    """A delta from version 1 relabelled as from version 5, held by a replica whose version 5 has
    version 1's bytes: the base manifest covers the version number, so it is refused."""
    base, _, delta, _ = _delta_and_keyframe()
    impostor = WeightSet(5, base.copy().tensors, dict(base.digests))
    with pytest.raises(codec.CorruptPayload, match="header_hash says"):
        codec.apply(impostor, rewrite(delta, _field("base_version", 5), seal=()))
    with pytest.raises(codec.WrongBase, match="same version number, other weights"):
        codec.apply(impostor, rewrite(delta, _field("base_version", 5)))
    assert_untouched(impostor, WeightSet(5, base.tensors, base.digests))


def test_every_header_field_is_covered_by_the_header_hash() -> None:
    _, _, delta, _ = _delta_and_keyframe()
    meta = header_fields(delta)
    for key in sorted(set(meta) - {"header_hash", "codec"}):
        value = meta[key]
        changed = value + 1 if isinstance(value, int) else ("f" * 32 if isinstance(value, str) else value[:-1])
        if key == "kind":
            changed = "keyframe"
        with pytest.raises(codec.CodecError):
            codec.read_header(rewrite(delta, _field(key, changed), seal=()))


def test_encoding_the_same_weights_twice_gives_the_same_bytes() -> None:
    base, new, _, _ = _delta_and_keyframe()
    for make in (lambda: codec.encode(new, base), lambda: codec.encode(new), lambda: codec.encode(new, raw=True)):
        payloads = {make().payload for _ in range(8)}
        assert len(payloads) == 1
        safetensors.numpy.load(payloads.pop())  # still a plain safetensors file


def test_the_header_is_canonical_json_under_one_metadata_key() -> None:
    _, _, delta, _ = _delta_and_keyframe()
    (length,) = struct.unpack("<Q", delta[:8])
    metadata = json.loads(delta[8:8 + length])["__metadata__"]
    assert list(metadata) == [codec.METADATA_KEY]
    fields = json.loads(metadata[codec.METADATA_KEY])
    assert metadata[codec.METADATA_KEY] == json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert fields["codec"] == codec.CODEC == "policyloop.xor-planes-zstd/2"
    assert fields["header_hash"] == codec.header_digest(fields)
