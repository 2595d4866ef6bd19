"""The JetStream bus: topology table, typed publish, pull consumption, dead letters."""

from policyloop.bus.connection import (
    Backlog,
    Bus,
    BusError,
    BusUnavailable,
    PublishFailed,
    StreamFull,
)
from policyloop.bus.consume import Delivery, PermanentError, PullWorker, decode_message
from policyloop.bus.topology import (
    BusLimits,
    ConsumerSpec,
    StreamSpec,
    Topology,
    build_topology,
    dlq_subject,
    evals_subject,
    ledger_subject,
    promotions_subject,
    rollouts_subject,
    sandbox_subject,
    session_subject,
    tasks_subject,
    tinker_request_subject,
    tinker_result_subject,
    tinker_sample_subject,
    trajectories_subject,
    weights_subject,
)

__all__ = [
    "Backlog", "Bus", "BusError", "BusLimits", "BusUnavailable", "ConsumerSpec", "Delivery",
    "PermanentError", "PublishFailed", "PullWorker", "StreamFull", "StreamSpec", "Topology",
    "build_topology", "decode_message", "dlq_subject", "evals_subject", "ledger_subject", "promotions_subject",
    "rollouts_subject", "sandbox_subject", "session_subject", "tasks_subject", "tinker_request_subject",
    "tinker_result_subject", "tinker_sample_subject", "trajectories_subject", "weights_subject",
]
