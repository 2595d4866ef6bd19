from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class SandboxLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_LIMIT_NONE: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_WALL_TIME: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_CPU_TIME: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_MEMORY: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_PROCESSES: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_FILE_SIZE: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_OUTPUT: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_STEP_TIME: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_ABANDONED: _ClassVar[SandboxLimit]
    SANDBOX_LIMIT_CLOSE_GRACE: _ClassVar[SandboxLimit]

class SandboxAccounting(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_ACCOUNTING_UNSPECIFIED: _ClassVar[SandboxAccounting]
    SANDBOX_ACCOUNTING_CGROUP: _ClassVar[SandboxAccounting]
    SANDBOX_ACCOUNTING_RLIMIT: _ClassVar[SandboxAccounting]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
SANDBOX_LIMIT_NONE: SandboxLimit
SANDBOX_LIMIT_WALL_TIME: SandboxLimit
SANDBOX_LIMIT_CPU_TIME: SandboxLimit
SANDBOX_LIMIT_MEMORY: SandboxLimit
SANDBOX_LIMIT_PROCESSES: SandboxLimit
SANDBOX_LIMIT_FILE_SIZE: SandboxLimit
SANDBOX_LIMIT_OUTPUT: SandboxLimit
SANDBOX_LIMIT_STEP_TIME: SandboxLimit
SANDBOX_LIMIT_ABANDONED: SandboxLimit
SANDBOX_LIMIT_CLOSE_GRACE: SandboxLimit
SANDBOX_ACCOUNTING_UNSPECIFIED: SandboxAccounting
SANDBOX_ACCOUNTING_CGROUP: SandboxAccounting
SANDBOX_ACCOUNTING_RLIMIT: SandboxAccounting

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class BuiltinVerifier(_message.Message):
    __slots__ = ("kind", "tolerance", "pattern", "format_weight")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BuiltinVerifier.Kind]
        KIND_EXACT_ANSWER: _ClassVar[BuiltinVerifier.Kind]
        KIND_NUMERIC_TOLERANCE: _ClassVar[BuiltinVerifier.Kind]
        KIND_REGEX: _ClassVar[BuiltinVerifier.Kind]
    KIND_UNSPECIFIED: BuiltinVerifier.Kind
    KIND_EXACT_ANSWER: BuiltinVerifier.Kind
    KIND_NUMERIC_TOLERANCE: BuiltinVerifier.Kind
    KIND_REGEX: BuiltinVerifier.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    FORMAT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    kind: BuiltinVerifier.Kind
    tolerance: float
    pattern: str
    format_weight: float
    def __init__(self, kind: _Optional[_Union[BuiltinVerifier.Kind, str]] = ..., tolerance: _Optional[float] = ..., pattern: _Optional[str] = ..., format_weight: _Optional[float] = ...) -> None: ...

