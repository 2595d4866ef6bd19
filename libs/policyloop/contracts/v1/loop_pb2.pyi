from policyloop.contracts.v1 import bus_pb2 as _bus_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from policyloop.contracts.v1.bus_pb2 import SamplingParams as SamplingParams
from policyloop.contracts.v1.bus_pb2 import BuiltinVerifier as BuiltinVerifier
from policyloop.contracts.v1.bus_pb2 import UnitTestScorer as UnitTestScorer
from policyloop.contracts.v1.bus_pb2 import RewardCodeScorer as RewardCodeScorer
from policyloop.contracts.v1.bus_pb2 import EnvironmentRewardScorer as EnvironmentRewardScorer
from policyloop.contracts.v1.bus_pb2 import RewardModelScorer as RewardModelScorer
from policyloop.contracts.v1.bus_pb2 import JudgeScorer as JudgeScorer
from policyloop.contracts.v1.bus_pb2 import Scorer as Scorer
from policyloop.contracts.v1.bus_pb2 import Task as Task
from policyloop.contracts.v1.bus_pb2 import OpenEnvServer as OpenEnvServer
from policyloop.contracts.v1.bus_pb2 import EnvironmentProgram as EnvironmentProgram
from policyloop.contracts.v1.bus_pb2 import VerifiersEnvironment as VerifiersEnvironment
from policyloop.contracts.v1.bus_pb2 import EnvRequest as EnvRequest
from policyloop.contracts.v1.bus_pb2 import EnvReset as EnvReset
from policyloop.contracts.v1.bus_pb2 import EnvAction as EnvAction
from policyloop.contracts.v1.bus_pb2 import EnvToolCall as EnvToolCall
from policyloop.contracts.v1.bus_pb2 import EnvMessage as EnvMessage
from policyloop.contracts.v1.bus_pb2 import EnvReply as EnvReply
from policyloop.contracts.v1.bus_pb2 import VersionSpan as VersionSpan
from policyloop.contracts.v1.bus_pb2 import Timings as Timings
from policyloop.contracts.v1.bus_pb2 import RewardComponent as RewardComponent
from policyloop.contracts.v1.bus_pb2 import Turn as Turn
from policyloop.contracts.v1.bus_pb2 import Trajectory as Trajectory
from policyloop.contracts.v1.bus_pb2 import TrajectoryGroup as TrajectoryGroup
from policyloop.contracts.v1.bus_pb2 import WeightsPublished as WeightsPublished
from policyloop.contracts.v1.bus_pb2 import DeadLetter as DeadLetter
from policyloop.contracts.v1.bus_pb2 import LedgerEvent as LedgerEvent
from policyloop.contracts.v1.bus_pb2 import SandboxLimits as SandboxLimits
from policyloop.contracts.v1.bus_pb2 import SandboxJob as SandboxJob
from policyloop.contracts.v1.bus_pb2 import SandboxDependencies as SandboxDependencies
from policyloop.contracts.v1.bus_pb2 import SandboxSession as SandboxSession
from policyloop.contracts.v1.bus_pb2 import SessionStep as SessionStep
from policyloop.contracts.v1.bus_pb2 import SessionStepReply as SessionStepReply
from policyloop.contracts.v1.bus_pb2 import SandboxResult as SandboxResult
from policyloop.contracts.v1.bus_pb2 import FinishReason as FinishReason
from policyloop.contracts.v1.bus_pb2 import SandboxLimit as SandboxLimit
from policyloop.contracts.v1.bus_pb2 import SandboxAccounting as SandboxAccounting

DESCRIPTOR: _descriptor.FileDescriptor
FINISH_REASON_UNSPECIFIED: _bus_pb2.FinishReason
FINISH_REASON_STOP: _bus_pb2.FinishReason
FINISH_REASON_LENGTH: _bus_pb2.FinishReason
FINISH_REASON_ABORT: _bus_pb2.FinishReason
FINISH_REASON_ERROR: _bus_pb2.FinishReason
SANDBOX_LIMIT_NONE: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_WALL_TIME: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_CPU_TIME: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_MEMORY: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_PROCESSES: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_FILE_SIZE: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_OUTPUT: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_STEP_TIME: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_ABANDONED: _bus_pb2.SandboxLimit
SANDBOX_LIMIT_CLOSE_GRACE: _bus_pb2.SandboxLimit
SANDBOX_ACCOUNTING_UNSPECIFIED: _bus_pb2.SandboxAccounting
SANDBOX_ACCOUNTING_CGROUP: _bus_pb2.SandboxAccounting
SANDBOX_ACCOUNTING_RLIMIT: _bus_pb2.SandboxAccounting

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState

