"""The part of SGLang's native HTTP API that policyloop uses, as typed values.

Field names, types and defaults come from SGLang 0.5.23's own source
(`/work/shared/reference/sglang-0.5.23-api.json`: `GenerateReqInput`, `EmbeddingReqInput`, the sampling params,
`UpdateWeightFromDiskReqInput`, `PauseGenerationReqInput`, `ContinueGenerationReqInput`,
`AbortReq`, and for the colocated weight sync `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `DestroyWeightsUpdateGroupReqInput`,
`BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`, whose routes answer `{"success",
"message"}` with 200 or 400). Response shapes that the reference does not list follow SGLang's
behaviour:

/generate (one request, not streamed) answers

    {"text": str, "output_ids": [int, ...],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": int | str}
                                             | {"type": "length", "length": int}
                                             | {"type": "abort", "message": str},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "weight_version": str,
                   "weight_versions": [{"version": str, "start": int, "end": int}, ...],
                   "output_token_logprobs": [[logprob, token_id, text | null], ...],  # return_logprob
                   "e2e_latency": float}}

With `"stream": true` (one prompt) it answers server-sent events instead: a `data: <object>`
event with everything so far (the ids, text and meta_info above, `finish_reason` null until the
last) after each decode step, then `data: [DONE]` (SGLang's default, non-incremental streaming).

`weight_versions` are spans over output token indices (end exclusive, contiguous, the first
starts at 0, the last ends at completion_tokens; a request with no output has one empty span)
and `weight_version` is the version of the last span. An aborted request still answers 200 with
finish_reason abort and the tokens it had. /model_info (and the older /get_model_info) answers
`{"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
"weight_version", "has_image_understanding", "has_audio_understanding", "model_type",
"architectures"}`; /classify (a reward model: a sequence-classification model, is_generation
false) answers `{"embedding": [score, ...], "meta_info": {"id", "prompt_tokens", "e2e_latency"}}`
per prompt, a list of them for SGLang's batch form; /update_weights_from_disk answers `{"success", "message",
"num_paused_requests"}` with 200 on success and 400 on failure; errors of validation are 400
with SGLang's ErrorResponse body `{"object": "error", "message", "type", "param", "code"}`.

The same frozen pydantic models serve both ends: `SGLangClient` sends `to_json()` and reads
`from_json()`, the embedded engine validates requests with `from_json()` and writes responses
with `to_json()`. Requests are validated strictly (no bool for an int, no "3" for 3); what pydantic
finds goes through one mapping, `request_error`, to a `RequestError` naming the field with the
status SGLang answers (422 for a body that does not fit SGLang's struct, 400 for values SGLang
refuses). Answers are read with the same types, leaving out the keys policyloop does not use.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# The pause modes and the weight-update group are the colocated sender's terms: defined once there.
from policyloop.weights.broadcast.engine_control import BACKENDS as WEIGHT_GROUP_BACKENDS
from policyloop.weights.broadcast.engine_control import DEFAULT_GROUP_NAME as DEFAULT_WEIGHT_GROUP
from policyloop.weights.broadcast.engine_control import PAUSE_MODES as PAUSE_MODES
from policyloop.weights.broadcast.engine_control import PauseMode

FinishType = Literal["stop", "length", "abort"]

TOP_K_ALL = 1 << 30
"""SGLang's "no top-k truncation" value; -1 means the same."""


SCHEMA = 422  # FastAPI's answer to a body that does not fit SGLang's request struct


class RequestError(ValueError):
    """A request body that SGLang would reject: names the offending field. `status` is the kind
    of refusal SGLang gives: 422 when FastAPI's validation of the request struct fails (a wrong
    type, a missing required field, a value outside a Literal), 400 when SGLang itself refuses
    the values (its ValueError answer), and 400 too for what only the embedded engine refuses."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.status = status


def error_body(message: str, status: int = 400, field_name: str | None = None) -> dict[str, Any]:
    """SGLang's error answers: FastAPI's validation error for 422 (`detail`, with the field's
    location in the body), SGLang's `{"error": {"message": ...}}` otherwise."""
    if status == SCHEMA:
        loc = ["body", *re.split(r"[.\[\]]+", field_name.strip("]"))] if field_name and field_name != "body" else [
            "body"]
        return {"detail": [{"type": "value_error", "loc": loc, "msg": message, "input": None}]}
    return {"error": {"message": message}}


def error_message(body: Any) -> str | None:
    """The message of an error answer in any of SGLang's shapes (None when there is none)."""
    if not isinstance(body, Mapping):
        return None
    error = body.get("error")
    if isinstance(error, Mapping) and "message" in error:
        return str(error["message"])
    detail = body.get("detail")
    if isinstance(detail, list) and detail and isinstance(detail[0], Mapping):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg', '')}"
                         for d in detail)
    if "message" in body:
        return str(body["message"])
    return None


# ---------------------------------------------------------------------------------------------
# From pydantic's findings to SGLang's answer.

