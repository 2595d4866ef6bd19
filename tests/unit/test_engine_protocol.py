"""The SGLang request structs: what a body is refused for, named and with SGLang's status (422 for
a body that does not fit the struct, 400 for a value refused), and every struct reading back
what it writes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyloop.engines.protocol import (
    SCHEMA,
    AbortRequest,
    BeginWeightUpdateRequest,
    ControlResult,
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    RequestError,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResult,
    UpdateWeightVersionRequest,
    WeightVersionSpan,
    parse_continue,
    parse_end_weight_update,
    parse_pause,
)


def refusal(parse: Any, body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body)
    return info.value


def generate(**fields: Any) -> dict[str, Any]:
    return {"input_ids": [4, 5], **fields}


@pytest.mark.parametrize(("body", "field", "status"), [
    # A wrong type at the top level: FastAPI's 422.
    (generate(return_logprob="yes"), "return_logprob", SCHEMA),
    (generate(rid=7), "rid", SCHEMA),
    ({"input_ids": "12+3"}, "input_ids", SCHEMA),
    ({"input_ids": [4, True]}, "input_ids", SCHEMA),  # no bool for an int; the list is named
    ({"text": 3}, "text", SCHEMA),
    ([{"input_ids": [4]}], "body", SCHEMA),
    # Inside sampling_params SGLang checks the dict itself: 400 for a wrong type too.
    (generate(sampling_params={"temperature": "hot"}), "sampling_params.temperature", 400),
    (generate(sampling_params={"max_new_tokens": "8"}), "sampling_params.max_new_tokens", 400),
    (generate(sampling_params={"stop_token_ids": [1, "x"]}), "sampling_params.stop_token_ids", 400),
    (generate(sampling_params="greedy"), "sampling_params", 400),
    # Values out of range: 400, naming the field.
    (generate(sampling_params={"temperature": -0.1}), "sampling_params.temperature", 400),
    (generate(sampling_params={"top_p": 0}), "sampling_params.top_p", 400),
    (generate(sampling_params={"top_p": 1.5}), "sampling_params.top_p", 400),
    (generate(sampling_params={"top_k": 0}), "sampling_params.top_k", 400),
    (generate(sampling_params={"max_new_tokens": -1}), "sampling_params.max_new_tokens", 400),
    ({"input_ids": []}, "input_ids", 400),
    (generate(rid=""), "rid", 400),
    ({"input_ids": [4], "text": "4"}, "input_ids", 400),
    ({}, "input_ids", 400),
    # A batch where one prompt is expected: 400.
    ({"input_ids": [[4], [5]]}, "input_ids", 400),
    ({"text": ["a", "b"]}, "text", 400),
    (generate(sampling_params=[{}]), "sampling_params", 400),
    # Unknown fields, at either level.
    (generate(frobnicate=1), "frobnicate", 400),
    (generate(sampling_params={"temprature": 0.5}), "sampling_params.temprature", 400),
    # SGLang features the embedded engine lacks, when they are on.
    (generate(stream=[True]), "stream", 422),
    (generate(logprob_start_len=-2), "logprob_start_len", 400),
    (generate(sampling_params={"frequency_penalty": 0.5}), "sampling_params.frequency_penalty", 400),
    (generate(sampling_params={"n": 2}), "sampling_params.n", 400),
])
def test_generate_refusals_name_the_field_with_sglangs_status(body: Any, field: str, status: int) -> None:
    error = refusal(GenerateRequest.from_json, body)
    assert (error.field, error.status) == (field, status), error
    assert str(error).startswith(field + ": ")


def test_sglang_features_at_their_default_and_ignored_fields_are_accepted() -> None:
    parsed = GenerateRequest.from_json(generate(
        stream=False, top_logprobs_num=0, lora_path=None, logprob_start_len=-1, priority=3, routing_key="r",
        sampling_params={"frequency_penalty": 0.0, "n": 1, "stop": None, "min_p": 0, "no_stop_trim": True,
                         "spaces_between_special_tokens": False}))
    assert parsed == GenerateRequest(input_ids=[4, 5], return_logprob=False)


def test_what_sglang_reads_as_its_default() -> None:
    parsed = GenerateRequest.from_json(generate(sampling_params=None, return_logprob=None))
    assert parsed.sampling_params == SamplingParams() and parsed.return_logprob is False
    assert GenerateRequest.from_json(generate()).return_logprob is False  # SGLang's default
    assert GenerateRequest(input_ids=[4]).return_logprob is True  # the rollout's
    params = SamplingParams.from_json({"top_k": 1 << 30, "stop_token_ids": None, "temperature": 0})
    assert (params.top_k, params.stop_token_ids, params.temperature) == (-1, (), 0.0)
    assert SamplingParams.from_json(None) == SamplingParams()
    assert AbortRequest.from_json({"rid": ""}).rid is None


@pytest.mark.parametrize(("parse", "body", "field", "status"), [
    (parse_pause, {"mode": "sideways"}, "mode", SCHEMA),
    (parse_pause, {"mode": "abort", "hard": True}, "hard", 400),
    (parse_continue, {"torch_empty_cache": 1}, "torch_empty_cache", SCHEMA),
    (parse_end_weight_update, {"selector": "all"}, "selector", 400),
    (UpdateWeightsFromDiskRequest.from_json, {"weight_version": "3"}, "model_path", SCHEMA),
    (UpdateWeightsFromDiskRequest.from_json, {"model_path": "/m", "is_async": True}, "is_async", 400),
    (UpdateWeightsFromDiskRequest.from_json, None, "body", SCHEMA),
    (UpdateWeightVersionRequest.from_json, {"new_version": 3}, "new_version", SCHEMA),
    (AbortRequest.from_json, {"rid": "x", "everything": True}, "everything", 400),
    (AbortRequest.from_json, {"abort_all": 1}, "abort_all", SCHEMA),
    (BeginWeightUpdateRequest.from_json, {"selector": "both"}, "selector", SCHEMA),
    (DestroyWeightsUpdateGroupRequest.from_json, {"group_name": None}, "group_name", SCHEMA),
])
def test_control_refusals(parse: Any, body: Any, field: str, status: int) -> None:
    error = refusal(parse, body)
    assert (error.field, error.status) == (field, status), error


UPDATE = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2], [3, 4]]}
INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}


@pytest.mark.parametrize(("change", "field", "status"), [
    ({"names": "a"}, "names", SCHEMA),
    ({"names": ["a", 7]}, "names[1]", 400),
    ({"names": ["a", ""]}, "names[1]", 400),
    ({"dtypes": ["float32", "bf16"]}, "dtypes[1]", 400),
    ({"shapes": [[2], [3, -4]]}, "shapes[1]", 400),
    ({"shapes": [[2], "3x4"]}, "shapes[1]", 400),
    ({"shapes": [[2]]}, "shapes", 400),
    ({"torch_empty_cache": "yes"}, "torch_empty_cache", SCHEMA),
])
def test_distributed_update_refusals(change: dict, field: str, status: int) -> None:
    error = refusal(UpdateWeightsFromDistributedRequest.from_json, UPDATE | change)
    assert (error.field, error.status) == (field, status), error


@pytest.mark.parametrize(("change", "field", "status"), [
    ({"master_port": "29500"}, "master_port", SCHEMA),
    ({"master_port": 0}, "master_port", 400),
    ({"master_address": ""}, "master_address", 400),
    ({"rank_offset": 2}, "rank_offset", 400),
    ({"backend": "mpi"}, "backend", 400),
])
def test_init_group_refusals(change: dict, field: str, status: int) -> None:
    error = refusal(InitWeightsUpdateGroupRequest.from_json, INIT | change)
    assert (error.field, error.status) == (field, status), error


def test_bodies_left_out_where_sglang_allows_it() -> None:
    assert parse_pause(None) == "abort" and parse_continue(None) is None and parse_end_weight_update(None) is None
    assert AbortRequest.from_json(None) == AbortRequest()
    assert BeginWeightUpdateRequest.from_json(None) == BeginWeightUpdateRequest()
    assert DestroyWeightsUpdateGroupRequest.from_json(None) == DestroyWeightsUpdateGroupRequest()


# ---------------------------------------------------------------------------------------------
# Round trips: from_json(to_json(x)) == x.

ints = st.integers(min_value=0, max_value=1 << 20)
names = st.text(min_size=1, max_size=8)
maybe_name = st.none() | names
sampling = st.builds(
    SamplingParams, max_new_tokens=st.none() | ints, temperature=st.floats(0, 5), top_p=st.floats(0.01, 1),
    top_k=st.just(-1) | st.integers(1, 100), stop_token_ids=st.lists(ints, max_size=3).map(tuple),
    sampling_seed=st.none() | ints, ignore_eos=st.booleans(), skip_special_tokens=st.booleans())


@given(sampling, st.lists(ints, min_size=1, max_size=5), st.booleans(), maybe_name, st.booleans())
def test_generate_request_round_trip(params: SamplingParams, ids: list[int], logprob: bool, rid: str | None,
                                     texts: bool) -> None:
    request = GenerateRequest(input_ids=ids, sampling_params=params, return_logprob=logprob, rid=rid,
                              return_text_in_logprobs=texts)
    assert GenerateRequest.from_json(request.to_json()) == request
    text_request = GenerateRequest(text="2+2=", sampling_params=params)
    assert GenerateRequest.from_json(text_request.to_json()) == text_request


def test_defaults_are_left_out_of_the_wire() -> None:
    assert GenerateRequest(input_ids=[1]).to_json() == {
        "input_ids": [1], "sampling_params": {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
        "return_logprob": True}
    assert AbortRequest(abort_all=True).to_json() == {"abort_all": True}
    assert "torch_empty_cache" not in UpdateWeightsFromDistributedRequest.from_json(UPDATE).to_json()


@given(st.builds(UpdateWeightsFromDiskRequest, model_path=names, weight_version=maybe_name, load_format=maybe_name,
                 abort_all_requests=st.booleans(), flush_cache=st.booleans())
       | st.builds(AbortRequest, rid=maybe_name, abort_all=st.booleans(), abort_message=maybe_name)
       | st.builds(UpdateWeightVersionRequest, new_version=names, abort_all_requests=st.booleans())
       | st.builds(InitWeightsUpdateGroupRequest, master_address=names, master_port=st.integers(1, 65535),
                   rank_offset=st.just(1), world_size=st.integers(2, 8), group_name=names,
                   backend=st.sampled_from(["gloo", "nccl"]))
       | st.builds(UpdateWeightsFromDistributedRequest, names=st.just(("a", "b")),
                   dtypes=st.just(("float32", "bool")), shapes=st.just(((), (2, 3))), group_name=names,
                   weight_version=maybe_name, load_format=maybe_name, selector=st.sampled_from(["target", "all"]))
       | st.builds(DestroyWeightsUpdateGroupRequest, group_name=names)
       | st.builds(BeginWeightUpdateRequest, selector=st.sampled_from(["target", "draft", "all"])))
def test_control_request_round_trip(request: Any) -> None:
    assert type(request).from_json(request.to_json()) == request


@pytest.mark.parametrize("answer", [
    UpdateWeightsResult(True, "ok", 2),
    ControlResult(False, "no"),
    ModelInfo(model_path="/m", weight_version="3", tokenizer_path="/m", model_type="qwen2", architectures=["X"]),
    FinishReason("stop", matched=2),
    FinishReason("length", length=8),
    FinishReason("abort", message="paused"),
    GenerateResult(rid="r", output_ids=[7, 2], output_logprobs=[-0.5, -0.25], finish_reason="stop",
                   weight_version="4", prompt_tokens=3, completion_tokens=2,
                   finish_detail=FinishReason("stop", matched=2), text="x",
                   weight_versions=[WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, 2)]),
])
def test_answers_round_trip(answer: Any) -> None:
    assert type(answer).from_json(answer.to_json()) == answer


def test_structs_are_frozen_and_strict_when_built_in_code() -> None:
    span = WeightVersionSpan("3", 0, 1)
    with pytest.raises(ValueError):
        span.start = 2  # type: ignore[misc]
    with pytest.raises(ValueError):
        WeightVersionSpan("3", True, 1)
    assert span.model_copy(update={"end": 4}) == WeightVersionSpan(version="3", start=0, end=4)


def test_an_engines_load_is_read_from_its_prometheus_text() -> None:
    from policyloop.engines.sglang_client import EngineLoad

    page = ("# TYPE sglang:num_queue_reqs gauge\n"
            'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2.0\n'
            'sglang:num_queue_reqs{model_name="m",tp_rank="1"} 1.0\n'
            "# TYPE sglang:token_usage gauge\n"
            'sglang:token_usage{model_name="m"} 0.25\n')
    assert EngineLoad.parse(page) == EngineLoad(queued_requests=3.0, kv_usage=0.25)
    assert EngineLoad.parse("<html>not metrics</html>") == EngineLoad()  # not Prometheus' text: nothing known


def test_a_batch_body_splits_into_requests_and_back() -> None:
    from policyloop.engines.protocol import generate_batch_json, is_generate_batch, split_generate_batch

    requests = [GenerateRequest(input_ids=[4 + i, 16], rid=f"r{i}", return_logprob=i % 2 == 0,
                                sampling_params=SamplingParams(max_new_tokens=2 + i, temperature=0.5))
                for i in range(3)]
    body = generate_batch_json(requests)
    assert body["input_ids"] == [[4, 16], [5, 16], [6, 16]] and body["rid"] == ["r0", "r1", "r2"]
    assert is_generate_batch(body) and not is_generate_batch(requests[0].to_json())
    assert not is_generate_batch({"input_ids": []}) and is_generate_batch({"text": ["a"]})
    assert split_generate_batch(body) == requests
    # One value for every prompt is shared by all of them.
    shared = split_generate_batch({"input_ids": [[4], [5]], "sampling_params": {"max_new_tokens": 3}})
    assert [r.sampling_params.max_new_tokens for r in shared] == [3, 3]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"text": []}, "text", "an empty batch"),
    ({"input_ids": [[4]] * 4097}, "input_ids", "at most 4096 prompts"),
    ({"input_ids": [[4], [5]], "return_logprob": [True]}, "return_logprob", "1 values for a batch of 2"),
    ({"input_ids": [[4], [5]], "rid": "x"}, "rid", "a list of rids"),
    ({"input_ids": [[4], [5]], "rid": ["x", "x"]}, "rid", "must differ"),
    ({"input_ids": [[4], [5]], "sampling_params": [{}, {"temperature": -1}]}, "sampling_params.temperature",
     "prompt 1"),
    ({"input_ids": [[4], [5]], "stream": True}, "stream", "a batch is answered whole"),
])
def test_a_batch_body_is_refused_naming_the_field_and_the_prompt(body: dict, field: str, words: str) -> None:
    from policyloop.engines.protocol import split_generate_batch

    with pytest.raises(RequestError) as caught:
        split_generate_batch(body)
    assert caught.value.field == field and words in caught.value.message


def test_requests_that_cannot_share_a_batch_body_are_refused() -> None:
    from policyloop.engines.protocol import generate_batch_json

    with pytest.raises(ValueError, match="an empty batch"):
        generate_batch_json([])
    texts = GenerateRequest(text="12+3=", return_text_in_logprobs=True)
    with pytest.raises(ValueError, match="return_text_in_logprobs differs"):
        generate_batch_json([texts, texts.model_copy(update={"return_text_in_logprobs": False})])