class TaskSpec(_message.Message):
    __slots__ = ("prompt_text", "prompt_token_ids", "answer", "metadata", "demonstration_token_ids", "demonstration_text", "demonstration_loss_mask")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DEMONSTRATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEMONSTRATION_TEXT_FIELD_NUMBER: _ClassVar[int]
    DEMONSTRATION_LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    answer: str
    metadata: _containers.ScalarMap[str, str]
    demonstration_token_ids: _containers.RepeatedScalarFieldContainer[int]
    demonstration_text: str
    demonstration_loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., answer: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., demonstration_token_ids: _Optional[_Iterable[int]] = ..., demonstration_text: _Optional[str] = ..., demonstration_loss_mask: _Optional[_Iterable[bool]] = ...) -> None: ...

class Environment(_message.Message):
    __slots__ = ("name", "version", "tasks", "builtin", "unit_tests", "reward_code", "environment_reward", "reward_model", "judge", "group_size", "sampling", "max_turns", "tools", "eval_tasks", "supervised", "program", "openenv", "verifiers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    UNIT_TESTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_CODE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    JUDGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TASKS_FIELD_NUMBER: _ClassVar[int]
    SUPERVISED_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    OPENENV_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    builtin: _bus_pb2.BuiltinVerifier
    unit_tests: _bus_pb2.UnitTestScorer
    reward_code: _bus_pb2.RewardCodeScorer
    environment_reward: _bus_pb2.EnvironmentRewardScorer
    reward_model: _bus_pb2.RewardModelScorer
    judge: _bus_pb2.JudgeScorer
    group_size: int
    sampling: _bus_pb2.SamplingParams
    max_turns: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    eval_tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    supervised: bool
    program: _bus_pb2.EnvironmentProgram
    openenv: _bus_pb2.OpenEnvServer
    verifiers: _bus_pb2.VerifiersEnvironment
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., builtin: _Optional[_Union[_bus_pb2.BuiltinVerifier, _Mapping]] = ..., unit_tests: _Optional[_Union[_bus_pb2.UnitTestScorer, _Mapping]] = ..., reward_code: _Optional[_Union[_bus_pb2.RewardCodeScorer, _Mapping]] = ..., environment_reward: _Optional[_Union[_bus_pb2.EnvironmentRewardScorer, _Mapping]] = ..., reward_model: _Optional[_Union[_bus_pb2.RewardModelScorer, _Mapping]] = ..., judge: _Optional[_Union[_bus_pb2.JudgeScorer, _Mapping]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[_bus_pb2.SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ..., eval_tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., supervised: _Optional[bool] = ..., program: _Optional[_Union[_bus_pb2.EnvironmentProgram, _Mapping]] = ..., openenv: _Optional[_Union[_bus_pb2.OpenEnvServer, _Mapping]] = ..., verifiers: _Optional[_Union[_bus_pb2.VerifiersEnvironment, _Mapping]] = ...) -> None: ...

class SubmitEnvironmentRequest(_message.Message):
    __slots__ = ("environment",)
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    environment: Environment
    def __init__(self, environment: _Optional[_Union[Environment, _Mapping]] = ...) -> None: ...

class UploadEnvironmentRequest(_message.Message):
    __slots__ = ("environment", "tasks", "eval_tasks")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TASKS_FIELD_NUMBER: _ClassVar[int]
    environment: Environment
    tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    eval_tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    def __init__(self, environment: _Optional[_Union[Environment, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., eval_tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ...) -> None: ...

class SubmitEnvironmentResponse(_message.Message):
    __slots__ = ("environment", "num_tasks", "created", "group_size")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    environment: str
    num_tasks: int
    created: bool
    group_size: int
    def __init__(self, environment: _Optional[str] = ..., num_tasks: _Optional[int] = ..., created: _Optional[bool] = ..., group_size: _Optional[int] = ...) -> None: ...

class EnvironmentMix(_message.Message):
    __slots__ = ("environment", "weight")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    environment: str
    weight: float
    def __init__(self, environment: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("run_id", "environments", "model", "num_tasks", "max_lag", "loss", "seed", "lora")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentMix]
    model: str
    num_tasks: int
    max_lag: int
    loss: LossSettings
    seed: int
    lora: LoraSpec
    def __init__(self, run_id: _Optional[str] = ..., environments: _Optional[_Iterable[_Union[EnvironmentMix, _Mapping]]] = ..., model: _Optional[str] = ..., num_tasks: _Optional[int] = ..., max_lag: _Optional[int] = ..., loss: _Optional[_Union[LossSettings, _Mapping]] = ..., seed: _Optional[int] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ...) -> None: ...

class LossSettings(_message.Message):
    __slots__ = ("kind", "normalization", "constant", "clip_low", "clip_high", "advantages", "off_policy", "tis_cap", "kl_coef", "kl_estimator", "beta", "gamma", "lam", "value_clip")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OFF_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    LAM_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    normalization: str
    constant: float
    clip_low: float
    clip_high: float
    advantages: str
    off_policy: str
    tis_cap: float
    kl_coef: float
    kl_estimator: str
    beta: float
    gamma: float
    lam: float
    value_clip: float
    def __init__(self, kind: _Optional[str] = ..., normalization: _Optional[str] = ..., constant: _Optional[float] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., advantages: _Optional[str] = ..., off_policy: _Optional[str] = ..., tis_cap: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[str] = ..., beta: _Optional[float] = ..., gamma: _Optional[float] = ..., lam: _Optional[float] = ..., value_clip: _Optional[float] = ...) -> None: ...

class LoraSpec(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "state", "environments", "model", "max_lag", "tasks_total", "tasks_enqueued", "policy_version", "created_unix_ms", "updated_unix_ms", "error", "progress", "lora", "evals", "promotion", "start_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TASKS_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_FIELD_NUMBER: _ClassVar[int]
    START_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentMix]
    model: str
    max_lag: int
    tasks_total: int
    tasks_enqueued: int
    policy_version: int
    created_unix_ms: int
    updated_unix_ms: int
    error: str
    progress: RunProgress
    lora: LoraSpec
    evals: _containers.RepeatedCompositeFieldContainer[VersionEval]
    promotion: Promotion
    start_version: int
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., environments: _Optional[_Iterable[_Union[EnvironmentMix, _Mapping]]] = ..., model: _Optional[str] = ..., max_lag: _Optional[int] = ..., tasks_total: _Optional[int] = ..., tasks_enqueued: _Optional[int] = ..., policy_version: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., error: _Optional[str] = ..., progress: _Optional[_Union[RunProgress, _Mapping]] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., evals: _Optional[_Iterable[_Union[VersionEval, _Mapping]]] = ..., promotion: _Optional[_Union[Promotion, _Mapping]] = ..., start_version: _Optional[int] = ...) -> None: ...

class RunProgress(_message.Message):
    __slots__ = ("learner_step", "trained_samples", "dropped_samples", "environments", "lag_histogram", "trained_tokens_per_second", "generated_tokens_per_second", "generated_tokens", "trained_tokens", "tasks_trained", "tasks_dropped", "tasks_dead_lettered", "tasks_dropped_by_reason", "tasks_in_flight", "dead_lettered_samples")
    class EnvironmentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EnvironmentProgress
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EnvironmentProgress, _Mapping]] = ...) -> None: ...
    class LagHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class TasksDroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LEARNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    LAG_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TASKS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TASKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TASKS_DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    TASKS_DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    TASKS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    learner_step: int
    trained_samples: int
    dropped_samples: int
    environments: _containers.MessageMap[str, EnvironmentProgress]
    lag_histogram: _containers.ScalarMap[int, int]
    trained_tokens_per_second: float
    generated_tokens_per_second: float
    generated_tokens: int
    trained_tokens: int
    tasks_trained: int
    tasks_dropped: int
    tasks_dead_lettered: int
    tasks_dropped_by_reason: _containers.ScalarMap[str, int]
    tasks_in_flight: int
    dead_lettered_samples: int
    def __init__(self, learner_step: _Optional[int] = ..., trained_samples: _Optional[int] = ..., dropped_samples: _Optional[int] = ..., environments: _Optional[_Mapping[str, EnvironmentProgress]] = ..., lag_histogram: _Optional[_Mapping[int, int]] = ..., trained_tokens_per_second: _Optional[float] = ..., generated_tokens_per_second: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., tasks_trained: _Optional[int] = ..., tasks_dropped: _Optional[int] = ..., tasks_dead_lettered: _Optional[int] = ..., tasks_dropped_by_reason: _Optional[_Mapping[str, int]] = ..., tasks_in_flight: _Optional[int] = ..., dead_lettered_samples: _Optional[int] = ...) -> None: ...

