"""What `policyloop status` reports: every service instance that is alive (by its Redis
heartbeat), whether it is healthy (its own report, plus the gRPC health protocol for gRPC
services), its policy version, and the backlog of the consumer it reads; and for each stream,
its replicas: which NATS node leads it and which copies lag or are offline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from policyloop.bus import Backlog, Bus
from policyloop.cluster.catalogue import SERVICES, entry
from policyloop.runtime.probe import grpc_serving
from policyloop.state import Heartbeat, HeartbeatRegistry, connect_redis


@dataclass
class InstanceStatus:
    service: str
    instance: str
    healthy: bool
    policy_version: int
    reason: str = ""
    backlog: Backlog | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    age_s: float = 0.0


@dataclass
class StreamReplicas:
    replicas: int                   # configured copies (1: a single server)
    leader: str | None              # the node that orders its writes (None: being elected)
    behind: list[str] = field(default_factory=list)   # copies offline or not current


@dataclass
class ClusterStatus:
    instances: list[InstanceStatus]
    missing: list[str]              # services with no live instance
    backlogs: dict[str, Backlog]
    streams: dict[str, StreamReplicas] = field(default_factory=dict)

    @property
    def replicated(self) -> bool:
        return any(s.replicas > 1 for s in self.streams.values())

    @property
    def all_healthy(self) -> bool:
        return not self.missing and all(i.healthy for i in self.instances)


async def _instance_status(beat: Heartbeat, backlogs: dict[str, Backlog]) -> InstanceStatus:
    healthy, reason = beat.healthy, "" if beat.healthy else "reports unhealthy"
    known = beat.service in {s.name for s in SERVICES}
    if healthy and known and entry(beat.service).grpc:
        target = beat.grpc_endpoint
        healthy, reason = await grpc_serving(target) if target else (False, "no gRPC address")
    return InstanceStatus(
        service=beat.service, instance=beat.instance, healthy=healthy, reason=reason,
        policy_version=beat.policy_version, backlog=backlogs.get(beat.service),
        heartbeat=beat, age_s=max(0.0, time.time() - beat.beat_unix_ms / 1000),
    )


async def cluster_status(nats_url: str, redis_url: str, namespace: str,
                         connect_timeout_s: float = 5.0) -> ClusterStatus:
    client = await connect_redis(redis_url, connect_timeout_s=connect_timeout_s)
    bus = await Bus.connect(nats_url, name="policyloop-status", connect_timeout_s=connect_timeout_s)
    try:
        beats = await HeartbeatRegistry(client, namespace).alive()
        backlogs: dict[str, Backlog] = {}
        for durable in bus.topology.consumers:
            try:
                backlogs[durable] = await bus.backlog(durable)
            except Exception:  # noqa: BLE001 - a consumer not created yet has no backlog
                pass
        instances = list(await asyncio.gather(*(_instance_status(b, backlogs) for b in beats)))
        streams = await _stream_replicas(bus)
    finally:
        await bus.close()
        await client.aclose()
    present = {i.service for i in instances}
    missing = [s.name for s in SERVICES if s.name not in present]
    return ClusterStatus(instances, missing, backlogs, streams)


async def _stream_replicas(bus: Bus) -> dict[str, StreamReplicas]:
    out = {}
    for name in bus.topology.streams:
        try:
            info = await bus.js.stream_info(name)
        except Exception:  # noqa: BLE001 - not created yet, or its leader being elected
            continue
        cluster = info.cluster
        behind = [p.name for p in (cluster.replicas or []) if p.offline or not p.current] if cluster else []
        out[name] = StreamReplicas(info.config.num_replicas or 1, cluster.leader if cluster else None, behind)
    return out
