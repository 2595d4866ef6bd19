"""The part of SGLang's native HTTP API that policyloop uses, as typed values.

Field names, types and defaults come from SGLang 0.5.23's own source
(`/work/shared/reference/sglang-0.5.23-api.json`: `GenerateReqInput`, the sampling params,
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

`weight_versions` are spans over output token indices (end exclusive, contiguous, the first
starts at 0, the last ends at completion_tokens; a request with no output has one empty span)
and `weight_version` is the version of the last span. An aborted request still answers 200 with
finish_reason abort and the tokens it had. /model_info (and the older /get_model_info) answers
`{"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
"weight_version", "has_image_understanding", "has_audio_understanding", "model_type",
"architectures"}`; /update_weights_from_disk answers `{"success", "message",
"num_paused_requests"}` with 200 on success and 400 on failure; errors of validation are 400
with SGLang's ErrorResponse body `{"object": "error", "message", "type", "param", "code"}`.

The same dataclasses serve both ends: `SGLangClient` sends `to_json()` and reads `from_json()`,
the embedded engine validates requests with `from_json()` (unknown or wrongly typed fields raise
`RequestError` naming the field, which the engine answers with 400) and writes responses with
`to_json()`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FinishType = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

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
# Field checks shared by every request struct.

_MISSING = object()


def _check_object(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError(what, f"expected a JSON object, got {type(body).__name__}", _kind(what))
    return body


def _kind(field_name: str) -> int:
    """A wrong type is FastAPI's 422, except inside sampling_params: SGLang checks that dict itself."""
    return 400 if field_name.startswith("sampling_params") else SCHEMA


def _int(body: Mapping[str, Any], name: str, default: Any, *, prefix: str = "", minimum: int | None = None,
         optional: bool = False) -> Any:
    value = body.get(name, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(prefix + name, f"expected an integer, got {value!r}", _kind(prefix + name))
    if minimum is not None and value < minimum:
        raise RequestError(prefix + name, f"must be >= {minimum}, got {value}")
    return value


def _float(body: Mapping[str, Any], name: str, default: float, *, prefix: str = "") -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(prefix + name, f"expected a number, got {value!r}", _kind(prefix + name))
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool | None, *, prefix: str = "",
          optional: bool = False) -> Any:
    value = body.get(name, default)
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise RequestError(prefix + name, f"expected true or false, got {value!r}", _kind(prefix + name))
    return value


def _str(body: Mapping[str, Any], name: str, default: Any, *, prefix: str = "", optional: bool = False) -> Any:
    value = body.get(name, default)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise RequestError(prefix + name, f"expected a string, got {value!r}", _kind(prefix + name))
    return value


def _check_fields(body: Mapping[str, Any], supported: set[str], known_defaults: Mapping[str, Any],
                  ignored: set[str], *, prefix: str = "", struct: str) -> None:
    """Rejects names SGLang does not have, and SGLang features this server does not implement
    unless they carry their default value (so a request SGLang accepts means the same here)."""
    for name, value in body.items():
        if name in supported or name in ignored:
            continue
        if name in known_defaults:
            default = known_defaults[name]
            if value is None or value == default:
                continue
            raise RequestError(prefix + name, f"not supported by the embedded engine (only {default!r})")
        raise RequestError(prefix + name, f"unknown field of {struct}")


# ---------------------------------------------------------------------------------------------
# Sampling parameters.

