from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("trace_id", "model", "endpoint", "messages", "prompt_text", "prompt_token_ids", "response_token_ids", "response_logprobs", "response_text", "finish_reason", "weights_version", "weights_spans", "created_unix_ms", "temperature", "tools_json", "response_tool_calls", "session_id", "response_id", "choice_index", "stop_matched")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SPANS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STOP_MATCHED_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    model: str
    endpoint: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_logprobs: _containers.RepeatedScalarFieldContainer[float]
    response_text: str
    finish_reason: str
    weights_version: str
    weights_spans: _containers.RepeatedCompositeFieldContainer[WeightsSpan]
    created_unix_ms: int
    temperature: float
    tools_json: str
    response_tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    session_id: str
    response_id: str
    choice_index: int
    stop_matched: str
    def __init__(self, trace_id: _Optional[str] = ..., model: _Optional[str] = ..., endpoint: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., response_logprobs: _Optional[_Iterable[float]] = ..., response_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., weights_version: _Optional[str] = ..., weights_spans: _Optional[_Iterable[_Union[WeightsSpan, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ..., temperature: _Optional[float] = ..., tools_json: _Optional[str] = ..., response_tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., session_id: _Optional[str] = ..., response_id: _Optional[str] = ..., choice_index: _Optional[int] = ..., stop_matched: _Optional[str] = ...) -> None: ...

class WeightsSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: str
    start: int
    end: int
    def __init__(self, version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class TraceFeedback(_message.Message):
    __slots__ = ("trace_id", "session_id", "feedback_id", "reward", "label", "correction", "created_unix_ms")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    session_id: str
    feedback_id: str
    reward: float
    label: str
    correction: str
    created_unix_ms: int
    def __init__(self, trace_id: _Optional[str] = ..., session_id: _Optional[str] = ..., feedback_id: _Optional[str] = ..., reward: _Optional[float] = ..., label: _Optional[str] = ..., correction: _Optional[str] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...
