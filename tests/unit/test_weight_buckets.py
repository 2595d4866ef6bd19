"""The bucket planner and byte layout of the colocated weight sync (policyloop.weights.broadcast.layout):
size limits, one dtype per bucket, order, oversize tensors, offsets; flatten → unflatten returns
exactly the bytes sent, for every dtype and odd shapes; the rank layout of several engines; and
the weight-sync requests send only fields SGLang 0.5.23 has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from policyloop.engines.protocol import (
    BeginWeightUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    RequestError,
    UpdateWeightsFromDistributedRequest,
)
from policyloop.weights.broadcast.layout import (
    Bucket,
    TensorSpec,
    dtype_name,
    flatten_bucket,
    parse_dtype,
    plan_buckets,
    rank_offsets,
    unflatten_bucket,
)

# Field names of SGLang 0.5.23's request structs, extracted from its source (a copy of the
# team's shared reference, kept with the tests so a clone checks the same contract).
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "sglang-0.5.23-api.json"


def spec(name: str, dtype: torch.dtype, *shape: int) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape))


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------
# Planning.


def test_plan_worked_example() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [spec("a", f32, 10), spec("b", f32, 5), spec("c", bf16, 3), spec("d", f32, 100), spec("e", bf16, 2, 2)]
    buckets = plan_buckets(specs, bucket_bytes=64)
    # a+b fit (60 B); d (400 B) is oversize: a+b close first, then d alone; c+e (14 B) close at the end.
    assert [b.names for b in buckets] == [["a", "b"], ["d"], ["c", "e"]]
    assert [[e.offset for e in b.entries] for b in buckets] == [[0, 40], [0], [0, 6]]
    assert [b.nbytes for b in buckets] == [60, 400, 14]
    assert buckets[2].dtype_names == ["bfloat16", "bfloat16"] and buckets[2].shapes == [[3], [2, 2]]


def _mixed_specs() -> list[TensorSpec]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    shapes = [(7, 3), (), (129,), (0, 4), (1,), (33, 5), (2, 3, 5), (300,), (8,), (1, 1, 1)]
    return [TensorSpec(f"t{i}", dtypes[i % len(dtypes)], shapes[(i * 3) % len(shapes)]) for i in range(40)]


@pytest.mark.parametrize("limit", [1, 16, 100, 600, 10**9])
def test_plan_invariants(limit: int) -> None:
    specs = _mixed_specs()
    buckets = plan_buckets(specs, bucket_bytes=limit)
    # every tensor exactly once
    assert sorted(s.name for b in buckets for s in b.specs) == sorted(s.name for s in specs)
    for bucket in buckets:
        assert len({s.dtype for s in bucket.specs}) == 1  # one dtype per bucket
        assert bucket.nbytes <= limit or len(bucket.entries) == 1  # only a lone tensor may exceed
    # order kept within each dtype
    for dtype in {s.dtype for s in specs}:
        planned = [s.name for b in buckets for s in b.specs if s.dtype == dtype]
        assert planned == [s.name for s in specs if s.dtype == dtype]


def test_plan_oversize_tensor_gets_its_own_bucket_in_order() -> None:
    f32 = torch.float32
    buckets = plan_buckets([spec("small", f32, 2), spec("huge", f32, 1000), spec("after", f32, 2)], bucket_bytes=64)
    assert [b.names for b in buckets] == [["small"], ["huge"], ["after"]]
    assert buckets[1].nbytes == 4000


def test_plan_one_bucket_when_everything_fits() -> None:
    specs = [spec(f"w{i}", torch.float32, 4, 4) for i in range(5)]
    (bucket,) = plan_buckets(specs, bucket_bytes=5 * 64)
    assert bucket.names == [f"w{i}" for i in range(5)] and bucket.nbytes == 5 * 64


def test_plan_rejects_a_useless_limit() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([spec("a", torch.float32, 1)], bucket_bytes=0)


def test_layout_offsets_are_back_to_back() -> None:
    specs = [spec("a", torch.float16, 3, 3), spec("s", torch.float16), spec("z", torch.float16, 0, 7),
             spec("b", torch.float16, 5)]
    bucket = Bucket.layout(specs)
    assert [(e.offset, e.end) for e in bucket.entries] == [(0, 18), (18, 20), (20, 20), (20, 30)]
    assert bucket.nbytes == 30


def test_layout_refuses_what_sglang_refuses() -> None:
    with pytest.raises(ValueError, match="not aligned"):  # a float32 at byte 2
        Bucket.layout([spec("h", torch.bfloat16, 1), spec("f", torch.float32, 1)])
    with pytest.raises(ValueError, match="at least one"):
        Bucket.layout([])
    with pytest.raises(ValueError, match="negative"):
        Bucket.layout([spec("n", torch.float32, -1)])


def test_rank_offsets() -> None:
    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([2, 2]) == ([1, 3], 5)
    assert rank_offsets([1, 4, 2]) == ([1, 2, 6], 8)
    with pytest.raises(ValueError):
        rank_offsets([1, 0])


def test_dtype_names() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool,
                  torch.float8_e4m3fn):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    for bad in ("bf16", "Tensor", "", "_C"):
        with pytest.raises(ValueError):
            parse_dtype(bad)


# ---------------------------------------------------------------------------------------------
# Flatten / unflatten.


def _special(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values plus the ones a lossy path would change: NaN, ±inf, -0.0, tiny numbers."""
    generator = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    flat = tensor.reshape(-1)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-30]
    for i, value in enumerate(specials[: flat.numel()]):
        flat[i] = value
    return tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    shapes = [(3, 5, 7), (), (1,), (0, 4), (13,), (2, 1, 3), ()]
    tensors = {f"p{i}": _special(dtype, shape, i) for i, shape in enumerate(shapes)}
    buckets = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], bucket_bytes=64)
    assert len(buckets) > 1
    seen = {}
    for bucket in buckets:
        buffer = flatten_bucket(bucket, tensors)
        assert buffer.dtype == torch.uint8 and buffer.shape == (bucket.nbytes,)
        # SGLang's layout: the raw bytes of each tensor, back to back, in order.
        assert buffer.numpy().tobytes() == b"".join(raw(tensors[name]) for name in bucket.names)
        received = torch.empty_like(buffer).copy_(buffer)  # what a receiver's buffer holds
        for name, tensor in unflatten_bucket(bucket, received):
            assert tensor.dtype == dtype and tensor.shape == tensors[name].shape
            assert raw(tensor) == raw(tensors[name])
            seen[name] = tensor
    assert set(seen) == set(tensors)


