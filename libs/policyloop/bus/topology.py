"""The whole JetStream topology in one table: streams, their subjects and message types, and
the durable consumers the services share.

Only fields nats-server 2.9.10 understands are used. Consumers have no server-side `backoff`:
on 2.9.10 it overrides the ack wait with its first step and, worse, overrides the delay of a
`nak(delay=...)` after the first redelivery (measured: nak delays of 0.1/0.2 s became 3 s and
9 s). Redelivery is paced instead by the handler's nak delays (policyloop.bus.consume) and,
for a holder that died, by the ack wait.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from google.protobuf.message import Message
from nats.js import api
from pydantic import BaseModel, Field

from policyloop.contracts.v1 import bus_pb2, loop_pb2, serving_pb2, tinker_pb2

SUBJECT_PREFIX = "pl"
DAY_SECONDS = 24 * 3600.0


class BusLimits(BaseModel):
    """Sizes and timings of the topology. Every service must agree on them, so they are set
    once per cluster (env vars POLICYLOOP_BUS__*)."""

    tasks_capacity: int = Field(
        10_000, description="Most Tasks TASKS holds; when full a publish fails (backpressure)."
    )
    rollout_ack_wait_s: float = Field(
        120.0, description="How long a rollout replica may hold a Task between heartbeats."
    )
    reward_ack_wait_s: float = Field(60.0, description="Same for a reward replica and a Rollout.")
    learner_ack_wait_s: float = Field(
        60.0, description="How long a Trajectory held by a learner that stopped answering (it sends "
                          "heartbeats while it holds one) waits before it is redelivered."
    )
    sandbox_ack_wait_s: float = Field(120.0, description="Same for a sandbox replica and a job.")
    max_deliver: int = Field(
        5, description="Deliveries of one message before it is dead-lettered."
    )
    trajectory_max_age_s: float = Field(
        7 * DAY_SECONDS, description="How long TRAJECTORIES keeps messages for replay."
    )
    trajectory_max_bytes: int = Field(
        8 * 1024**3, description="Size bound of TRAJECTORIES; the oldest go first."
    )
    weights_history: int = Field(
        16, description="WeightsPublished events kept per model subject."
    )
    ledger_max_age_s: float = Field(
        7 * DAY_SECONDS, description="How long LEDGER keeps the record of trajectories' fates (at least as long "
                                     "as TRAJECTORIES: the learner replays steps from both).")
    dlq_max_age_s: float = Field(7 * DAY_SECONDS, description="How long DLQ keeps dead letters.")
    tinker_max_age_s: float = Field(
        7 * DAY_SECONDS, description="How long TINKER keeps Tinker API training requests (a restarting learner "
                                     "applies those after its models' checkpoints again: keep them longer than "
                                     "a model goes without an optim_step).")
    traces_max_age_s: float = Field(
        30 * DAY_SECONDS, description="How long TRACES and FEEDBACK keep the serving endpoint's traces and the "
                                      "feedback on them (export them to keep them longer).")
    traces_max_bytes: int = Field(
        4 * 1024**3, description="Size bound of TRACES; the oldest traces go first.")
    evals_max_age_s: float = Field(
        365 * DAY_SECONDS, description="How long EVALS keeps the evaluator's results (a run's scores by version).")
    tinker_results_max_age_s: float = Field(
        DAY_SECONDS, description="How long TINKER_RESULTS keeps the results retrieve_future answers with.")
    duplicate_window_s: float = Field(
        600.0, description="Window in which a repeated Nats-Msg-Id is recognised as a duplicate."
    )
    stream_replicas: int = Field(
        1, ge=1, le=5,
        description="Copies JetStream keeps of every stream and durable consumer: 1 on a single "
                    "nats-server, 3 in a 3-node cluster (survives losing one node). At most the "
                    "cluster's size; an existing stream is brought to it at start-up.",
    )


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    message_type: type[Message] | None  # None: any bytes (the DLQ stores DeadLetter)
    retention: api.RetentionPolicy
    discard: api.DiscardPolicy = api.DiscardPolicy.OLD
    max_msgs: int = -1
    max_bytes: int = -1
    max_age_s: float = 0.0
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0
    num_replicas: int = 1
    description: str = ""

    def config(self) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=self.retention,
            discard=self.discard,
            max_msgs=self.max_msgs,
            max_bytes=self.max_bytes,
            max_age=self.max_age_s,
            max_msgs_per_subject=self.max_msgs_per_subject,
            duplicate_window=self.duplicate_window_s,
            storage=api.StorageType.FILE,
            num_replicas=self.num_replicas,
        )


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float
    max_deliver: int
    max_ack_pending: int = 1000
    # Stated (equal to the stream's) rather than left at 0, "inherit": re-creating a consumer
    # then carries a change of the count to consumers that already exist.
    num_replicas: int = 1
    description: str = ""

    def config(self) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            description=self.description,
            filter_subject=self.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
            num_replicas=self.num_replicas,
        )


@dataclass(frozen=True)
class Topology:
    streams: dict[str, StreamSpec]
    consumers: dict[str, ConsumerSpec] = field(default_factory=dict)

    def stream_for_subject(self, subject: str) -> StreamSpec:
        for spec in self.streams.values():
            if any(_subject_matches(pattern, subject) for pattern in spec.subjects):
                return spec
        raise KeyError(f"no stream takes subject {subject!r}")


def _streams(lim: BusLimits) -> list[StreamSpec]:
    """Every stream of the loop, before its replica count: the loop's own, then the APIs'."""
    p = SUBJECT_PREFIX
    return [
        StreamSpec(
            "TASKS", (f"{p}.tasks.>",), bus_pb2.Task, api.RetentionPolicy.WORK_QUEUE,
            discard=api.DiscardPolicy.NEW, max_msgs=lim.tasks_capacity,
            duplicate_window_s=lim.duplicate_window_s,
            description="Prompts waiting for a rollout replica (work queue; full = backpressure).",
        ),
        StreamSpec(
            "ROLLOUTS", (f"{p}.rollouts.>",), bus_pb2.TrajectoryGroup, api.RetentionPolicy.WORK_QUEUE,
            duplicate_window_s=lim.duplicate_window_s,
            description="Groups of sampled completions waiting for reward.",
        ),
        StreamSpec(
            "TRAJECTORIES", (f"{p}.traj.>",), bus_pb2.TrajectoryGroup, api.RetentionPolicy.LIMITS,
            max_age_s=lim.trajectory_max_age_s, max_bytes=lim.trajectory_max_bytes,
            duplicate_window_s=lim.duplicate_window_s,
            description="Scored groups; kept so the learner can replay from a checkpoint.",
        ),
        StreamSpec(
            "SANDBOX", (f"{p}.sandbox.>",), bus_pb2.SandboxJob, api.RetentionPolicy.WORK_QUEUE,
            duplicate_window_s=lim.duplicate_window_s,
            description="Jobs for the sandbox (request/reply through reply_subject).",
        ),
        StreamSpec(
            "SESSIONS", (f"{p}.sessions.>",), bus_pb2.SandboxJob, api.RetentionPolicy.WORK_QUEUE,
            duplicate_window_s=lim.duplicate_window_s,
            description="Sandbox sessions to start (one process per episode; steps on its channel subject).",
        ),
        StreamSpec(
            "WEIGHTS", (f"{p}.weights.>",), bus_pb2.WeightsPublished, api.RetentionPolicy.LIMITS,
            max_msgs_per_subject=lim.weights_history, duplicate_window_s=lim.duplicate_window_s,
            description="WeightsPublished events; replicas read the last per model subject.",
        ),
        StreamSpec(
            "LEDGER", (f"{p}.ledger.>",), bus_pb2.LedgerEvent, api.RetentionPolicy.LIMITS,
            max_age_s=lim.ledger_max_age_s, duplicate_window_s=lim.duplicate_window_s,
            description="What became of every trajectory: generated, trained in which step, dropped why.",
        ),
        StreamSpec(
            "DLQ", (f"{p}.dlq.>",), bus_pb2.DeadLetter, api.RetentionPolicy.LIMITS,
            max_age_s=lim.dlq_max_age_s, duplicate_window_s=lim.duplicate_window_s,
            description="Messages no service could handle, with the reason.",
        ),
    ] + _api_streams(lim)


def _api_streams(lim: BusLimits) -> list[StreamSpec]:
    """The streams of the Tinker API, the serving endpoint, evaluation and promotion."""
    p = SUBJECT_PREFIX
    return [
        StreamSpec(
            "TINKER", (f"{p}.tinkerreq.>",), tinker_pb2.TinkerRequest, api.RetentionPolicy.LIMITS,
            max_age_s=lim.tinker_max_age_s, duplicate_window_s=lim.duplicate_window_s,
            description="Tinker API training requests, per model in its client's order; the learner's log.",
        ),
        StreamSpec(
            "TINKER_SAMPLES", (f"{p}.tinkersample.>",), tinker_pb2.TinkerSampleRequest,
            api.RetentionPolicy.WORK_QUEUE, max_age_s=lim.tinker_results_max_age_s,
            duplicate_window_s=lim.duplicate_window_s,
            description="Tinker API sample requests waiting for a rollout replica with tinker_sampling (work queue).",
        ),
        StreamSpec(
            "TINKER_RESULTS", (f"{p}.tinkerres.>",), tinker_pb2.TinkerResult, api.RetentionPolicy.LIMITS,
            max_age_s=lim.tinker_results_max_age_s, max_msgs_per_subject=1, duplicate_window_s=lim.duplicate_window_s,
            description="The result of each Tinker request, under its request id.",
        ),
        StreamSpec(
            "TRACES", (f"{p}.traces.>",), serving_pb2.Trace, api.RetentionPolicy.LIMITS,
            max_age_s=lim.traces_max_age_s, max_bytes=lim.traces_max_bytes, duplicate_window_s=lim.duplicate_window_s,
            description="Every request the serving endpoint answered, with its exact tokens and weights version.",
        ),
        StreamSpec(
            "FEEDBACK", (f"{p}.feedback.>",), serving_pb2.TraceFeedback, api.RetentionPolicy.LIMITS,
            max_age_s=lim.traces_max_age_s, duplicate_window_s=lim.duplicate_window_s,
            description="Feedback callers attached to traces (a reward, a label, a correction).",
        ),
        StreamSpec(
            "EVALS", (f"{p}.evals.>",), loop_pb2.VersionEval, api.RetentionPolicy.LIMITS,
            max_age_s=lim.evals_max_age_s, duplicate_window_s=lim.duplicate_window_s,
            description="The evaluator's result for each evaluated version of each run.",
        ),
        StreamSpec(
            "PROMOTIONS", (f"{p}.promotions.>",), loop_pb2.Promotion, api.RetentionPolicy.LIMITS,
            duplicate_window_s=lim.duplicate_window_s,
            description="Every promotion and rollback of each run; serving replicas follow the newest of their run's.",
        ),
    ]


def build_topology(limits: BusLimits | None = None) -> Topology:
    """The table. Streams, subjects, retention and consumers of the whole loop."""
    lim = limits or BusLimits()
    p = SUBJECT_PREFIX
    streams = [replace(s, num_replicas=lim.stream_replicas) for s in _streams(lim)]

    def consumer(stream: str, durable: str, subject: str, ack_wait: float, what: str) -> ConsumerSpec:
        return ConsumerSpec(stream, durable, subject, ack_wait, lim.max_deliver,
                            num_replicas=lim.stream_replicas, description=what)

    consumers = [
        consumer("TASKS", "rollout", f"{p}.tasks.*", lim.rollout_ack_wait_s,
                 "Rollout replicas share it: each full-model run's Task goes to one replica."),
        consumer("TASKS", "rollout-lora", f"{p}.tasks.lora.>", lim.rollout_ack_wait_s,
                 "Rollout replicas with lora_runs share it: each LoRA run's Task goes to one of them."),
        consumer("ROLLOUTS", "reward", f"{p}.rollouts.>", lim.reward_ack_wait_s,
                 "Reward replicas share it."),
        consumer("TRAJECTORIES", "learner", f"{p}.traj.>", lim.learner_ack_wait_s,
                 "The learner's cursor over scored trajectories."),
        consumer("SANDBOX", "sandbox", f"{p}.sandbox.>", lim.sandbox_ack_wait_s,
                 "Sandbox replicas share it."),
        consumer("SESSIONS", "sandbox-sessions", f"{p}.sessions.>", lim.sandbox_ack_wait_s,
                 "Sandbox replicas share it: each session runs on one."),
        consumer("TINKER_SAMPLES", "tinker-sampling", f"{p}.tinkersample.>", lim.rollout_ack_wait_s,
                 "Rollout replicas with tinker_sampling share it: each sample request goes to one replica."),
        consumer("DLQ", "gateway", f"{p}.dlq.>", lim.reward_ack_wait_s,
                 "Gateway replicas share it: each dead-lettered task counts in its run's progress."),
    ]
    return Topology({s.name: s for s in streams}, {c.durable: c for c in consumers})


# '@' goes too: nats-server before 2.11 delivers a message whose subject holds '@' to a client
# not connected to the consumer's leader with the subject cut at the '@' and an ack subject
# that acks nothing (nats-server#6777), so a cluster would redeliver it forever.
_TOKEN_RE = re.compile(r"[^A-Za-z0-9_\-]")


def subject_token(value: str) -> str:
    """Makes `value` one valid subject token (anything but letters, digits, '_' and '-', such
    as '.', '*', '>', '@' and spaces, becomes '_')."""
    token = _TOKEN_RE.sub("_", value)
    if not token:
        raise ValueError("empty subject token")
    return token


def tasks_subject(environment: str, *, lora: bool = False) -> str:
    """A full-model run's tasks (`pl.tasks.<env>`, one token: the `rollout` consumer's), or a LoRA
    run's (`pl.tasks.lora.<env>`: the `rollout-lora` consumer's, replicas with lora_runs)."""
    return f"{SUBJECT_PREFIX}.tasks.{'lora.' if lora else ''}{subject_token(environment)}"


def rollouts_subject(environment: str) -> str:
    return f"{SUBJECT_PREFIX}.rollouts.{subject_token(environment)}"


def trajectories_subject(environment: str) -> str:
    return f"{SUBJECT_PREFIX}.traj.{subject_token(environment)}"


def sandbox_subject(kind: str) -> str:
    return f"{SUBJECT_PREFIX}.sandbox.{subject_token(kind)}"


def session_subject(kind: str) -> str:
    return f"{SUBJECT_PREFIX}.sessions.{subject_token(kind)}"


def weights_subject(model: str) -> str:
    return f"{SUBJECT_PREFIX}.weights.{subject_token(model)}"


LEDGER_KINDS = {
    bus_pb2.LedgerEvent.KIND_GENERATED: "generated",
    bus_pb2.LedgerEvent.KIND_TRAINED: "trained",
    bus_pb2.LedgerEvent.KIND_DROPPED: "dropped",
}


def ledger_subject(kind: bus_pb2.LedgerEvent.Kind.ValueType, scope: str) -> str:
    """pl.ledger.<kind>.<scope>: scope is the environment (generated) or the model."""
    return f"{SUBJECT_PREFIX}.ledger.{LEDGER_KINDS[kind]}.{subject_token(scope)}"


def evals_subject(run_id: str) -> str:
    return f"{SUBJECT_PREFIX}.evals.{subject_token(run_id)}"


def promotions_subject(run_id: str) -> str:
    return f"{SUBJECT_PREFIX}.promotions.{subject_token(run_id)}"


def dlq_subject(origin_stream: str) -> str:
    return f"{SUBJECT_PREFIX}.dlq.{subject_token(origin_stream.lower())}"


def _subject_matches(pattern: str, subject: str) -> bool:
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


def tinker_request_subject(model_id: str) -> str:
    return f"{SUBJECT_PREFIX}.tinkerreq.{subject_token(model_id)}"


def tinker_sample_subject(request_id: str) -> str:
    return f"{SUBJECT_PREFIX}.tinkersample.{subject_token(request_id)}"


def tinker_result_subject(request_id: str) -> str:
    return f"{SUBJECT_PREFIX}.tinkerres.{subject_token(request_id)}"


def trace_subject(model: str, trace_id: str) -> str:
    return f"{SUBJECT_PREFIX}.traces.{subject_token(model)}.{subject_token(trace_id)}"


def feedback_subject(model: str, trace_id: str) -> str:
    return f"{SUBJECT_PREFIX}.feedback.{subject_token(model)}.{subject_token(trace_id)}"
