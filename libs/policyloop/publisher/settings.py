"""The publisher's settings (flags `--<field>`, env vars `POLICYLOOP_<FIELD>`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from policyloop.runtime import ServiceSettings
from policyloop.weights.settings import FanoutTreeSettings


class PublisherSettings(ServiceSettings):
    grpc_host: str = Field("127.0.0.1", description="Interface of the WeightService gRPC server.")
    grpc_port: int = Field(50052, description="Port of the WeightService gRPC server (0: any free port).")
    store_dir: Path = Field(Path("runs/local/weights"), description="Where versions are kept on disk.")
    retention_versions: int = Field(8, description="Newest versions kept per model; older ones are deleted.")
    bearer_token: str = Field("", description="If set, every call must carry 'authorization: Bearer <token>'.")
    snapshot_every: int = Field(
        16, description="Write a keyframe snapshot after this many chained deltas, so rebuilding any kept "
                        "version (restart, a lagging client) applies at most this many deltas.")
    payload_cache_entries: int = Field(4, description="Payloads kept in memory for fetches (each built once).")
    egress_gbps: float = Field(0.0, description="Cap on the bytes all fetches send, in Gbit/s (0: no cap).")
    tree: FanoutTreeSettings = Field(default_factory=FanoutTreeSettings,
                                     description="Relayed fan-out: replicas placed in a tree, fetching from one "
                                                 "another (tree.fanout 0: off).")
