"""Settings shared by every service. Each service has one model that extends this one; every
field is read from `POLICYLOOP_<FIELD>` (nested: `POLICYLOOP_BUS__<FIELD>`) or from a flag
(`--field-name value` after `policyloop serve <name>`), and every field is documented."""

from __future__ import annotations

import os
import socket
from typing import Any, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from policyloop.bus.topology import BusLimits
from policyloop.contracts.v1 import status_pb2
from policyloop.state.store import RedisPool
from policyloop.telemetry.tracing import TracingSettings


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="POLICYLOOP_",
        env_nested_delimiter="__",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server with JetStream. A cluster: its servers comma-separated "
                    "(nats://a:4222,nats://b:4222,nats://c:4222); the client fails over between them.",
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for shared state.")
    redis_pool: RedisPool = Field(
        default_factory=RedisPool, description="Bounds of each Redis client's connection pool: a command "
                                               "beyond max_connections waits for a free one (wait_timeout_s).")
    namespace: str = Field(
        "default",
        description="Redis key namespace of this cluster, so clusters can share one Redis.",
    )
    run_id: str = Field("local", description="Run this service belongs to; bound into every log line.")
    instance_id: str = Field(
        default_factory=default_instance_id,
        description="Name of this replica (heartbeats, logs, trajectory stamps). Default host-pid.",
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")
    http_host: str = Field("127.0.0.1", description="Interface of the /metrics and /healthz server.")
    http_port: int = Field(0, description="Port of the /metrics and /healthz server (0: any free port).")
    advertise_host: str = Field(
        "127.0.0.1",
        description="Host other processes use to reach this one (written into heartbeats).",
    )
    heartbeat_interval_s: float = Field(2.0, description="Seconds between Redis heartbeats.")
    heartbeat_ttl_s: float = Field(
        6.0, description="Lifetime of a heartbeat; an instance silent this long counts as gone."
    )
    connect_timeout_s: float = Field(
        20.0, description="Deadline for the first connection to NATS and to Redis at start-up."
    )
    shutdown_grace_s: float = Field(
        10.0,
        description="On SIGTERM, how long in-flight messages may finish before they are nacked.",
    )
    bus: BusLimits = Field(
        default_factory=BusLimits, description="Sizes and timings of the stream topology."
    )
    tracing: TracingSettings = Field(
        default_factory=TracingSettings, description="OpenTelemetry spans of each trajectory's life, over OTLP/HTTP."
    )
    # The loop's shared settings: every service of a cluster must be started with the same values.
    # The learner advertises its own in its status; rollout replicas refuse to sample against a
    # learner that disagrees, and the gateway refuses runs asking for other values.
    model: str = Field("policy", description="Name of the model the loop trains and serves (WEIGHTS subject, "
                                             "versions).")
    max_lag: int = Field(
        1, ge=-1, description="Samples whose oldest token is more than max_lag versions behind the version being "
                              "trained are dropped with their group (counted as stale); rollout replicas do not "
                              "start groups that would be (pacing). -1: no bound.")
    groups_per_step: int = Field(32, ge=1, description="Complete groups (prompts) per optimizer step.")

    def loop_config(self) -> status_pb2.LoopConfig:
        """The shared settings as the status messages carry them."""
        return status_pb2.LoopConfig(model=self.model, max_lag=self.max_lag, groups_per_step=self.groups_per_step)

    def loop_disagreement(self, advertised: status_pb2.LoopConfig) -> str | None:
        """Why this service's shared settings differ from what the learner advertises (None: same)."""
        mine = self.loop_config()
        names = [f.name for f in status_pb2.LoopConfig.DESCRIPTOR.fields]
        wrong = [f"{name} is {getattr(advertised, name)!r} there, {getattr(mine, name)!r} here"
                 for name in names if getattr(advertised, name) != getattr(mine, name)]
        return "; ".join(wrong) or None


S = TypeVar("S", bound=ServiceSettings)


def load_settings(model: type[S], cli_args: list[str] | None = None, **overrides: Any) -> S:
    """Environment variables, then flags, then explicit overrides (highest)."""
    if cli_args:
        settings = CliApp.run(model, cli_args=cli_args)
    else:
        settings = model()
    return settings.model_copy(update=overrides) if overrides else settings
