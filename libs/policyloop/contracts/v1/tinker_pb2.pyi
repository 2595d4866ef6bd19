from policyloop.contracts.v1 import loop_pb2 as _loop_pb2
from policyloop.contracts.v1 import bus_pb2 as _bus_pb2
from policyloop.contracts.v1 import tinker_wire_pb2 as _tinker_wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TinkerRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "seq_id", "create_model", "forward_backward", "optim_step", "save_weights", "load_weights")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    seq_id: int
    create_model: TinkerCreateModel
    forward_backward: _tinker_wire_pb2.ForwardBackwardRequest
    optim_step: TinkerAdamParams
    save_weights: TinkerSaveWeights
    load_weights: TinkerLoadWeights
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., create_model: _Optional[_Union[TinkerCreateModel, _Mapping]] = ..., forward_backward: _Optional[_Union[_tinker_wire_pb2.ForwardBackwardRequest, _Mapping]] = ..., optim_step: _Optional[_Union[TinkerAdamParams, _Mapping]] = ..., save_weights: _Optional[_Union[TinkerSaveWeights, _Mapping]] = ..., load_weights: _Optional[_Union[TinkerLoadWeights, _Mapping]] = ...) -> None: ...

class TinkerCreateModel(_message.Message):
    __slots__ = ("base_model", "rank", "train_mlp", "train_attn", "train_unembed", "seed")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    seed: int
    def __init__(self, base_model: _Optional[str] = ..., rank: _Optional[int] = ..., train_mlp: _Optional[bool] = ..., train_attn: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class TinkerAdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class TinkerSaveWeights(_message.Message):
    __slots__ = ("name", "for_sampler", "overwrite")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FOR_SAMPLER_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    name: str
    for_sampler: bool
    overwrite: bool
    def __init__(self, name: _Optional[str] = ..., for_sampler: _Optional[bool] = ..., overwrite: _Optional[bool] = ...) -> None: ...

class TinkerLoadWeights(_message.Message):
    __slots__ = ("path", "optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    optimizer: bool
    def __init__(self, path: _Optional[str] = ..., optimizer: _Optional[bool] = ...) -> None: ...

class TinkerError(_message.Message):
    __slots__ = ("message", "category")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    message: str
    category: str
    def __init__(self, message: _Optional[str] = ..., category: _Optional[str] = ...) -> None: ...

class TinkerResult(_message.Message):
    __slots__ = ("request_id", "model_id", "error", "created", "forward_backward", "optim_step", "saved", "loaded", "sample")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    error: TinkerError
    created: TinkerCreated
    forward_backward: _tinker_wire_pb2.ForwardBackwardOutput
    optim_step: TinkerOptimStepDone
    saved: TinkerSaved
    loaded: TinkerLoaded
    sample: _tinker_wire_pb2.SampleResponse
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., error: _Optional[_Union[TinkerError, _Mapping]] = ..., created: _Optional[_Union[TinkerCreated, _Mapping]] = ..., forward_backward: _Optional[_Union[_tinker_wire_pb2.ForwardBackwardOutput, _Mapping]] = ..., optim_step: _Optional[_Union[TinkerOptimStepDone, _Mapping]] = ..., saved: _Optional[_Union[TinkerSaved, _Mapping]] = ..., loaded: _Optional[_Union[TinkerLoaded, _Mapping]] = ..., sample: _Optional[_Union[_tinker_wire_pb2.SampleResponse, _Mapping]] = ...) -> None: ...

class TinkerCreated(_message.Message):
    __slots__ = ("model_id", "lora_rank")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    lora_rank: int
    def __init__(self, model_id: _Optional[str] = ..., lora_rank: _Optional[int] = ...) -> None: ...

class TinkerOptimStepDone(_message.Message):
    __slots__ = ("metrics", "step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    step: int
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., step: _Optional[int] = ...) -> None: ...

class TinkerSaved(_message.Message):
    __slots__ = ("path", "version", "weights_model", "fetch_endpoint", "lora")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MODEL_FIELD_NUMBER: _ClassVar[int]
    FETCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    weights_model: str
    fetch_endpoint: str
    lora: _loop_pb2.LoraSpec
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., weights_model: _Optional[str] = ..., fetch_endpoint: _Optional[str] = ..., lora: _Optional[_Union[_loop_pb2.LoraSpec, _Mapping]] = ...) -> None: ...

class TinkerSamplingSession(_message.Message):
    __slots__ = ("sampling_session_id", "model_path", "weights_model", "version", "fetch_endpoint", "lora")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FETCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    model_path: str
    weights_model: str
    version: int
    fetch_endpoint: str
    lora: _loop_pb2.LoraSpec
    def __init__(self, sampling_session_id: _Optional[str] = ..., model_path: _Optional[str] = ..., weights_model: _Optional[str] = ..., version: _Optional[int] = ..., fetch_endpoint: _Optional[str] = ..., lora: _Optional[_Union[_loop_pb2.LoraSpec, _Mapping]] = ...) -> None: ...

class TinkerLoaded(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class TinkerCheckpoint(_message.Message):
    __slots__ = ("checkpoint_id", "path", "saved_unix_ms")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    path: str
    saved_unix_ms: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., path: _Optional[str] = ..., saved_unix_ms: _Optional[int] = ...) -> None: ...

class TinkerSampleRequest(_message.Message):
    __slots__ = ("request_id", "session", "prompt", "num_samples", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session: TinkerSamplingSession
    prompt: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: TinkerStopTokens
    prompt_logprobs: bool
    def __init__(self, request_id: _Optional[str] = ..., session: _Optional[_Union[TinkerSamplingSession, _Mapping]] = ..., prompt: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Union[TinkerStopTokens, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class TinkerStopTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