# Error types that are a value refused (SGLang's ValueError, 400) rather than a body that does
# not fit the struct (FastAPI's 422). "refused", "unsupported", "batch" are this module's own
# ("entries", a wrong entry reported for its list, is a wrong type); an unknown field is refused
# with 400 as the embedded engine always did.
_VALUE_REFUSALS = frozenset({
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "string_too_short",
    "extra_forbidden", "refused", "unsupported", "batch",
})
_OWN_MESSAGES = frozenset({"refused", "unsupported", "batch", "entries"})  # messages that say it all


def request_error(exc: ValidationError, location: tuple[str, ...] = ()) -> RequestError:
    """The one mapping of a failed validation to SGLang's refusal. Reports the first unknown field,
    else the first error, named in dotted form (`sampling_params.top_p`, `names[2]`; a check of
    the whole struct names its field in the error's context). 400 for a refused value, for
    anything inside sampling_params (SGLang checks that dict itself, with ValueError) and for an
    entry of a list; 422 for the rest: a wrong type, a missing field, a value outside a Literal."""
    error = min(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    ctx = error.get("ctx") or {}
    loc = [*location, *error["loc"], *([ctx["field"]] if "field" in ctx else [])]
    name = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "body"
    refused = (error["type"] in _VALUE_REFUSALS or name.startswith("sampling_params")
               or any(isinstance(part, int) for part in loc))
    if error["type"] in _OWN_MESSAGES:
        message = error["msg"]
    elif error["type"] == "missing":
        message = "required"
    elif error["type"] == "extra_forbidden":
        message = "unknown field (SGLang 0.5.23 has no field of this name here)"
    else:
        message = f"{error['msg']}, got {reprlib.repr(error['input'])}"
    return RequestError(name, message, 400 if refused else SCHEMA)


def _refused(message: str, field: str | None = None) -> PydanticCustomError:
    """A value SGLang refuses (400); `field` names it when a check of the whole struct finds it."""
    return PydanticCustomError("refused", message, {"field": field} if field else None)


# ---------------------------------------------------------------------------------------------
# Field types and checks shared by the structs.


def _default_unsent(default: Any) -> Any:
    """A field that to_json leaves out while it holds its default (SGLang's default is the same)."""
    return Field(default, exclude_if=lambda value: value == default)


def _null_as(default: Any) -> BeforeValidator:
    """SGLang reads JSON null as the default for these fields."""
    return BeforeValidator(lambda value: default if value is None else value)


def _one_of(choices: frozenset[str] | tuple[str, ...], what: str) -> AfterValidator:
    """A str that must be one of `choices` (SGLang refuses the others itself: 400, not a Literal's 422)."""
    def check(value: str) -> str:
        if value not in choices:
            raise _refused(f"{value!r} is not {what}")
        return value
    return AfterValidator(check)


def _entries_as_a_whole(what: str) -> WrapValidator:
    """A wrong entry is reported for the list, as SGLang names it (`input_ids`, not `input_ids[3]`)."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if all(not e["loc"] for e in exc.errors()):  # the list itself: its own error
                raise
            raise PydanticCustomError("entries", "expected {what}, got {got}",
                                      {"what": what, "got": reprlib.repr(value)}) from None
    return WrapValidator(validate)


def _not_a_batch(is_batch: Callable[[Any], bool]) -> BeforeValidator:
    """SGLang's batch form (a list of what one request gives): SGLang takes it, the embedded
    engine does not, and says so with 400."""
    def check(value: Any) -> Any:
        if is_batch(value):
            raise PydanticCustomError("batch", "expected one request's value (batches are not supported by the "
                                               "embedded engine)")
        return value
    return BeforeValidator(check)


_LIST_BATCH = _not_a_batch(lambda value: isinstance(value, list))
_PROMPTS_BATCH = _not_a_batch(lambda value: isinstance(value, list) and bool(value)
                              and all(isinstance(p, list) for p in value))


class _Struct(BaseModel):
    """A frozen struct of SGLang's API with strict types. Also built positionally, in field
    order, as the dataclasses these were (`WeightVersionSpan("3", 0, 2)`)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    @classmethod
    @functools.cache
    def field_names(cls) -> tuple[str, ...]:
        """The struct's fields in order, looked up once (every sample builds and reads several
        structs: pydantic's model_fields is a property call each time)."""
        return tuple(cls.model_fields)

    def __init__(self, /, *args: Any, **kwargs: Any) -> None:
        if not args:
            super().__init__(**kwargs)
            return
        names = type(self).field_names()
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        super().__init__(**dict(zip(names, args, strict=False)), **kwargs)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _Request(_Struct):
    """A struct SGLang reads from a request body; `from_json` validates a body as SGLang would.

    `unsupported`: SGLang's fields that the embedded engine does not implement, with the value
    that means "off" (None is always off): accepted off, refused otherwise. `ignored`: SGLang's
    fields accepted with any value and without effect here. Any other name is refused."""

    unsupported: ClassVar[Mapping[str, Any]] = {}
    ignored: ClassVar[frozenset[str]] = frozenset({"rid", "http_worker_ipc"})  # BaseReq's fields
    location: ClassVar[tuple[str, ...]] = ()  # where the struct sits in a request body
    body_optional: ClassVar[bool] = False  # JSON null (the engine's empty body) means {}

    @model_validator(mode="before")
    @classmethod
    def _fields_this_engine_serves(cls, body: Any) -> Any:
        if not isinstance(body, Mapping):
            return body  # pydantic refuses it
        fields, dropped = cls.field_names(), cls.ignored | set(cls.unsupported)
        for name, value in body.items():
            if name not in fields and name in cls.unsupported and value not in (None, cls.unsupported[name]):
                raise PydanticCustomError("unsupported", "not supported by the embedded engine (only {off})",
                                          {"field": name, "off": repr(cls.unsupported[name])})
        return {name: value for name, value in body.items() if name in fields or name not in dropped}

    @classmethod
    def from_json(cls, body: Any) -> Self:
        """The struct in `body`; RequestError (field, message, status) when SGLang would refuse it."""
        try:
            return cls.model_validate({} if body is None and cls.body_optional else body)
        except ValidationError as exc:
            raise request_error(exc, cls.location) from None


class _Answer(_Struct):
    """A struct SGLang answers with; `from_json` reads it (ValueError when it is not one)."""

    @classmethod
    def from_json(cls, body: Any) -> Self:
        if not isinstance(body, Mapping):
            raise ValueError(f"not a {cls.__name__} answer: {reprlib.repr(body)}")
        # SGLang answers with more than policyloop reads (cached_tokens, has_image_understanding, ...).
        fields = cls.field_names()
        return cls.model_validate({name: value for name, value in body.items() if name in fields})


# ---------------------------------------------------------------------------------------------
# Sampling parameters.

# SamplingParams.__init__ arguments of SGLang 0.5.23 that the embedded engine does not implement,
# with the value that means "off" (None also means off). The reference also lists attributes
# SamplingParams derives itself (stop_strs, stop_str_max_len, is_normalized, ...): not accepted.
_SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None,
    "watermark": None, "ebnf_full_assistant": False,
}


