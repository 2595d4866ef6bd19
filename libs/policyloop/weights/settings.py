"""Settings of relayed fan-out: the publisher's tree and a replica's relay."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FanoutTreeSettings(BaseModel):
    """The publisher's side (weights.fanout)."""

    fanout: int = Field(0, ge=0, description="Children per parent in the fan-out tree (the publisher included); "
                                             "0: no tree, every replica fetches from the publisher.")
    lease_s: float = Field(60.0, gt=0, description="A replica that does not join the tree again within this is "
                                                   "dropped from it (replicas join again every third of it).")
    node: str = Field("", description="The publisher's node label: replicas on it go under it first.")
    zone: str = Field("", description="The publisher's zone label.")


class RelaySettings(BaseModel):
    """A replica's side (weights.relay, weights.tree)."""

    enabled: bool = Field(False, description="Join the publisher's fan-out tree: fetch each version from the "
                                             "parent it places this replica under, and serve Fetch to this "
                                             "replica's own children from what it verified.")
    host: str = Field("127.0.0.1", description="Interface of the relay's gRPC server.")
    port: int = Field(0, ge=0, description="Port of the relay's gRPC server (0: any free port).")
    node: str = Field("", description="Topology label: a parent on the same node is preferred, then one in the same "
                                      "zone (e.g. the Kubernetes node name).")
    zone: str = Field("", description="Topology label (e.g. topology.kubernetes.io/zone).")
    parent_deadline_s: float = Field(
        120.0, gt=0, description="How long a fetch from the parent may take, waiting for it included; then the "
                                 "parent is reported failed and the version fetched from a new parent or the "
                                 "publisher. Keep it above the time a version takes to reach this depth of the "
                                 "tree, or lagging parents send their children to the publisher all at once "
                                 "(a parent that is gone fails at once, whatever it is).")
    wait_s: float = Field(120.0, gt=0, description="How long a child's Fetch waits for a version this replica is "
                                                   "still fetching.")
    egress_gbps: float = Field(0.0, ge=0, description="Cap on the bytes this relay sends, in Gbit/s (0: no cap).")