# SamplingParams.__init__ arguments of SGLang 0.5.23 that the embedded engine does not implement,
# with the value that means "off" (None also means off). The reference also lists attributes
# SamplingParams derives itself (stop_strs, stop_str_max_len, is_normalized, ...): not accepted.
_SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "stop": None, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None, "custom_params": None,
    "watermark": None, "ebnf_full_assistant": False,
}
# Accepted and without effect on the tokens (detokenisation / streaming details).
_SAMPLING_IGNORED = {"spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
_SAMPLING_SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                       "ignore_eos", "skip_special_tokens"}


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's `sampling_params`, the subset the rollout uses (SGLang's names and defaults).

    temperature 0 is greedy; top_k -1 (or 1<<30) and top_p 1.0 switch truncation off;
    `sampling_seed` makes sampling reproducible (same request, seed and weights → same tokens)."""

    max_new_tokens: int | None = 128  # None: up to the model's context length (as SGLang)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                               "top_p": self.top_p, "top_k": self.top_k}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        return out

    @classmethod
    def from_json(cls, body: Any, prefix: str = "sampling_params.") -> SamplingParams:
        if body is None:
            return cls()
        body = _check_object(body, prefix.rstrip("."))
        _check_fields(body, _SAMPLING_SUPPORTED, _SAMPLING_UNSUPPORTED, _SAMPLING_IGNORED, prefix=prefix,
                      struct="SamplingParams")
        max_new_tokens = _int(body, "max_new_tokens", 128, prefix=prefix, minimum=0, optional=True)
        temperature = _float(body, "temperature", 1.0, prefix=prefix)
        top_p = _float(body, "top_p", 1.0, prefix=prefix)
        top_k = _int(body, "top_k", -1, prefix=prefix)
        if temperature < 0:
            raise RequestError(prefix + "temperature", f"must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise RequestError(prefix + "top_p", f"must be in (0, 1], got {top_p}")
        if top_k != -1 and top_k < 1:
            raise RequestError(prefix + "top_k", f"must be -1 or >= 1, got {top_k}")
        stop = body.get("stop_token_ids")
        if stop is None:
            stop_ids: tuple[int, ...] = ()
        elif isinstance(stop, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            stop_ids = tuple(stop)
        else:
            raise RequestError(prefix + "stop_token_ids", f"expected a list of integers, got {stop!r}")
        return cls(
            max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=-1 if top_k >= TOP_K_ALL else top_k,
            stop_token_ids=stop_ids,
            sampling_seed=_int(body, "sampling_seed", None, prefix=prefix, optional=True),
            ignore_eos=_bool(body, "ignore_eos", False, prefix=prefix),
            skip_special_tokens=_bool(body, "skip_special_tokens", True, prefix=prefix),
        )


# ---------------------------------------------------------------------------------------------
# /generate request.

# GenerateReqInput fields (SGLang 0.5.23) that the embedded engine does not implement, with their
# "off" value. None is always "off".
_GENERATE_UNSUPPORTED: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None,
    "watermark": None, "top_logprobs_num": 0, "token_ids_logprob": None, "return_sampling_mask": False,
    "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "stream": False,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None, "lora_path": None,
    "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "require_reasoning": False, "max_thinking_tokens": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "need_wait_for_mm_inputs": None,
    "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "mm_processor_kwargs": None, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "kv_hints": None, "background": False,
    # -1 (SGLang's default meaning) asks for no prompt logprobs; prompt logprobs are not implemented.
    "logprob_start_len": -1,
}
# Accepted with any value: routing, logging and tracing hints that do not change the tokens.
_GENERATE_IGNORED = {"log_metrics", "no_logs", "custom_labels", "priority", "routing_key", "conversation_id",
                     "extra_key", "cache_salt", "received_time", "external_trace_header", "routed_dp_rank",
                     "data_parallel_rank", "disagg_prefill_dp_rank", "http_worker_ipc"}
_GENERATE_SUPPORTED = {"rid", "text", "input_ids", "sampling_params", "return_logprob", "return_text_in_logprobs"}


@dataclass(frozen=True)
class GenerateRequest:
    """One /generate request: a token prompt (or `text`), sampling params, and whether to return
    the logprob of every output token. `rid` names the request (for /abort_request)."""

    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    rid: str | None = None
    text: str | None = None
    return_text_in_logprobs: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.input_ids is not None:
            out["input_ids"] = list(self.input_ids)
        if self.text is not None:
            out["text"] = self.text
        out["sampling_params"] = self.sampling_params.to_json()
        out["return_logprob"] = self.return_logprob
        if self.return_text_in_logprobs:
            out["return_text_in_logprobs"] = True
        if self.rid is not None:
            out["rid"] = self.rid
        return out

    @classmethod
    def from_json(cls, body: Any) -> GenerateRequest:
        body = _check_object(body, "body")
        _check_fields(body, _GENERATE_SUPPORTED, _GENERATE_UNSUPPORTED, _GENERATE_IGNORED,
                      struct="GenerateReqInput")
        input_ids = body.get("input_ids")
        text = body.get("text")
        if (input_ids is None) == (text is None):
            raise RequestError("input_ids", "give exactly one of input_ids and text")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in input_ids):
                batch = isinstance(input_ids, list) and all(isinstance(p, list) for p in input_ids)
                raise RequestError("input_ids", "expected one prompt as a list of integers (batches are not "
                                                "supported by the embedded engine)", 400 if batch else SCHEMA)
            if not input_ids:
                raise RequestError("input_ids", "the prompt is empty")
        if text is not None and not isinstance(text, str):
            raise RequestError("text", "expected one prompt as a string (batches are not supported)",
                               400 if isinstance(text, list) else SCHEMA)
        rid = body.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RequestError("rid", f"expected a non-empty string, got {rid!r}",
                               400 if isinstance(rid, str | list) else SCHEMA)
        if isinstance(body.get("sampling_params"), list):
            raise RequestError("sampling_params", "expected one object (batches are not supported)")
        return_logprob = _bool(body, "return_logprob", False, optional=True)
        return cls(
            input_ids=input_ids, text=text, rid=rid,
            sampling_params=SamplingParams.from_json(body.get("sampling_params")),
            return_logprob=bool(return_logprob),
            return_text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
        )


# ---------------------------------------------------------------------------------------------
# /generate response.


@dataclass(frozen=True)
class FinishReason:
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

    @classmethod
    def from_json(cls, body: Any) -> FinishReason:
        if not isinstance(body, Mapping) or body.get("type") not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason: unexpected {body!r}")
        return cls(type=body["type"], matched=body.get("matched"), length=body.get("length"),
                   message=body.get("message"))


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) were generated by weights `version`."""

    version: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class GenerateResult:
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

    def to_json(self, token_texts: list[str | None] | None = None, e2e_latency: float | None = None
                ) -> dict[str, Any]:
        finish = self.finish_detail or FinishReason(self.finish_reason)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish.to_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if self.weight_versions is not None:
            meta["weight_versions"] = [span.to_json() for span in self.weight_versions]
        if self.output_logprobs is not None:
            texts = token_texts or [None] * len(self.output_ids)
            meta["output_token_logprobs"] = [[lp, tok, txt] for lp, tok, txt in
                                             zip(self.output_logprobs, self.output_ids, texts, strict=True)]
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        return {"text": self.text or "", "output_ids": list(self.output_ids), "meta_info": meta}

    @classmethod
    def from_json(cls, body: Any) -> GenerateResult:
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
        logprobs: list[float] | None = None
        triples = meta.get("output_token_logprobs")
        if triples is not None:
            tokens = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
            if output_ids != tokens and output_ids != tokens[:-1]:
                raise ValueError("output_ids and output_token_logprobs disagree")
            output_ids = tokens
        spans = meta.get("weight_versions")
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=[int(t) for t in output_ids],
            output_logprobs=logprobs,
            finish_reason=finish.type,
            finish_detail=finish,
            weight_version=str(meta.get("weight_version", "")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            weight_versions=None if spans is None else [
                WeightVersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans],
            text=body.get("text"),
        )