def _listed(value: Any) -> Any:
    """SGLang's `stop` is a string or a list of them."""
    return [value] if isinstance(value, str) else value


def _top_k(value: int) -> int:
    if value >= TOP_K_ALL:
        return -1  # one spelling of "no truncation"
    if value != -1 and value < 1:
        raise _refused(f"must be -1 or >= 1, got {value}")
    return value


class SamplingParams(_Request):
    """SGLang's `sampling_params`, the subset the rollout uses (SGLang's names and defaults).

    temperature 0 is greedy; top_k -1 (or 1<<30) and top_p 1.0 switch truncation off;
    `sampling_seed` makes sampling reproducible (same request, seed and weights → same tokens)."""

    unsupported = _SAMPLING_UNSUPPORTED
    # Accepted and without effect on the tokens (detokenisation / streaming details).
    ignored = frozenset({"spaces_between_special_tokens", "no_stop_trim", "stream_interval"})
    location = ("sampling_params",)
    body_optional = True

    max_new_tokens: Annotated[int, Field(ge=0)] | None = 128  # None: up to the model's context length (as SGLang)
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, AfterValidator(_top_k)] = -1
    stop_token_ids: Annotated[tuple[int, ...], Strict(False), _entries_as_a_whole("a list of integers"),
                              _null_as(())] = _default_unsent(())
    # Stop strings: the request ends once its decoded output contains one (`finish_reason.matched`
    # is the string); the text is cut before it, the ids keep every token drawn.
    stop: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Strict(False), BeforeValidator(_listed),
                    _null_as(())] = _default_unsent(())
    sampling_seed: int | None = _default_unsent(None)
    ignore_eos: bool = _default_unsent(False)
    skip_special_tokens: bool = _default_unsent(True)


# ---------------------------------------------------------------------------------------------
# /generate request.

# GenerateReqInput fields (SGLang 0.5.23) that the embedded engine does not implement, with their
# "off" value. None is always "off".
_GENERATE_UNSUPPORTED: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None,
    "watermark": None, "top_logprobs_num": 0, "token_ids_logprob": None, "return_sampling_mask": False,
    "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "require_reasoning": False, "max_thinking_tokens": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "need_wait_for_mm_inputs": None,
    "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "mm_processor_kwargs": None, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "kv_hints": None, "background": False,
}


