"""The Prometheus metrics every service shares (prefix `policyloop_`).

Service-specific metrics live next to the code that updates them; these are the ones the
runtime and the bus layer update for every service.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BUS_PUBLISHED = Counter(
    "policyloop_bus_published_total",
    "Messages published and acknowledged by JetStream.",
    ["stream", "duplicate"],
)
BUS_CONSUMED = Counter(
    "policyloop_bus_consumed_total",
    "Messages taken from a consumer, by outcome (acked, nacked, dead_lettered, requeued).",
    ["stream", "consumer", "outcome"],
)
BUS_DEAD_LETTERED = Counter(
    "policyloop_bus_dead_lettered_total",
    "Messages copied to the DLQ stream, by origin stream and reason kind.",
    ["stream", "kind"],
)
BUS_HANDLER_SECONDS = Histogram(
    "policyloop_bus_handler_seconds",
    "Time a handler spent on one message.",
    ["stream", "consumer"],
)
BUS_BACKLOG = Gauge(
    "policyloop_bus_backlog_messages",
    "Messages waiting for a consumer (pending) and delivered but not acknowledged (ack_pending).",
    ["stream", "consumer", "kind"],
)
POLICY_VERSION = Gauge(
    "policyloop_policy_version",
    "Policy version this service instance holds or serves.",
    ["service"],
)
SERVICE_UP = Gauge(
    "policyloop_service_healthy",
    "1 when this service instance reports itself healthy.",
    ["service"],
)