# ---------------------------------------------------------------------------------------------
# /model_info.


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    weight_version: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    model_type: str | None = None
    architectures: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
                "is_generation": self.is_generation, "preferred_sampling_params": self.preferred_sampling_params,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": self.model_type,
                "architectures": self.architectures}

    @classmethod
    def from_json(cls, body: Any) -> ModelInfo:
        if not isinstance(body, Mapping) or "model_path" not in body:
            raise ValueError("not a model_info answer")
        version = body.get("weight_version")
        return cls(model_path=str(body["model_path"]), weight_version="" if version is None else str(version),
                   tokenizer_path=body.get("tokenizer_path"), is_generation=bool(body.get("is_generation", True)),
                   preferred_sampling_params=body.get("preferred_sampling_params"),
                   model_type=body.get("model_type"), architectures=body.get("architectures"))


# ---------------------------------------------------------------------------------------------
# Control requests.

_BASE_REQ_IGNORED = {"rid", "http_worker_ipc"}  # BaseReq fields
# What SGLang reports as weight_version until something sets one (ServerArgs.weight_version).
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(frozen=True)
class UpdateWeightsFromDiskRequest:
    """UpdateWeightFromDiskReqInput: load the weights in `model_path` in place; `weight_version`
    (when given) becomes the server's version once they are loaded."""

    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_path": self.model_path, "abort_all_requests": self.abort_all_requests,
                               "flush_cache": self.flush_cache}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.load_format is not None:
            out["load_format"] = self.load_format
        return out

    @classmethod
    def from_json(cls, body: Any) -> UpdateWeightsFromDiskRequest:
        body = _check_object(body, "body")
        _check_fields(body, {"model_path", "weight_version", "load_format", "abort_all_requests", "flush_cache"},
                      {"is_async": False, "keep_pause": False, "token_step": 0, "manifest": None},
                      _BASE_REQ_IGNORED | {"torch_empty_cache", "recapture_cuda_graph"},  # GPU only: no-ops
                      struct="UpdateWeightFromDiskReqInput")
        if "model_path" not in body:
            raise RequestError("model_path", "required", SCHEMA)
        return cls(model_path=_str(body, "model_path", None),
                   weight_version=_str(body, "weight_version", None, optional=True),
                   load_format=_str(body, "load_format", None, optional=True),
                   abort_all_requests=_bool(body, "abort_all_requests", False),
                   flush_cache=_bool(body, "flush_cache", True))