class GenerateRequest(_Request):
    """One /generate request: a token prompt (or `text`), sampling params, and whether to return
    the logprob of every output token. `rid` names the request (for /abort_request)."""

    unsupported = _GENERATE_UNSUPPORTED
    # Accepted with any value: routing, logging and tracing hints that do not change the tokens.
    ignored = frozenset({"log_metrics", "no_logs", "custom_labels", "priority", "routing_key", "conversation_id",
                         "extra_key", "cache_salt", "received_time", "external_trace_header", "routed_dp_rank",
                         "data_parallel_rank", "disagg_prefill_dp_rank", "http_worker_ipc"})

    input_ids: Annotated[list[int], Field(min_length=1), _entries_as_a_whole("one prompt as a list of integers"),
                         _PROMPTS_BATCH] | None = _default_unsent(None)
    sampling_params: Annotated[SamplingParams, _LIST_BATCH, _null_as({})] = Field(default_factory=SamplingParams)
    return_logprob: Annotated[bool, _null_as(False)] = True
    rid: Annotated[str, Field(min_length=1), _LIST_BATCH] | None = _default_unsent(None)
    text: Annotated[str, _LIST_BATCH] | None = _default_unsent(None)
    return_text_in_logprobs: bool = _default_unsent(False)
    # The LoRA adapter to sample with, by the name /load_lora_adapter gave it (None: the base).
    lora_path: Annotated[str, Field(min_length=1), _LIST_BATCH] | None = _default_unsent(None)
    # From which prompt position input_token_logprobs are returned (with return_logprob); -1: none.
    logprob_start_len: Annotated[int, Field(ge=-1), _LIST_BATCH] = _default_unsent(-1)
    # Server-sent events: a chunk with everything so far (ids, text, meta_info) after each step,
    # finish_reason null until the last, then `data: [DONE]` (SGLang's default, non-incremental form).
    stream: bool = _default_unsent(False)

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        if (self.input_ids is None) == (self.text is None):
            raise _refused("give exactly one of input_ids and text", "input_ids")
        return self

    @classmethod
    def from_json(cls, body: Any) -> Self:
        # SGLang's default is no logprobs; a request built in code asks for them unless told not to.
        return super().from_json({"return_logprob": False, **body} if isinstance(body, Mapping) else body)


# SGLang's batch form of /generate: a list of prompts, and beside it, for these fields, either
# one value for every prompt or a list of one value per prompt (rid only as a list).
BATCH_ITEM_FIELDS: tuple[str, ...] = ("rid", "sampling_params", "return_logprob", "logprob_start_len",
                                      "top_logprobs_num", "lora_path", "lora_id", "custom_logit_processor")
MAX_BATCH_PROMPTS = 4096


def is_generate_batch(body: Any) -> bool:
    """Whether a /generate body is SGLang's batch form (prompts as a list of lists, or texts as a list)."""
    if not isinstance(body, Mapping):
        return False
    ids, text = body.get("input_ids"), body.get("text")
    return (isinstance(ids, list) and bool(ids) and all(isinstance(p, list) for p in ids)) or isinstance(text, list)


def split_generate_batch(body: Mapping[str, Any]) -> list[GenerateRequest]:
    """The requests of a batch body, in order, each validated as a request of its own; RequestError
    naming the field (and the prompt's index) when SGLang would refuse the batch."""
    prompts_field = "input_ids" if isinstance(body.get("input_ids"), list) else "text"
    prompts = body[prompts_field]
    if not prompts:
        raise RequestError(prompts_field, "an empty batch")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise RequestError(prompts_field, f"at most {MAX_BATCH_PROMPTS} prompts in one batch, got {len(prompts)}")
    if isinstance(body.get("rid"), str):
        raise RequestError("rid", "a batch needs a list of rids, one per prompt")
    if body.get("stream"):
        raise RequestError("stream", "a batch is answered whole: stream one prompt per request")
    shared = {name: value for name, value in body.items() if name != prompts_field and name not in BATCH_ITEM_FIELDS}
    per_item: dict[str, list[Any]] = {}
    for name in BATCH_ITEM_FIELDS:
        value = body.get(name)
        if isinstance(value, list):
            if len(value) != len(prompts):
                raise RequestError(name, f"{len(value)} values for a batch of {len(prompts)} prompts")
            per_item[name] = value
        elif name in body:
            shared[name] = value
    requests = []
    for i, prompt in enumerate(prompts):
        item = {**shared, prompts_field: prompt, **{name: values[i] for name, values in per_item.items()}}
        try:
            requests.append(GenerateRequest.from_json(item))
        except RequestError as exc:
            raise RequestError(exc.field, f"prompt {i}: {exc.message}", exc.status) from None
    rids = [r.rid for r in requests if r.rid is not None]
    if len(set(rids)) != len(rids):
        raise RequestError("rid", "the rids of a batch must differ")
    return requests


def generate_batch_json(requests: Sequence[GenerateRequest]) -> dict[str, Any]:
    """The batch body of several requests: prompts and the per-prompt fields as lists; every other
    field must be the same in all of them."""
    if not requests:
        raise ValueError("an empty batch")
    bodies = [r.to_json() for r in requests]
    prompts_field = "input_ids" if "input_ids" in bodies[0] else "text"
    batch: dict[str, Any] = {prompts_field: [b.get(prompts_field) for b in bodies]}
    for name in sorted(set().union(*bodies) - {prompts_field}):
        values = [b.get(name) for b in bodies]
        if name in BATCH_ITEM_FIELDS:
            batch[name] = values
        elif any(v != values[0] for v in values):
            raise ValueError(f"{name} differs between the requests of a batch")
        else:
            batch[name] = values[0]
    return batch


# ---------------------------------------------------------------------------------------------
# /classify: a reward model's scores (SGLang serves a sequence-classification model launched with
# --is-embedding there; its body is EmbeddingReqInput).

# EmbeddingReqInput fields (SGLang 0.5.23) that the embedded engine does not implement, with their
# "off" value. None is always "off".
_CLASSIFY_UNSUPPORTED: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "embed_override_token_id": None, "embed_overrides": None, "modalities": None, "is_cross_encoder_request": False,
    "lora_path": None, "lora_id": None, "positional_embed_overrides": None, "dimensions": None,
    "return_pooled_hidden_states": False, "return_prompt_token_ids": False, "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None, "decision_layout": None, "background": False,
}
MAX_CLASSIFY_ITEMS = 1024