def test_round_trip_of_other_dtypes_and_non_contiguous_input() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) / 7
    tensors = {"transposed": base.t(), "ints": torch.tensor([[-3, 2**40], [7, 0]], dtype=torch.int64),
               "mask": torch.tensor([True, False, True]), "bytes": torch.tensor([0, 255, 17], dtype=torch.uint8)}
    for bucket in plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], bucket_bytes=1 << 20):
        for name, tensor in unflatten_bucket(bucket, flatten_bucket(bucket, tensors).clone()):
            assert torch.equal(tensor, tensors[name]) and raw(tensor) == raw(tensors[name])


def test_unflatten_gives_views_of_the_buffer() -> None:
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    (bucket,) = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], bucket_bytes=1024)
    buffer = flatten_bucket(bucket, tensors)
    named = dict(unflatten_bucket(bucket, buffer))
    buffer.zero_()
    assert torch.equal(named["a"], torch.zeros(3))  # no copy was made


def test_flatten_and_unflatten_check_their_inputs() -> None:
    tensors = {"a": torch.ones(3), "b": torch.zeros(2)}
    (bucket,) = plan_buckets([TensorSpec.of(n, t) for n, t in tensors.items()], bucket_bytes=1024)
    with pytest.raises(ValueError, match="'b'"):
        flatten_bucket(bucket, {"a": torch.ones(3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="'a'"):
        flatten_bucket(bucket, {"a": torch.ones(3, dtype=torch.float16), "b": torch.zeros(2)})
    with pytest.raises(KeyError, match="'b'"):
        flatten_bucket(bucket, {"a": torch.ones(3)})
    with pytest.raises(ValueError, match="20 bytes"):
        unflatten_bucket(bucket, torch.zeros(19, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unflatten_bucket(bucket, torch.zeros(5, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# The requests on the wire.


def _reference_fields(struct: str) -> set[str]:
    return set(json.loads(REFERENCE.read_text())["request_structs"][struct]["fields"])


def test_requests_send_only_sglang_fields() -> None:
    update = UpdateWeightsFromDistributedRequest(names=("w",), dtypes=("bfloat16",), shapes=((2, 3),),
                                                 weight_version="3", load_format="flattened_bucket",
                                                 selector="target")
    init = InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
                                         backend="gloo")
    assert set(update.to_json()) <= _reference_fields("UpdateWeightsFromDistributedReqInput")
    assert set(init.to_json()) == _reference_fields("InitWeightsUpdateGroupReqInput")
    assert set(DestroyWeightsUpdateGroupRequest().to_json()) == _reference_fields("DestroyWeightsUpdateGroupReqInput")
    assert set(BeginWeightUpdateRequest().to_json()) == _reference_fields("BeginWeightUpdateReqInput")
    assert _reference_fields("EndWeightUpdateReqInput") == set()  # the client sends {}
    # and they read back the same
    assert UpdateWeightsFromDistributedRequest.from_json(update.to_json()) == update
    assert InitWeightsUpdateGroupRequest.from_json(init.to_json()) == init


@pytest.mark.parametrize(("body", "field"), [
    ({"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[1]]}, "dtypes"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1], [2]]}, "shapes"),
    ({"names": ["a", "b"], "dtypes": ["float32", "bf16"], "shapes": [[1], [2]]}, "dtypes[1]"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes[0]"),
    ({"names": [], "dtypes": [], "shapes": []}, "names"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "tensors": 1}, "tensors"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "selector": "both"}, "selector"),
])
def test_update_request_errors_name_the_field(body: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        UpdateWeightsFromDistributedRequest.from_json(body)
    assert info.value.field == field


@pytest.mark.parametrize(("change", "field"), [
    ({"master_port": None}, "master_port"), ({"rank_offset": 0}, "rank_offset"), ({"rank_offset": 2}, "rank_offset"),
    ({"world_size": 1}, "world_size"), ({"backend": "mpi"}, "backend"), ({"master_port": 70000}, "master_port"),
])
def test_init_request_errors_name_the_field(change: dict, field: str) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2} | change
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(RequestError) as info:
        InitWeightsUpdateGroupRequest.from_json(body)
    assert info.value.field == field