class EnvironmentProgress(_message.Message):
    __slots__ = ("trained_samples", "mean_reward", "last_step_reward")
    TRAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_REWARD_FIELD_NUMBER: _ClassVar[int]
    trained_samples: int
    mean_reward: float
    last_step_reward: float
    def __init__(self, trained_samples: _Optional[int] = ..., mean_reward: _Optional[float] = ..., last_step_reward: _Optional[float] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Policy(_message.Message):
    __slots__ = ("model", "version", "updated_unix_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    updated_unix_ms: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ...) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[Policy]
    def __init__(self, policies: _Optional[_Iterable[_Union[Policy, _Mapping]]] = ...) -> None: ...

class EnvironmentScore(_message.Message):
    __slots__ = ("environment", "tasks", "passed", "pass_rate", "pass_rate_low", "pass_rate_high", "mean_reward")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_LOW_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_HIGH_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    environment: str
    tasks: int
    passed: int
    pass_rate: float
    pass_rate_low: float
    pass_rate_high: float
    mean_reward: float
    def __init__(self, environment: _Optional[str] = ..., tasks: _Optional[int] = ..., passed: _Optional[int] = ..., pass_rate: _Optional[float] = ..., pass_rate_low: _Optional[float] = ..., pass_rate_high: _Optional[float] = ..., mean_reward: _Optional[float] = ...) -> None: ...

class VersionEval(_message.Message):
    __slots__ = ("run_id", "model", "version", "step", "environments", "pass_rate", "pass_rate_low", "pass_rate_high", "regressed", "best_version", "evaluated_unix_ms", "seconds", "evaluator")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_LOW_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_HIGH_FIELD_NUMBER: _ClassVar[int]
    REGRESSED_FIELD_NUMBER: _ClassVar[int]
    BEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    version: int
    step: int
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentScore]
    pass_rate: float
    pass_rate_low: float
    pass_rate_high: float
    regressed: bool
    best_version: int
    evaluated_unix_ms: int
    seconds: float
    evaluator: str
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., environments: _Optional[_Iterable[_Union[EnvironmentScore, _Mapping]]] = ..., pass_rate: _Optional[float] = ..., pass_rate_low: _Optional[float] = ..., pass_rate_high: _Optional[float] = ..., regressed: _Optional[bool] = ..., best_version: _Optional[int] = ..., evaluated_unix_ms: _Optional[int] = ..., seconds: _Optional[float] = ..., evaluator: _Optional[str] = ...) -> None: ...