def _is_token_prompt(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _one_or_a_batch(is_prompt: Callable[[Any], bool], what: str) -> BeforeValidator:
    """One prompt, or SGLang's batch form (a list of them): a wrong one is named by its index."""
    def check(value: Any) -> Any:
        if value is None or is_prompt(value):
            return value
        if not isinstance(value, list) or (value and not isinstance(value[0], str | list)):
            raise PydanticCustomError("entries", "expected {what} or a list of them, got {got}",
                                      {"what": what, "got": reprlib.repr(value)})
        if not value:
            raise _refused("an empty batch")
        if len(value) > MAX_CLASSIFY_ITEMS:
            raise _refused(f"at most {MAX_CLASSIFY_ITEMS} prompts in one batch, got {len(value)}")
        wrong = next((i for i, v in enumerate(value) if not is_prompt(v)), None)
        if wrong is not None:
            raise PydanticCustomError("entries", "prompt {index}: expected {what}, got {got}",
                                      {"index": wrong, "what": what, "got": reprlib.repr(value[wrong])})
        return value
    return BeforeValidator(check)


_Texts = Annotated[str | list[str], _one_or_a_batch(lambda v: isinstance(v, str), "a string")]
_TokenPrompts = Annotated[list[int] | list[list[int]],
                          _one_or_a_batch(_is_token_prompt, "a prompt as a non-empty list of integers")]


class ClassifyRequest(_Request):
    """One /classify request: a text or a token prompt, or SGLang's batch form (a list of either,
    with `rid` a list of one per prompt). Each prompt is answered with the model's scores."""

    unsupported = _CLASSIFY_UNSUPPORTED
    # Accepted with any value: embedding models take no sampling; routing and logging hints.
    ignored = frozenset({"http_worker_ipc", "sampling_params", "log_metrics", "routing_key", "priority",
                         "external_trace_header", "received_time"})

    text: _Texts | None = _default_unsent(None)
    input_ids: _TokenPrompts | None = _default_unsent(None)
    rid: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = \
        _default_unsent(None)

    @model_validator(mode="after")
    def _prompts_and_rids(self) -> Self:
        if (self.input_ids is None) == (self.text is None):
            raise _refused("give exactly one of input_ids and text", "input_ids")
        if self.is_batch != isinstance(self.rid, list) and self.rid is not None:
            raise _refused("a batch takes a list of rids, one per prompt; one prompt takes one rid", "rid")
        if isinstance(self.rid, list) and len(self.rid) != len(self.prompts):
            raise _refused(f"{len(self.rid)} rids for {len(self.prompts)} prompts", "rid")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise _refused("the rids of a batch must differ", "rid")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts in order (one request: a list of one)."""
        given = self.text if self.text is not None else self.input_ids
        return list(given) if self.is_batch else [given]  # type: ignore[list-item]

    @property
    def rids(self) -> list[str | None]:
        if isinstance(self.rid, list):
            return list(self.rid)
        return [self.rid] + [None] * (len(self.prompts) - 1)


class ClassifyResult(_Answer):
    """A /classify answer for one prompt: the model's scores (`embedding`, one per label: a reward
    model's is one value), the prompt's length and the request's id."""

    embedding: list[float]
    rid: str | None = None
    prompt_tokens: int = 0

    @property
    def score(self) -> float:
        """A reward model's score: its one label's value."""
        if len(self.embedding) != 1:
            raise ValueError(f"a reward model answers one score, this one {len(self.embedding)}")
        return self.embedding[0]

    def to_json(self, e2e_latency: float | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": self.rid, "prompt_tokens": self.prompt_tokens}
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        return {"embedding": list(self.embedding), "meta_info": meta}

    @classmethod
    def from_json(cls, body: Any) -> Self:
        if not isinstance(body, Mapping) or not isinstance(body.get("meta_info"), Mapping):
            raise ValueError("not a /classify answer: no meta_info")
        meta = body["meta_info"]
        return super().from_json({"embedding": body.get("embedding"), "rid": meta.get("id"),
                                  "prompt_tokens": meta.get("prompt_tokens", 0)})


# ---------------------------------------------------------------------------------------------
# /generate response.


class FinishReason(_Answer):
    """SGLang's finish_reason: stop (a stop token or EOS, `matched`), length (max_new_tokens
    reached, `length`) or abort (`message`)."""

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message or ""}


class WeightVersionSpan(_Answer):
    """Output tokens [start, end) were generated by weights `version`."""

    version: str
    start: int
    end: int


class GenerateResult(_Answer):
    """What /generate gave back for one request.

    `output_ids` are the generated tokens, a matched stop token or EOS included (it is part of
    what the policy chose); `output_logprobs[i]` is the log-probability of `output_ids[i]` (None
    when not requested). `weight_versions` are the spans of versions over output tokens (None
    when the server does not report them)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishType
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    finish_detail: FinishReason | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    text: str | None = None
    # The log-probability of each prompt token (None where not computed: always the first, and
    # those before logprob_start_len); None when prompt logprobs were not asked for.
    input_logprobs: list[float | None] | None = None
    cached_tokens: int = 0  # prompt tokens whose computation was shared with another request's

    def to_json(self, token_texts: list[str | None] | None = None, e2e_latency: float | None = None,
                prompt_ids: Sequence[int] = ()) -> dict[str, Any]:
        finish = self.finish_detail or FinishReason(self.finish_reason)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish.to_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
        }
        if self.weight_versions is not None:
            meta["weight_versions"] = [span.to_json() for span in self.weight_versions]
        if self.output_logprobs is not None:
            texts = token_texts or [None] * len(self.output_ids)
            meta["output_token_logprobs"] = [[lp, tok, txt] for lp, tok, txt in
                                             zip(self.output_logprobs, self.output_ids, texts, strict=True)]
        if self.input_logprobs is not None:
            # From logprob_start_len on; SGLang's first entry carries no logprob.
            start = next((i for i, lp in enumerate(self.input_logprobs) if lp is not None), len(prompt_ids))
            start = max(0, start - 1)
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                            zip(self.input_logprobs[start:], prompt_ids[start:], strict=True)]
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        return {"text": self.text or "", "output_ids": list(self.output_ids), "meta_info": meta}

    @classmethod
    def from_json(cls, body: Any) -> Self:
        """Reads a /generate answer (raises ValueError when it is not one). With logprobs the
        token ids are taken from `output_token_logprobs`, which carries one entry per generated
        token; `output_ids` must agree with them (it may lack a trailing stop token)."""
        if isinstance(body, list):
            if len(body) != 1:
                raise ValueError(f"expected one result, got {len(body)}")
            body = body[0]
        if not isinstance(body, Mapping) or not isinstance(body.get("meta_info"), Mapping):
            raise ValueError("not a /generate answer: no meta_info")
        meta = body["meta_info"]
        output_ids = body.get("output_ids")
        if not isinstance(output_ids, list):
            raise ValueError("output_ids missing")
        finish = FinishReason.from_json(meta.get("finish_reason"))
        logprobs = None
        triples = meta.get("output_token_logprobs")
        if triples is not None:  # [logprob, token_id, text | null] per output token
            tokens, logprobs = [t[1] for t in triples], [t[0] for t in triples]
            if output_ids != tokens and output_ids != tokens[:-1]:
                raise ValueError("output_ids and output_token_logprobs disagree")
            output_ids = tokens
        input_logprobs = None
        prompt_triples = meta.get("input_token_logprobs")
        if prompt_triples:  # [logprob | null, token_id, text | null] per prompt token from logprob_start_len
            skipped = max(0, meta.get("prompt_tokens", len(prompt_triples)) - len(prompt_triples))
            input_logprobs = [None] * skipped + [t[0] for t in prompt_triples]
        return super().from_json({
            "input_logprobs": input_logprobs,
            "rid": meta.get("id", ""), "output_ids": output_ids, "output_logprobs": logprobs,
            "finish_reason": finish.type, "finish_detail": finish, "weight_version": meta.get("weight_version", ""),
            "prompt_tokens": meta.get("prompt_tokens", 0),
            "completion_tokens": meta.get("completion_tokens", len(output_ids)),
            "weight_versions": meta.get("weight_versions"), "text": body.get("text"),
            "cached_tokens": meta.get("cached_tokens", 0),
        })


# ---------------------------------------------------------------------------------------------
# /model_info.


class ModelInfo(_Answer):
    model_path: str
    weight_version: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    model_type: str | None = None
    architectures: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "has_image_understanding": False, "has_audio_understanding": False}

    @classmethod
    def from_json(cls, body: Any) -> Self:
        if isinstance(body, Mapping) and body.get("weight_version") is None:  # null until something sets one
            body = {**body, "weight_version": ""}
        return super().from_json(body)


# ---------------------------------------------------------------------------------------------
# Control requests.

# What SGLang reports as weight_version until something sets one (ServerArgs.weight_version).
DEFAULT_WEIGHT_VERSION = "default"


class UpdateWeightsFromDiskRequest(_Request):
    """UpdateWeightFromDiskReqInput: load the weights in `model_path` in place; `weight_version`
    (when given) becomes the server's version once they are loaded."""

    unsupported = {"is_async": False, "keep_pause": False, "token_step": 0, "manifest": None}
    ignored = _Request.ignored | {"torch_empty_cache", "recapture_cuda_graph"}  # GPU only: no-ops

    model_path: str
    weight_version: str | None = _default_unsent(None)
    load_format: str | None = _default_unsent(None)
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsResult(_Answer):
    success: bool
    message: str
    num_paused_requests: int = 0

    @classmethod
    def from_json(cls, body: Any) -> Self:
        return super().from_json({"message": "", **body} if isinstance(body, Mapping) else body)


class _PauseGeneration(_Request):
    body_optional = True

    mode: PauseMode = "abort"


def parse_pause(body: Any) -> str:
    """PauseGenerationReqInput → its mode."""
    return _PauseGeneration.from_json(body).mode


class _ContinueGeneration(_Request):
    body_optional = True

    torch_empty_cache: bool = True  # a GPU detail: checked, without effect


def parse_continue(body: Any) -> None:
    """ContinueGenerationReqInput (torch_empty_cache is a GPU detail: accepted, no effect)."""
    _ContinueGeneration.from_json(body)


class AbortRequest(_Request):
    """AbortReq: abort request `rid`, or every request with `abort_all`."""

    unsupported = {"finished_reason": None, "weight_versions": None}
    body_optional = True

    rid: Annotated[str | None, AfterValidator(lambda rid: rid or None)] = _default_unsent(None)  # "": none
    abort_all: bool = False
    abort_message: str | None = _default_unsent(None)


class UpdateWeightVersionRequest(_Request):
    """UpdateWeightVersionReqInput: relabel the served weights as `new_version` (no weights move).
    SGLang starts at version "default"; the rollout names it "0", the base policy's version."""

    new_version: str
    abort_all_requests: bool = True


# ---------------------------------------------------------------------------------------------
# The colocated weight-sync routes (torch.distributed broadcast driven over HTTP).

# Names SGLang's receiver resolves with getattr(torch, name) to a dtype (torch's own spelling).
TORCH_DTYPE_NAMES: frozenset[str] = frozenset({
    "float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "bool",
})
WeightSelector = Literal["target", "draft", "all"]

_NonEmpty = Annotated[str, Field(min_length=1)]
# JSON lists are read as tuples (Strict(False) on the container only: its entries stay strict).
_Names = Annotated[tuple[_NonEmpty, ...], Strict(False), Field(min_length=1)]
_DtypeNames = Annotated[tuple[Annotated[str, _one_of(TORCH_DTYPE_NAMES, "a torch dtype name (e.g. 'bfloat16')")],
                              ...], Strict(False)]
_Shape = Annotated[tuple[Annotated[int, Field(ge=0)], ...], Strict(False),
                   _entries_as_a_whole("a list of non-negative integers")]
_Shapes = Annotated[tuple[_Shape, ...], Strict(False)]


class InitWeightsUpdateGroupRequest(_Request):
    """InitWeightsUpdateGroupReqInput: join the process group whose store rank 0 (the learner)
    hosts at master_address:master_port, as ranks rank_offset + tp_rank of world_size."""

    master_address: _NonEmpty
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=1)]  # rank 0 is the sender
    world_size: Annotated[int, Field(ge=2)]
    group_name: _NonEmpty = DEFAULT_WEIGHT_GROUP
    backend: Annotated[str, _one_of(WEIGHT_GROUP_BACKENDS, "one of gloo, nccl")] = "nccl"

    @model_validator(mode="after")
    def _a_receiving_rank(self) -> Self:
        if self.rank_offset >= self.world_size:
            raise _refused(f"must be < world_size ({self.world_size}), got {self.rank_offset}", "rank_offset")
        return self