class UnitTestScorer(_message.Message):
    __slots__ = ("test_code", "timeout_seconds")
    TEST_CODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    test_code: str
    timeout_seconds: float
    def __init__(self, test_code: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RewardCodeScorer(_message.Message):
    __slots__ = ("source", "timeout_seconds")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    source: str
    timeout_seconds: float
    def __init__(self, source: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class EnvironmentRewardScorer(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardModelScorer(_message.Message):
    __slots__ = ("model", "normalization", "scale", "shift", "timeout_seconds")
    class Normalization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NORMALIZATION_UNSPECIFIED: _ClassVar[RewardModelScorer.Normalization]
        NORMALIZATION_SIGMOID: _ClassVar[RewardModelScorer.Normalization]
    NORMALIZATION_UNSPECIFIED: RewardModelScorer.Normalization
    NORMALIZATION_SIGMOID: RewardModelScorer.Normalization
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    normalization: RewardModelScorer.Normalization
    scale: float
    shift: float
    timeout_seconds: float
    def __init__(self, model: _Optional[str] = ..., normalization: _Optional[_Union[RewardModelScorer.Normalization, str]] = ..., scale: _Optional[float] = ..., shift: _Optional[float] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class JudgeScorer(_message.Message):
    __slots__ = ("judge", "model", "template", "verdict", "labels", "json_field", "min_score", "max_score", "max_tokens", "timeout_seconds")
    class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VERDICT_UNSPECIFIED: _ClassVar[JudgeScorer.Verdict]
        VERDICT_NUMBER: _ClassVar[JudgeScorer.Verdict]
        VERDICT_LABEL: _ClassVar[JudgeScorer.Verdict]
        VERDICT_JSON: _ClassVar[JudgeScorer.Verdict]
    VERDICT_UNSPECIFIED: JudgeScorer.Verdict
    VERDICT_NUMBER: JudgeScorer.Verdict
    VERDICT_LABEL: JudgeScorer.Verdict
    VERDICT_JSON: JudgeScorer.Verdict
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JUDGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    judge: str
    model: str
    template: str
    verdict: JudgeScorer.Verdict
    labels: _containers.ScalarMap[str, float]
    json_field: str
    min_score: float
    max_score: float
    max_tokens: int
    timeout_seconds: float
    def __init__(self, judge: _Optional[str] = ..., model: _Optional[str] = ..., template: _Optional[str] = ..., verdict: _Optional[_Union[JudgeScorer.Verdict, str]] = ..., labels: _Optional[_Mapping[str, float]] = ..., json_field: _Optional[str] = ..., min_score: _Optional[float] = ..., max_score: _Optional[float] = ..., max_tokens: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class Scorer(_message.Message):
    __slots__ = ("builtin", "unit_tests", "reward_code", "environment_reward", "reward_model", "judge", "answer")
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    UNIT_TESTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_CODE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    JUDGE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    builtin: BuiltinVerifier
    unit_tests: UnitTestScorer
    reward_code: RewardCodeScorer
    environment_reward: EnvironmentRewardScorer
    reward_model: RewardModelScorer
    judge: JudgeScorer
    answer: str
    def __init__(self, builtin: _Optional[_Union[BuiltinVerifier, _Mapping]] = ..., unit_tests: _Optional[_Union[UnitTestScorer, _Mapping]] = ..., reward_code: _Optional[_Union[RewardCodeScorer, _Mapping]] = ..., environment_reward: _Optional[_Union[EnvironmentRewardScorer, _Mapping]] = ..., reward_model: _Optional[_Union[RewardModelScorer, _Mapping]] = ..., judge: _Optional[_Union[JudgeScorer, _Mapping]] = ..., answer: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "run_id", "environment", "prompt_token_ids", "prompt_text", "group_size", "sampling", "metadata", "created_unix_ms", "max_turns", "tools", "scorer", "program", "openenv", "verifiers")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    OPENENV_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    run_id: str
    environment: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    group_size: int
    sampling: SamplingParams
    metadata: _containers.ScalarMap[str, str]
    created_unix_ms: int
    max_turns: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    scorer: Scorer
    program: EnvironmentProgram
    openenv: OpenEnvServer
    verifiers: VerifiersEnvironment
    def __init__(self, task_id: _Optional[str] = ..., run_id: _Optional[str] = ..., environment: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_unix_ms: _Optional[int] = ..., max_turns: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ..., scorer: _Optional[_Union[Scorer, _Mapping]] = ..., program: _Optional[_Union[EnvironmentProgram, _Mapping]] = ..., openenv: _Optional[_Union[OpenEnvServer, _Mapping]] = ..., verifiers: _Optional[_Union[VerifiersEnvironment, _Mapping]] = ...) -> None: ...

class OpenEnvServer(_message.Message):
    __slots__ = ("base_url", "action_field", "observation_field", "step_seconds")
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    base_url: str
    action_field: str
    observation_field: str
    step_seconds: float
    def __init__(self, base_url: _Optional[str] = ..., action_field: _Optional[str] = ..., observation_field: _Optional[str] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class EnvironmentProgram(_message.Message):
    __slots__ = ("files", "entry", "step_seconds", "episode_seconds", "memory_bytes", "requirements", "wheels")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class WheelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    WHEELS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    entry: str
    step_seconds: float
    episode_seconds: float
    memory_bytes: int
    requirements: _containers.RepeatedScalarFieldContainer[str]
    wheels: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., entry: _Optional[str] = ..., step_seconds: _Optional[float] = ..., episode_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., requirements: _Optional[_Iterable[str]] = ..., wheels: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class VerifiersEnvironment(_message.Message):
    __slots__ = ("environment_id", "arguments_json", "files", "step_seconds", "episode_seconds", "memory_bytes", "requirements", "wheels")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class WheelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ENVIRONMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    WHEELS_FIELD_NUMBER: _ClassVar[int]
    environment_id: str
    arguments_json: str
    files: _containers.ScalarMap[str, bytes]
    step_seconds: float
    episode_seconds: float
    memory_bytes: int
    requirements: _containers.RepeatedScalarFieldContainer[str]
    wheels: _containers.ScalarMap[str, bytes]
    def __init__(self, environment_id: _Optional[str] = ..., arguments_json: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ..., step_seconds: _Optional[float] = ..., episode_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., requirements: _Optional[_Iterable[str]] = ..., wheels: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class EnvRequest(_message.Message):
    __slots__ = ("reset", "action")
    RESET_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    reset: EnvReset
    action: EnvAction
    def __init__(self, reset: _Optional[_Union[EnvReset, _Mapping]] = ..., action: _Optional[_Union[EnvAction, _Mapping]] = ...) -> None: ...

class EnvReset(_message.Message):
    __slots__ = ("prompt_text", "answer", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    answer: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, prompt_text: _Optional[str] = ..., answer: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EnvAction(_message.Message):
    __slots__ = ("text", "content", "tool_calls", "truncated")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    text: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[EnvToolCall]
    truncated: bool
    def __init__(self, text: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[EnvToolCall, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class EnvToolCall(_message.Message):
    __slots__ = ("name", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class EnvMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class EnvReply(_message.Message):
    __slots__ = ("messages", "reward", "done", "tools_json", "error")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[EnvMessage]
    reward: float
    done: bool
    tools_json: str
    error: str
    def __init__(self, messages: _Optional[_Iterable[_Union[EnvMessage, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., tools_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("task_created_unix_ms", "generation_started_unix_ms", "generation_finished_unix_ms", "scored_unix_ms")
    TASK_CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SCORED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    task_created_unix_ms: int
    generation_started_unix_ms: int
    generation_finished_unix_ms: int
    scored_unix_ms: int
    def __init__(self, task_created_unix_ms: _Optional[int] = ..., generation_started_unix_ms: _Optional[int] = ..., generation_finished_unix_ms: _Optional[int] = ..., scored_unix_ms: _Optional[int] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("name", "value", "weight", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    weight: float
    detail: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., weight: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("role", "start", "end", "tool", "status", "text", "reward")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROLE_UNSPECIFIED: _ClassVar[Turn.Role]
        ROLE_MODEL: _ClassVar[Turn.Role]
        ROLE_TOOL: _ClassVar[Turn.Role]
        ROLE_ENVIRONMENT: _ClassVar[Turn.Role]
    ROLE_UNSPECIFIED: Turn.Role
    ROLE_MODEL: Turn.Role
    ROLE_TOOL: Turn.Role
    ROLE_ENVIRONMENT: Turn.Role
    ROLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    role: Turn.Role
    start: int
    end: int
    tool: str
    status: str
    text: str
    reward: float
    def __init__(self, role: _Optional[_Union[Turn.Role, str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., tool: _Optional[str] = ..., status: _Optional[str] = ..., text: _Optional[str] = ..., reward: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "group_id", "sample_index", "group_size", "run_id", "environment", "prompt_token_ids", "response_token_ids", "behaviour_logprobs", "loss_mask", "version_spans", "finish_reason", "timings", "rollout_replica", "metadata", "prompt_text", "response_text", "turns", "scored", "reward", "reward_breakdown", "scorer", "supervised")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_REPLICA_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    SUPERVISED_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    run_id: str
    environment: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    finish_reason: FinishReason
    timings: Timings
    rollout_replica: str
    metadata: _containers.ScalarMap[str, str]
    prompt_text: str
    response_text: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    scored: bool
    reward: float
    reward_breakdown: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    scorer: Scorer
    supervised: bool
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., run_id: _Optional[str] = ..., environment: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., rollout_replica: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., prompt_text: _Optional[str] = ..., response_text: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., scored: _Optional[bool] = ..., reward: _Optional[float] = ..., reward_breakdown: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., scorer: _Optional[_Union[Scorer, _Mapping]] = ..., supervised: _Optional[bool] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "trajectories")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class WeightsPublished(_message.Message):
    __slots__ = ("model", "version", "base_versions", "manifest_hash", "bytes_raw", "bytes_delta", "codec", "fetch_endpoint", "step", "published_unix_ms", "run_id", "trained_unix_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    BYTES_RAW_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELTA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FETCH_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    base_versions: _containers.RepeatedScalarFieldContainer[int]
    manifest_hash: str
    bytes_raw: int
    bytes_delta: int
    codec: str
    fetch_endpoint: str
    step: int
    published_unix_ms: int
    run_id: str
    trained_unix_ms: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., base_versions: _Optional[_Iterable[int]] = ..., manifest_hash: _Optional[str] = ..., bytes_raw: _Optional[int] = ..., bytes_delta: _Optional[int] = ..., codec: _Optional[str] = ..., fetch_endpoint: _Optional[str] = ..., step: _Optional[int] = ..., published_unix_ms: _Optional[int] = ..., run_id: _Optional[str] = ..., trained_unix_ms: _Optional[int] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("origin_stream", "origin_subject", "stream_sequence", "consumer", "payload", "headers", "reason", "delivery_count", "service", "dead_lettered_unix_ms")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ORIGIN_STREAM_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    origin_stream: str
    origin_subject: str
    stream_sequence: int
    consumer: str
    payload: bytes
    headers: _containers.ScalarMap[str, str]
    reason: str
    delivery_count: int
    service: str
    dead_lettered_unix_ms: int
    def __init__(self, origin_stream: _Optional[str] = ..., origin_subject: _Optional[str] = ..., stream_sequence: _Optional[int] = ..., consumer: _Optional[str] = ..., payload: _Optional[bytes] = ..., headers: _Optional[_Mapping[str, str]] = ..., reason: _Optional[str] = ..., delivery_count: _Optional[int] = ..., service: _Optional[str] = ..., dead_lettered_unix_ms: _Optional[int] = ...) -> None: ...

class LedgerEvent(_message.Message):
    __slots__ = ("kind", "run_id", "model", "trajectory_ids", "stream_sequences", "step", "policy_version", "manifest_hash", "reason", "instance", "recorded_unix_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[LedgerEvent.Kind]
        KIND_GENERATED: _ClassVar[LedgerEvent.Kind]
        KIND_TRAINED: _ClassVar[LedgerEvent.Kind]
        KIND_DROPPED: _ClassVar[LedgerEvent.Kind]
    KIND_UNSPECIFIED: LedgerEvent.Kind
    KIND_GENERATED: LedgerEvent.Kind
    KIND_TRAINED: LedgerEvent.Kind
    KIND_DROPPED: LedgerEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RECORDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    kind: LedgerEvent.Kind
    run_id: str
    model: str
    trajectory_ids: _containers.RepeatedScalarFieldContainer[str]
    stream_sequences: _containers.RepeatedScalarFieldContainer[int]
    step: int
    policy_version: int
    manifest_hash: str
    reason: str
    instance: str
    recorded_unix_ms: int
    def __init__(self, kind: _Optional[_Union[LedgerEvent.Kind, str]] = ..., run_id: _Optional[str] = ..., model: _Optional[str] = ..., trajectory_ids: _Optional[_Iterable[str]] = ..., stream_sequences: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., reason: _Optional[str] = ..., instance: _Optional[str] = ..., recorded_unix_ms: _Optional[int] = ...) -> None: ...

class SandboxLimits(_message.Message):
    __slots__ = ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes", "max_open_files", "max_output_bytes")
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    wall_seconds: float
    cpu_seconds: float
    memory_bytes: int
    max_processes: int
    max_file_bytes: int
    max_open_files: int
    max_output_bytes: int
    def __init__(self, wall_seconds: _Optional[float] = ..., cpu_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., max_processes: _Optional[int] = ..., max_file_bytes: _Optional[int] = ..., max_open_files: _Optional[int] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class SandboxJob(_message.Message):
    __slots__ = ("job_id", "run_id", "files", "command", "stdin", "limits", "reply_subject", "expires_unix_ms", "session", "dependencies")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    REPLY_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEPENDENCIES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    run_id: str
    files: _containers.ScalarMap[str, bytes]
    command: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    limits: SandboxLimits
    reply_subject: str
    expires_unix_ms: int
    session: SandboxSession
    dependencies: SandboxDependencies
    def __init__(self, job_id: _Optional[str] = ..., run_id: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ..., command: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., reply_subject: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ..., session: _Optional[_Union[SandboxSession, _Mapping]] = ..., dependencies: _Optional[_Union[SandboxDependencies, _Mapping]] = ...) -> None: ...

class SandboxDependencies(_message.Message):
    __slots__ = ("requirements", "wheels")
    class WheelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    WHEELS_FIELD_NUMBER: _ClassVar[int]
    requirements: _containers.RepeatedScalarFieldContainer[str]
    wheels: _containers.ScalarMap[str, bytes]
    def __init__(self, requirements: _Optional[_Iterable[str]] = ..., wheels: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SandboxSession(_message.Message):
    __slots__ = ("channel_subject", "step_seconds", "prepared")
    CHANNEL_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    channel_subject: str
    step_seconds: float
    prepared: bool
    def __init__(self, channel_subject: _Optional[str] = ..., step_seconds: _Optional[float] = ..., prepared: _Optional[bool] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("line", "close")
    LINE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    line: bytes
    close: bool
    def __init__(self, line: _Optional[bytes] = ..., close: _Optional[bool] = ...) -> None: ...

class SessionStepReply(_message.Message):
    __slots__ = ("line", "ended", "result")
    LINE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    line: bytes
    ended: bool
    result: SandboxResult
    def __init__(self, line: _Optional[bytes] = ..., ended: _Optional[bool] = ..., result: _Optional[_Union[SandboxResult, _Mapping]] = ...) -> None: ...

class SandboxResult(_message.Message):
    __slots__ = ("job_id", "exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "wall_seconds", "cpu_seconds", "limit_hit", "error", "sandbox_instance", "accounting", "peak_memory_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_HIT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_seconds: float
    cpu_seconds: float
    limit_hit: SandboxLimit
    error: str
    sandbox_instance: str
    accounting: SandboxAccounting
    peak_memory_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., wall_seconds: _Optional[float] = ..., cpu_seconds: _Optional[float] = ..., limit_hit: _Optional[_Union[SandboxLimit, str]] = ..., error: _Optional[str] = ..., sandbox_instance: _Optional[str] = ..., accounting: _Optional[_Union[SandboxAccounting, str]] = ..., peak_memory_bytes: _Optional[int] = ...) -> None: ...