class Promotion(_message.Message):
    __slots__ = ("run_id", "model", "version", "reason", "promoted_unix_ms", "sequence", "weights", "previous_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: str
    version: int
    reason: str
    promoted_unix_ms: int
    sequence: int
    weights: _bus_pb2.WeightsPublished
    previous_version: int
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., promoted_unix_ms: _Optional[int] = ..., sequence: _Optional[int] = ..., weights: _Optional[_Union[_bus_pb2.WeightsPublished, _Mapping]] = ..., previous_version: _Optional[int] = ...) -> None: ...

class PromoteVersionRequest(_message.Message):
    __slots__ = ("run_id", "version", "reason", "force")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    reason: str
    force: bool
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RollbackVersionRequest(_message.Message):
    __slots__ = ("run_id", "version", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ListRunVersionsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunVersion(_message.Message):
    __slots__ = ("version", "step", "created_unix_ms", "kept", "eval", "serving", "promotions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    created_unix_ms: int
    kept: bool
    eval: VersionEval
    serving: bool
    promotions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., kept: _Optional[bool] = ..., eval: _Optional[_Union[VersionEval, _Mapping]] = ..., serving: _Optional[bool] = ..., promotions: _Optional[_Iterable[int]] = ...) -> None: ...

class ListRunVersionsResponse(_message.Message):
    __slots__ = ("versions", "promotion")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[RunVersion]
    promotion: Promotion
    def __init__(self, versions: _Optional[_Iterable[_Union[RunVersion, _Mapping]]] = ..., promotion: _Optional[_Union[Promotion, _Mapping]] = ...) -> None: ...