class UpdateWeightsFromDistributedRequest(_Request):
    """UpdateWeightsFromDistributedReqInput: receive the tensors `names` (with `dtypes`, torch's
    names, and `shapes`) broadcast from rank 0 of `group_name` and load them; with
    load_format "flattened_bucket" they come as one uint8 buffer (see policyloop.weights.broadcast.layout),
    otherwise one broadcast per tensor in order. `weight_version` (when given) becomes the
    engine's version once they are loaded."""

    names: _Names
    dtypes: _DtypeNames
    shapes: _Shapes
    group_name: str = DEFAULT_WEIGHT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = _default_unsent(None)
    load_format: str | None = _default_unsent(None)
    selector: WeightSelector = _default_unsent("all")
    torch_empty_cache: bool = Field(False, exclude=True)  # a GPU detail: checked, without effect, not sent

    @model_validator(mode="after")
    def _one_entry_per_name(self) -> Self:
        for field_name, values in (("dtypes", self.dtypes), ("shapes", self.shapes)):
            if len(values) != len(self.names):
                raise _refused(f"expected {len(self.names)} entries (one per name), got {len(values)}", field_name)
        return self


class DestroyWeightsUpdateGroupRequest(_Request):
    """DestroyWeightsUpdateGroupReqInput: leave and release the group `group_name`."""

    body_optional = True

    group_name: str = DEFAULT_WEIGHT_GROUP