@dataclass(frozen=True)
class UpdateWeightsResult:
    success: bool
    message: str
    num_paused_requests: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message, "num_paused_requests": self.num_paused_requests}

    @classmethod
    def from_json(cls, body: Any) -> UpdateWeightsResult:
        if not isinstance(body, Mapping) or "success" not in body:
            raise ValueError("not an update_weights_from_disk answer")
        return cls(bool(body["success"]), str(body.get("message", "")), int(body.get("num_paused_requests", 0)))


def parse_pause(body: Any) -> str:
    """PauseGenerationReqInput → its mode."""
    body = _check_object(body if body is not None else {}, "body")
    _check_fields(body, {"mode"}, {}, _BASE_REQ_IGNORED, struct="PauseGenerationReqInput")
    mode = _str(body, "mode", "abort")
    if mode not in PAUSE_MODES:
        raise RequestError("mode", f"expected one of {', '.join(PAUSE_MODES)}, got {mode!r}", SCHEMA)
    return mode


def parse_continue(body: Any) -> None:
    """ContinueGenerationReqInput (torch_empty_cache is a GPU detail: accepted, no effect)."""
    body = _check_object(body if body is not None else {}, "body")
    _check_fields(body, set(), {}, _BASE_REQ_IGNORED | {"torch_empty_cache"}, struct="ContinueGenerationReqInput")
    _bool(body, "torch_empty_cache", True)


@dataclass(frozen=True)
class AbortRequest:
    """AbortReq: abort request `rid`, or every request with `abort_all`."""

    rid: str | None = None
    abort_all: bool = False
    abort_message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"abort_all": self.abort_all}
        if self.rid is not None:
            out["rid"] = self.rid
        if self.abort_message is not None:
            out["abort_message"] = self.abort_message
        return out

    @classmethod
    def from_json(cls, body: Any) -> AbortRequest:
        body = _check_object(body if body is not None else {}, "body")
        _check_fields(body, {"rid", "abort_all", "abort_message"}, {"finished_reason": None, "weight_versions": None},
                      {"http_worker_ipc"}, struct="AbortReq")
        return cls(rid=_str(body, "rid", None, optional=True) or None,
                   abort_all=_bool(body, "abort_all", False),
                   abort_message=_str(body, "abort_message", None, optional=True))


@dataclass(frozen=True)
class UpdateWeightVersionRequest:
    """UpdateWeightVersionReqInput: relabel the served weights as `new_version` (no weights move).
    SGLang starts at version "default"; the rollout names it "0", the base policy's version."""

    new_version: str
    abort_all_requests: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"new_version": self.new_version, "abort_all_requests": self.abort_all_requests}

    @classmethod
    def from_json(cls, body: Any) -> UpdateWeightVersionRequest:
        body = _check_object(body, "body")
        _check_fields(body, {"new_version", "abort_all_requests"}, {}, _BASE_REQ_IGNORED,
                      struct="UpdateWeightVersionReqInput")
        if "new_version" not in body:
            raise RequestError("new_version", "required", SCHEMA)
        return cls(new_version=_str(body, "new_version", None),
                   abort_all_requests=_bool(body, "abort_all_requests", True))


