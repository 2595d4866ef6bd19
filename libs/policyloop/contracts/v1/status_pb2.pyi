from policyloop.contracts.v1 import loop_pb2 as _loop_pb2
from policyloop.contracts.v1 import bus_pb2 as _bus_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoopConfig(_message.Message):
    __slots__ = ("model", "max_lag", "groups_per_step")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_lag: int
    groups_per_step: int
    def __init__(self, model: _Optional[str] = ..., max_lag: _Optional[int] = ..., groups_per_step: _Optional[int] = ...) -> None: ...

class DroppedCounts(_message.Message):
    __slots__ = ("stale", "duplicate", "invalid", "run_stopped")
    STALE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    RUN_STOPPED_FIELD_NUMBER: _ClassVar[int]
    stale: int
    duplicate: int
    invalid: int
    run_stopped: int
    def __init__(self, stale: _Optional[int] = ..., duplicate: _Optional[int] = ..., invalid: _Optional[int] = ..., run_stopped: _Optional[int] = ...) -> None: ...

class WeightPushTotals(_message.Message):
    __slots__ = ("versions_pushed", "keyframes", "full_bytes", "pushed_bytes", "delta_bytes", "last_changed_fraction")
    VERSIONS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    KEYFRAMES_FIELD_NUMBER: _ClassVar[int]
    FULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHANGED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    versions_pushed: int
    keyframes: int
    full_bytes: int
    pushed_bytes: int
    delta_bytes: int
    last_changed_fraction: float
    def __init__(self, versions_pushed: _Optional[int] = ..., keyframes: _Optional[int] = ..., full_bytes: _Optional[int] = ..., pushed_bytes: _Optional[int] = ..., delta_bytes: _Optional[int] = ..., last_changed_fraction: _Optional[float] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("mean_reward", "grad_norm", "statistics")
    class StatisticsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    mean_reward: float
    grad_norm: float
    statistics: _containers.ScalarMap[str, float]
    def __init__(self, mean_reward: _Optional[float] = ..., grad_norm: _Optional[float] = ..., statistics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("loop", "loss", "step", "trajectories_seen", "groups_complete", "dropped", "lag_histogram", "trained_samples", "trained_tokens", "busy_s", "first_trajectory_at", "last_step_at", "checkpoint_version", "resumed_checkpoint_version", "replayed_steps", "weights", "last_step", "lora_runs", "full_model", "tinker", "lora_run_versions")
    class LagHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraRunVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LOOP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_SEEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAG_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TRAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TRAJECTORY_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUMED_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LORA_RUNS_FIELD_NUMBER: _ClassVar[int]
    FULL_MODEL_FIELD_NUMBER: _ClassVar[int]
    TINKER_FIELD_NUMBER: _ClassVar[int]
    LORA_RUN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    loop: LoopConfig
    loss: _loop_pb2.LossSettings
    step: int
    trajectories_seen: int
    groups_complete: int
    dropped: DroppedCounts
    lag_histogram: _containers.ScalarMap[int, int]
    trained_samples: int
    trained_tokens: int
    busy_s: float
    first_trajectory_at: float
    last_step_at: float
    checkpoint_version: int
    resumed_checkpoint_version: int
    replayed_steps: int
    weights: WeightPushTotals
    last_step: StepStats
    lora_runs: bool
    full_model: bool
    tinker: bool
    lora_run_versions: _containers.ScalarMap[str, int]
    def __init__(self, loop: _Optional[_Union[LoopConfig, _Mapping]] = ..., loss: _Optional[_Union[_loop_pb2.LossSettings, _Mapping]] = ..., step: _Optional[int] = ..., trajectories_seen: _Optional[int] = ..., groups_complete: _Optional[int] = ..., dropped: _Optional[_Union[DroppedCounts, _Mapping]] = ..., lag_histogram: _Optional[_Mapping[int, int]] = ..., trained_samples: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., first_trajectory_at: _Optional[float] = ..., last_step_at: _Optional[float] = ..., checkpoint_version: _Optional[int] = ..., resumed_checkpoint_version: _Optional[int] = ..., replayed_steps: _Optional[int] = ..., weights: _Optional[_Union[WeightPushTotals, _Mapping]] = ..., last_step: _Optional[_Union[StepStats, _Mapping]] = ..., lora_runs: _Optional[bool] = ..., full_model: _Optional[bool] = ..., tinker: _Optional[bool] = ..., lora_run_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WeightFetch(_message.Message):
    __slots__ = ("kind", "bytes", "raw_bytes", "source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    bytes: int
    raw_bytes: int
    source: str
    def __init__(self, kind: _Optional[str] = ..., bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("loop", "engine_url", "announced_version", "tasks_done", "tasks_skipped", "generated_tokens", "resubmitted", "tool_calls", "paced", "last_fetch", "serving_run", "openai_url", "tinker_sampling", "tinker_samples_done", "relay_endpoint", "tree_depth")
    LOOP_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUBMITTED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCH_FIELD_NUMBER: _ClassVar[int]
    SERVING_RUN_FIELD_NUMBER: _ClassVar[int]
    OPENAI_URL_FIELD_NUMBER: _ClassVar[int]
    TINKER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TINKER_SAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    loop: LoopConfig
    engine_url: str
    announced_version: int
    tasks_done: int
    tasks_skipped: int
    generated_tokens: int
    resubmitted: int
    tool_calls: int
    paced: bool
    last_fetch: WeightFetch
    serving_run: str
    openai_url: str
    tinker_sampling: bool
    tinker_samples_done: int
    relay_endpoint: str
    tree_depth: int
    def __init__(self, loop: _Optional[_Union[LoopConfig, _Mapping]] = ..., engine_url: _Optional[str] = ..., announced_version: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_skipped: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., resubmitted: _Optional[int] = ..., tool_calls: _Optional[int] = ..., paced: _Optional[bool] = ..., last_fetch: _Optional[_Union[WeightFetch, _Mapping]] = ..., serving_run: _Optional[str] = ..., openai_url: _Optional[str] = ..., tinker_sampling: _Optional[bool] = ..., tinker_samples_done: _Optional[int] = ..., relay_endpoint: _Optional[str] = ..., tree_depth: _Optional[int] = ...) -> None: ...

class EvaluatorStatus(_message.Message):
    __slots__ = ("evaluated", "engine_url", "last_version")
    EVALUATED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    LAST_VERSION_FIELD_NUMBER: _ClassVar[int]
    evaluated: int
    engine_url: str
    last_version: int
    def __init__(self, evaluated: _Optional[int] = ..., engine_url: _Optional[str] = ..., last_version: _Optional[int] = ...) -> None: ...

class GatewayStatus(_message.Message):
    __slots__ = ("backpressure",)
    BACKPRESSURE_FIELD_NUMBER: _ClassVar[int]
    backpressure: bool
    def __init__(self, backpressure: _Optional[bool] = ...) -> None: ...

class RewardStatus(_message.Message):
    __slots__ = ("rollouts_done",)
    ROLLOUTS_DONE_FIELD_NUMBER: _ClassVar[int]
    rollouts_done: int
    def __init__(self, rollouts_done: _Optional[int] = ...) -> None: ...

class SandboxStatus(_message.Message):
    __slots__ = ("accounting", "jobs_done", "jobs_expired", "sessions_done")
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    JOBS_DONE_FIELD_NUMBER: _ClassVar[int]
    JOBS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_DONE_FIELD_NUMBER: _ClassVar[int]
    accounting: str
    jobs_done: int
    jobs_expired: int
    sessions_done: int
    def __init__(self, accounting: _Optional[str] = ..., jobs_done: _Optional[int] = ..., jobs_expired: _Optional[int] = ..., sessions_done: _Optional[int] = ...) -> None: ...

class ServiceHeartbeat(_message.Message):
    __slots__ = ("service", "instance", "healthy", "policy_version", "health_url", "checks", "pid", "host", "started_unix_ms", "beat_unix_ms", "grpc_endpoint", "learner", "rollout", "gateway", "sandbox", "reward", "evaluator")
    class ChecksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTH_URL_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LEARNER_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance: str
    healthy: bool
    policy_version: int
    health_url: str
    checks: _containers.ScalarMap[str, str]
    pid: int
    host: str
    started_unix_ms: int
    beat_unix_ms: int
    grpc_endpoint: str
    learner: LearnerStatus
    rollout: RolloutStatus
    gateway: GatewayStatus
    sandbox: SandboxStatus
    reward: RewardStatus
    evaluator: EvaluatorStatus
    def __init__(self, service: _Optional[str] = ..., instance: _Optional[str] = ..., healthy: _Optional[bool] = ..., policy_version: _Optional[int] = ..., health_url: _Optional[str] = ..., checks: _Optional[_Mapping[str, str]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., started_unix_ms: _Optional[int] = ..., beat_unix_ms: _Optional[int] = ..., grpc_endpoint: _Optional[str] = ..., learner: _Optional[_Union[LearnerStatus, _Mapping]] = ..., rollout: _Optional[_Union[RolloutStatus, _Mapping]] = ..., gateway: _Optional[_Union[GatewayStatus, _Mapping]] = ..., sandbox: _Optional[_Union[SandboxStatus, _Mapping]] = ..., reward: _Optional[_Union[RewardStatus, _Mapping]] = ..., evaluator: _Optional[_Union[EvaluatorStatus, _Mapping]] = ...) -> None: ...