class BeginWeightUpdateRequest(_Request):
    """BeginWeightUpdateReqInput: open a weight-update session. SGLang 0.5.23 refuses
    update_weights_from_distributed outside one (without joining the broadcast)."""

    body_optional = True

    selector: WeightSelector = "all"


class _EndWeightUpdate(_Request):
    body_optional = True


def parse_end_weight_update(body: Any) -> None:
    """EndWeightUpdateReqInput: close the session (it has no fields of its own)."""
    _EndWeightUpdate.from_json(body)


class LoadLoraAdapterRequest(_Request):
    """LoadLoRAAdapterReqInput: load the adapter in the peft directory `lora_path` (its
    adapter_config.json and adapter weights) under `lora_name`, which /generate's lora_path names."""

    unsupported = {"lora_id": None}
    ignored = _Request.ignored | {"pinned"}  # nothing is ever evicted here

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


def _from_base64(value: Any) -> Any:
    if not isinstance(value, str):
        return value  # pydantic refuses it
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise _refused(f"not base64: {exc}") from None


# bytes sent as standard base64 text, as SGLang's Base64Bytes.
Base64Bytes = Annotated[bytes, BeforeValidator(_from_base64), Strict(),
                        PlainSerializer(lambda raw: base64.b64encode(raw).decode("ascii"), return_type=str)]