# ---------------------------------------------------------------------------------------------
# The colocated weight-sync routes (torch.distributed broadcast driven over HTTP).

DEFAULT_WEIGHT_GROUP = "weight_update_group"
WEIGHT_GROUP_BACKENDS: tuple[str, ...] = ("gloo", "nccl")
# Names SGLang's receiver resolves with getattr(torch, name) to a dtype (torch's own spelling).
TORCH_DTYPE_NAMES: frozenset[str] = frozenset({
    "float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "bool",
})
WEIGHT_SELECTORS: tuple[str, ...] = ("target", "draft", "all")


def _name_list(body: Mapping[str, Any], name: str, allowed: frozenset[str] | None = None) -> tuple[str, ...]:
    value = body.get(name)
    if not isinstance(value, list):
        raise RequestError(name, f"expected a list of strings, got {value!r}", SCHEMA)
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise RequestError(f"{name}[{i}]", f"expected a non-empty string, got {item!r}")
        if allowed is not None and item not in allowed:
            raise RequestError(f"{name}[{i}]", f"{item!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return tuple(value)


def _shape_list(body: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], ...]:
    value = body.get(name)
    if not isinstance(value, list):
        raise RequestError(name, f"expected a list of shapes (lists of integers), got {value!r}", SCHEMA)
    shapes = []
    for i, shape in enumerate(value):
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise RequestError(f"{name}[{i}]", f"expected a list of non-negative integers, got {shape!r}")
        shapes.append(tuple(shape))
    return tuple(shapes)


@dataclass(frozen=True)
class InitWeightsUpdateGroupRequest:
    """InitWeightsUpdateGroupReqInput: join the process group whose store rank 0 (the learner)
    hosts at master_address:master_port, as ranks rank_offset + tp_rank of world_size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_WEIGHT_GROUP
    backend: str = "nccl"

    def to_json(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size, "group_name": self.group_name,
                "backend": self.backend}

    @classmethod
    def from_json(cls, body: Any) -> InitWeightsUpdateGroupRequest:
        body = _check_object(body, "body")
        _check_fields(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
                      {}, _BASE_REQ_IGNORED, struct="InitWeightsUpdateGroupReqInput")
        for required in ("master_address", "master_port", "rank_offset", "world_size"):
            if required not in body:
                raise RequestError(required, "required", SCHEMA)
        master_address = _str(body, "master_address", None)
        if not master_address:
            raise RequestError("master_address", "must not be empty")
        master_port = _int(body, "master_port", None, minimum=1)
        if master_port > 65535:
            raise RequestError("master_port", f"must be <= 65535, got {master_port}")
        world_size = _int(body, "world_size", None, minimum=2)
        rank_offset = _int(body, "rank_offset", None, minimum=1)  # rank 0 is the sender
        if rank_offset >= world_size:
            raise RequestError("rank_offset", f"must be < world_size ({world_size}), got {rank_offset}")
        group_name = _str(body, "group_name", DEFAULT_WEIGHT_GROUP)
        if not group_name:
            raise RequestError("group_name", "must not be empty")
        backend = _str(body, "backend", "nccl")
        if backend not in WEIGHT_GROUP_BACKENDS:
            raise RequestError("backend", f"expected one of {', '.join(WEIGHT_GROUP_BACKENDS)}, got {backend!r}")
        return cls(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                   world_size=world_size, group_name=group_name, backend=backend)


@dataclass(frozen=True)
class UpdateWeightsFromDistributedRequest:
    """UpdateWeightsFromDistributedReqInput: receive the tensors `names` (with `dtypes`, torch's
    names, and `shapes`) broadcast from rank 0 of `group_name` and load them; with
    load_format "flattened_bucket" they come as one uint8 buffer (see policyloop.weights.distributed),
    otherwise one broadcast per tensor in order. `weight_version` (when given) becomes the
    engine's version once they are loaded."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_WEIGHT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"names": list(self.names), "dtypes": list(self.dtypes),
                               "shapes": [list(s) for s in self.shapes], "group_name": self.group_name,
                               "flush_cache": self.flush_cache, "abort_all_requests": self.abort_all_requests}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.load_format is not None:
            out["load_format"] = self.load_format
        if self.selector != "all":
            out["selector"] = self.selector
        return out

    @classmethod
    def from_json(cls, body: Any) -> UpdateWeightsFromDistributedRequest:
        body = _check_object(body, "body")
        _check_fields(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                             "weight_version", "load_format", "selector"},
                      {}, _BASE_REQ_IGNORED | {"torch_empty_cache"},  # GPU only: no-op
                      struct="UpdateWeightsFromDistributedReqInput")
        names = _name_list(body, "names")
        dtypes = _name_list(body, "dtypes", TORCH_DTYPE_NAMES)
        shapes = _shape_list(body, "shapes")
        if not names:
            raise RequestError("names", "at least one tensor is required")
        for field_name, values in (("dtypes", dtypes), ("shapes", shapes)):
            if len(values) != len(names):
                raise RequestError(field_name, f"expected {len(names)} entries (one per name), got {len(values)}")
        selector = _str(body, "selector", "all")
        if selector not in WEIGHT_SELECTORS:
            raise RequestError("selector", f"expected one of {', '.join(WEIGHT_SELECTORS)}, got {selector!r}", SCHEMA)
        _bool(body, "torch_empty_cache", False)
        return cls(names=names, dtypes=dtypes, shapes=shapes,
                   group_name=_str(body, "group_name", DEFAULT_WEIGHT_GROUP),
                   flush_cache=_bool(body, "flush_cache", True),
                   abort_all_requests=_bool(body, "abort_all_requests", False),
                   weight_version=_str(body, "weight_version", None, optional=True),
                   load_format=_str(body, "load_format", None, optional=True),
                   selector=selector)


