"""Small shared state in Redis: policy versions, heartbeats, idempotency keys."""

from policyloop.state.store import (
    Heartbeat,
    HeartbeatRegistry,
    IdempotencyKeys,
    RedisPool,
    StateUnavailable,
    VersionConflict,
    VersionRegistry,
    connect_redis,
)

__all__ = [
    "Heartbeat", "HeartbeatRegistry", "IdempotencyKeys", "RedisPool", "StateUnavailable", "VersionConflict",
    "VersionRegistry", "connect_redis",
]