# The embedded engine's load_format for /load_lora_adapter_from_tensors and
# /update_weights_from_tensor: each entry of serialized_named_tensors is a safetensors file of the
# tensors (an adapter's named as peft saves them, the model's as its parameters). SGLang's own
# formats (null, "flattened_bucket") are pickles (MultiprocessingSerializer), made for processes
# that trust each other; an HTTP body is never unpickled here.
SAFETENSORS_FORMAT = "safetensors"


class _SentTensors(_Request):
    """A request carrying tensors: `serialized_named_tensors`, one serialized copy per TP rank
    (base64 on the wire; the embedded engine has one rank), each a safetensors file."""

    serialized_named_tensors: Annotated[list[Base64Bytes], Field(min_length=1)]
    load_format: str | None = _default_unsent(None)

    @model_validator(mode="after")
    def _safetensors_only(self) -> Self:
        if self.load_format != SAFETENSORS_FORMAT:
            raise _refused(f"the embedded engine takes only {SAFETENSORS_FORMAT!r}, the tensors of each copy as one "
                           f"safetensors file, got {self.load_format!r} (SGLang's null and 'flattened_bucket' are "
                           f"pickles, which an HTTP body must never be)", "load_format")
        return self


class LoadLoraAdapterFromTensorsRequest(_SentTensors):
    """LoadLoRAAdapterFromTensorsReqInput: load an adapter sent in the body under `lora_name`:
    `config_dict` is its adapter_config.json, `serialized_named_tensors` one serialized copy of
    its tensors per TP rank (base64 on the wire; the embedded engine has one rank), and
    `expected_checksums` (name -> sha256 of a tensor's raw bytes) is checked when given."""

    unsupported = {"lora_id": None, "added_tokens_config": None}
    ignored = _Request.ignored | {"pinned"}  # nothing is ever evicted here

    lora_name: Annotated[str, Field(min_length=1)]
    config_dict: dict[str, Any]
    expected_checksums: dict[str, str] | None = _default_unsent(None)


class UpdateWeightsFromTensorRequest(_SentTensors):
    """UpdateWeightsFromTensorReqInput: load the tensors sent in the body in place (any of the
    model's parameters, by name); `weight_version` (when given) becomes the engine's version once
    they are loaded."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = _default_unsent(None)
    selector: WeightSelector = _default_unsent("all")
    torch_empty_cache: bool = Field(False, exclude=True)  # a GPU detail: checked, without effect, not sent


class UnloadLoraAdapterRequest(_Request):
    """UnloadLoRAAdapterReqInput: free the adapter loaded under `lora_name`."""

    unsupported = {"lora_id": None}

    lora_name: Annotated[str, Field(min_length=1)]


class LoraUpdateResult(_Answer):
    """SGLang's answer to loading or unloading an adapter: whether it worked, why not, and the
    adapters loaded now (name -> path)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> Self:
        if isinstance(body, Mapping) and body.get("loaded_adapters") is None:
            body = {**body, "loaded_adapters": {}}
        return super().from_json(body)


class ControlResult(_Answer):
    """The `{"success", "message"}` answer of the weight-sync routes (200 on success, 400 not)."""

    success: bool
    message: str

    @classmethod
    def from_json(cls, body: Any) -> Self:
        return super().from_json({"message": "", **body} if isinstance(body, Mapping) else body)


# ---------------------------------------------------------------------------------------------
# The embedded engine's own routes for a version staged beside the served one and activated by a
# swap (SGLang 0.5.23 has no such routes: with SGLang a version goes pause → update → continue).


class StageWeightsFromDiskRequest(_Request):
    """Stage the weights in `model_path` beside the served ones as version `weight_version`,
    while generation goes on; /activate_staged_weights makes them the served weights."""

    model_path: Annotated[str, Field(min_length=1)]
    weight_version: Annotated[str, Field(min_length=1)]


class StageWeightsFromTensorRequest(_SentTensors):
    """Stage the tensors sent in the body (any of the model's parameters, by name) as version
    `weight_version`, as /stage_weights_from_disk stages a directory's."""

    weight_version: Annotated[str, Field(min_length=1)]


class StageWeightsResult(_Answer):
    """What was staged: its version, how many tensors and bytes, and the seconds staging took
    (decode, check and place; generation went on meanwhile)."""

    success: bool
    message: str = ""
    weight_version: str | None = None
    tensors: int = 0
    bytes: int = 0
    prepare_s: float = 0.0


class ActivateStagedWeightsRequest(_Request):
    """Make the staged version `weight_version` the served one, at the next boundary between two
    decode steps. Naming the version guards against activating another replica's stage."""

    weight_version: Annotated[str, Field(min_length=1)]


class ActivateStagedWeightsResult(_Answer):
    """The activation: its version, and `pause_s`, how long decoding stood still for the swap."""

    success: bool
    message: str = ""
    weight_version: str | None = None
    pause_s: float = 0.0