@dataclass(frozen=True)
class DestroyWeightsUpdateGroupRequest:
    """DestroyWeightsUpdateGroupReqInput: leave and release the group `group_name`."""

    group_name: str = DEFAULT_WEIGHT_GROUP

    def to_json(self) -> dict[str, Any]:
        return {"group_name": self.group_name}

    @classmethod
    def from_json(cls, body: Any) -> DestroyWeightsUpdateGroupRequest:
        body = _check_object(body if body is not None else {}, "body")
        _check_fields(body, {"group_name"}, {}, _BASE_REQ_IGNORED, struct="DestroyWeightsUpdateGroupReqInput")
        return cls(group_name=_str(body, "group_name", DEFAULT_WEIGHT_GROUP))


@dataclass(frozen=True)
class BeginWeightUpdateRequest:
    """BeginWeightUpdateReqInput: open a weight-update session. SGLang 0.5.23 refuses
    update_weights_from_distributed outside one (without joining the broadcast)."""

    selector: str = "all"

    def to_json(self) -> dict[str, Any]:
        return {"selector": self.selector}

    @classmethod
    def from_json(cls, body: Any) -> BeginWeightUpdateRequest:
        body = _check_object(body if body is not None else {}, "body")
        _check_fields(body, {"selector"}, {}, _BASE_REQ_IGNORED, struct="BeginWeightUpdateReqInput")
        selector = _str(body, "selector", "all")
        if selector not in WEIGHT_SELECTORS:
            raise RequestError("selector", f"expected one of {', '.join(WEIGHT_SELECTORS)}, got {selector!r}", SCHEMA)
        return cls(selector=selector)


def parse_end_weight_update(body: Any) -> None:
    """EndWeightUpdateReqInput: close the session (it has no fields of its own)."""
    body = _check_object(body if body is not None else {}, "body")
    _check_fields(body, set(), {}, _BASE_REQ_IGNORED, struct="EndWeightUpdateReqInput")


@dataclass(frozen=True)
class ControlResult:
    """The `{"success", "message"}` answer of the weight-sync routes (200 on success, 400 not)."""

    success: bool
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message}

    @classmethod
    def from_json(cls, body: Any) -> ControlResult:
        if not isinstance(body, Mapping) or not isinstance(body.get("success"), bool):
            raise ValueError("not a {success, message} answer")
        return cls(body["success"], str(body.get("message", "")))
