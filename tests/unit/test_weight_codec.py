"""The delta codec: exact for every dtype and shape, compact when little changed, and loud —
each way a payload can be wrong is detected, named, and leaves the held weights untouched."""

from __future__ import annotations

import json
import struct

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


def rewrite(payload: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """The payload with its metadata edited (a forged or buggy producer)."""
    frames = safetensors.numpy.load(payload)
    (length,) = struct.unpack("<Q", payload[:8])
    meta = json.loads(payload[8:8 + length])["__metadata__"]
    tensors = json.loads(meta["tensors"])
    edit(meta, tensors, frames)
    meta["tensors"] = json.dumps(tensors)
    return safetensors.numpy.save(frames, metadata=meta)


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
