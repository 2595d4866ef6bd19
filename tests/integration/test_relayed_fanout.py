"""Relayed fan-out on loopback: a real publisher places replicas in a tree (JoinTree), each replica
serves Fetch to its children from what it verified (a real gRPC relay), and versions travel down
the tree byte for byte, every replica verifying every tensor. A relay killed mid-transfer or one
that lags costs its children one fallback and nothing else; bad calls are refused naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from policyloop.contracts.v1 import weights_pb2, weights_pb2_grpc
from policyloop.weights.client import WeightClient
from policyloop.weights.codec import WeightSet
from policyloop.weights.fanout import PUBLISHER, FanoutTree
from policyloop.weights.library import WeightLibrary
from policyloop.weights.link import LinkLimit
from policyloop.weights.push import VersionPusher
from policyloop.weights.relay import NotHeld, RelayHoldings, RelayServicer, start_relay_server
from policyloop.weights.server import WeightServicer, start_weight_server
from policyloop.weights.store import VersionStore
from policyloop.weights.tree import TreeSync, sync_through_tree
from tests.helpers import perturbed, random_weights, until

MODEL = "policy"


class GatedLink(LinkLimit):
    """An egress held shut on purpose: chunks wait at the gate (counted) until it opens."""

    def __init__(self) -> None:
        super().__init__(0)
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def take(self, nbytes: int) -> None:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1


@dataclass
class Replica:
    name: str
    holdings: RelayHoldings
    link: GatedLink
    server: grpc.aio.Server
    tree: TreeSync
    held: WeightSet | None = None
    sources: list[str] = field(default_factory=list)

    async def sync(self, version: int) -> WeightSet:
        self.held, _report, source = await sync_through_tree(self.tree, self.holdings, MODEL, self.held, version)
        self.sources.append(source)
        return self.held


@dataclass
class Cluster:
    publisher: WeightServicer
    endpoint: str
    pusher: VersionPusher
    replicas: list[Replica]

    @property
    def tree(self) -> FanoutTree:
        return self.publisher.trees[MODEL]


def publisher_bytes() -> float:
    return REGISTRY.get_sample_value("policyloop_weights_bytes_served_total", {"server": "publisher"}) or 0.0


@asynccontextmanager
async def cluster(tmp_path: Path, *, fanout: int, replicas: int, parent_deadline_s: float = 60.0,
                  relay_wait_s: float = 60.0) -> AsyncIterator[Cluster]:
    library = WeightLibrary(VersionStore(tmp_path / "store", retention=8), snapshot_every=4)

    async def stored(_version: object) -> None:
        return None

    servicer = WeightServicer(library, on_stored=stored, tree=lambda: FanoutTree(fanout, lease_s=600))
    server, port = await start_weight_server(servicer, host="127.0.0.1", port=0)
    endpoint = f"127.0.0.1:{port}"
    pusher = VersionPusher(WeightClient(endpoint, deadline_s=60), MODEL)
    made: list[Replica] = []
    try:
        for i in range(replicas):
            holdings, link = RelayHoldings(), GatedLink()
            relay, relay_port = await start_relay_server(RelayServicer(holdings, wait_s=relay_wait_s, egress=link),
                                                         host="127.0.0.1", port=0)
            tree = TreeSync(WeightClient(endpoint, deadline_s=60), model=MODEL, replica=f"r{i}",
                            relay_endpoint=f"127.0.0.1:{relay_port}", parent_deadline_s=parent_deadline_s)
            await tree.placement()  # joins in order: the tree's shape is known
            made.append(Replica(f"r{i}", holdings, link, relay, tree))
        yield Cluster(servicer, endpoint, pusher, made)
    finally:
        for replica in made:
            replica.link.gate.set()
            await replica.server.stop(None)
            await replica.tree.close()
            await replica.tree.publisher.close()
        await pusher.client.close()
        await server.stop(None)
        await library.drain()


async def test_versions_travel_down_the_tree_and_the_publisher_serves_only_its_children(tmp_path: Path) -> None:
    async with cluster(tmp_path, fanout=2, replicas=6) as c:
        parents = {r.name: r.tree.current.parent for r in c.replicas}  # type: ignore[union-attr]
        assert parents == {"r0": PUBLISHER, "r1": PUBLISHER, "r2": "r0", "r3": "r0", "r4": "r1", "r5": "r1"}
        assert c.tree.depth == 2
        first = random_weights(1, shapes={"embed": (512, 64), "w": (64, 256), "b": (256,)})
        await c.pusher.push(first, step=1)
        await asyncio.gather(*(r.sync(1) for r in c.replicas))
        second = perturbed(first, 2, fraction=0.02)
        await c.pusher.push(second, step=2)
        before = publisher_bytes()
        served_before = {r.name: r.holdings.bytes_served for r in c.replicas}
        synced = await asyncio.gather(*(r.sync(2) for r in c.replicas))
        assert all(w.manifest_hash == second.manifest_hash for w in synced)  # every tensor verified
        delta = (await c.pusher.client.list_versions(MODEL))[-1].bytes
        # The publisher sent the delta twice (its two children); each of them twice more.
        assert publisher_bytes() - before == 2 * delta
        served = {r.name: r.holdings.bytes_served - served_before[r.name] for r in c.replicas}
        assert served == {"r0": 2 * delta, "r1": 2 * delta, "r2": 0, "r3": 0, "r4": 0, "r5": 0}
        assert [r.sources[-1] for r in c.replicas] == [PUBLISHER, PUBLISHER, "r0", "r0", "r1", "r1"]
        assert all(r.tree.fallbacks == 0 for r in c.replicas)


async def test_a_relay_killed_mid_transfer_costs_its_children_one_fallback_and_nothing_else(tmp_path: Path) -> None:
    async with cluster(tmp_path, fanout=2, replicas=4) as c:
        first = random_weights(1)
        await c.pusher.push(first, step=1)
        await asyncio.gather(*(r.sync(1) for r in c.replicas))
        r0, r1, r2, r3 = c.replicas
        assert (r2.tree.current.parent, r3.tree.current.parent) == ("r0", "r0")  # type: ignore[union-attr]
        second = perturbed(first, 2)
        await c.pusher.push(second, step=2)
        r0.link.gate.clear()  # r0 verifies version 2, then its sends to r2 and r3 wait at its egress
        await r0.sync(2)
        await r1.sync(2)
        children = [asyncio.create_task(r.sync(2)) for r in (r2, r3)]
        await until(lambda: r0.link.waiting == 2, what="r0 sending to both children")
        await r0.server.stop(None)  # the relay dies mid-transfer
        synced = await asyncio.gather(*children)
        assert all(w.manifest_hash == second.manifest_hash for w in synced)
        assert r2.tree.fallbacks == r3.tree.fallbacks == 1
        assert "r0" not in c.tree.members
        # Placed anew: one took r0's place under the publisher, the other went under r1.
        assert sorted([r2.sources[-1], r3.sources[-1]]) == [PUBLISHER, "r1"]
        assert c.tree.depth == 2 and r1.holdings.bytes_served > 0


async def test_a_parent_that_lags_past_the_deadline_is_left_for_the_publisher(tmp_path: Path) -> None:
    async with cluster(tmp_path, fanout=1, replicas=2, parent_deadline_s=1.0) as c:
        first = random_weights(1)
        await c.pusher.push(first, step=1)
        r0, r1 = c.replicas
        await r0.sync(1)
        await r1.sync(1)
        await c.pusher.push(perturbed(first, 2), step=2)
        # r0 never fetches version 2: r1 waits for it at r0, then gives up and goes to the publisher.
        synced = await r1.sync(2)
        assert synced.version == 2 and r1.sources[-1] == PUBLISHER and r1.tree.fallbacks == 1
        assert "r0" not in c.tree.members and r1.tree.current.parent == PUBLISHER  # type: ignore[union-attr]


async def test_bad_calls_are_refused_naming_the_field_and_a_relay_serves_fetch_only(tmp_path: Path) -> None:
    async with cluster(tmp_path, fanout=2, replicas=1) as c:
        client = WeightClient(c.endpoint, deadline_s=30)
        relay_port = c.replicas[0].tree.request.relay_endpoint.rsplit(":", 1)[1]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}")
        relay = weights_pb2_grpc.WeightServiceStub(channel)
        try:
            for request, named in [
                    (weights_pb2.JoinTreeRequest(model=MODEL), "replica"),
                    (weights_pb2.JoinTreeRequest(model="../x", replica="a"), "model"),
                    (weights_pb2.JoinTreeRequest(model=MODEL, replica="a", relay_endpoint="no-port"),
                     "relay_endpoint")]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.join_tree(request)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details().startswith(named)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in relay.Fetch(weights_pb2.FetchRequest(model=MODEL, want_version=-1)):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("want_version")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await relay.ListVersions(weights_pb2.ListVersionsRequest())
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "a relay serves Fetch only" in refused.value.details()
            # A relay holding a version only as a delta (no weights: it cannot make a keyframe) sends a
            # replica that holds nothing to the publisher.
            first = random_weights(1)
            await c.pusher.push(first, step=1)
            await c.pusher.push(perturbed(first, 2), step=2)
            fetched = await client.fetch(MODEL, have_version=1, want_version=2)
            await c.replicas[0].holdings.hold(fetched, None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in relay.Fetch(weights_pb2.FetchRequest(model=MODEL, want_version=2)):
                    pass
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert "it keeps no weights" in refused.value.details()
        finally:
            await channel.close()
            await client.close()


async def test_a_replica_stays_in_the_tree_between_versions_and_keyframes_never_come_from_changing_weights(
        tmp_path: Path) -> None:
    async with cluster(tmp_path, fanout=2, replicas=1) as c:
        [replica] = c.replicas
        joins: list[str] = []
        tree = c.tree
        join = tree.join

        def counted(replica_id: str, **kwargs: object) -> object:
            joins.append(replica_id)
            return join(replica_id, **kwargs)  # type: ignore[arg-type]

        tree.join = counted  # type: ignore[method-assign]
        tree.lease_s = 3.0  # renewed every second: three joins with no version published meanwhile
        replica.tree.current.lease_s = 3.0  # type: ignore[union-attr]
        stop = asyncio.Event()
        renewing = asyncio.create_task(replica.tree.keep_joined(stop))
        await until(lambda: joins.count("r0") >= 3, what="three renewals")
        stop.set()
        await renewing
        assert "r0" in tree.members

        # The held weights change in place as the next delta is applied: from then on no keyframe is
        # made of them (NOT_FOUND: the child goes to the publisher), and one made before is kept.
        first = random_weights(1)
        await c.pusher.push(first, step=1)
        await replica.sync(1)
        holdings = replica.holdings
        keyframe = await holdings.payload_for(MODEL, have=0, want=1, wait_s=5)
        await holdings.release_weights(MODEL)
        assert await holdings.payload_for(MODEL, have=0, want=1, wait_s=5) is keyframe
        await c.pusher.push(perturbed(first, 2), step=2)
        await replica.sync(2)  # releases version 1's weights before applying, holds version 2's after
        await holdings.release_weights(MODEL)
        with pytest.raises(NotHeld, match="keeps no weights"):
            await holdings.payload_for(MODEL, have=0, want=2, wait_s=5)


async def test_a_relay_serves_only_calls_with_the_publishers_token_and_deeper_replicas_wait_longer(
        tmp_path: Path) -> None:
    holdings = RelayHoldings()
    server, port = await start_relay_server(RelayServicer(holdings, wait_s=5), host="127.0.0.1", port=0,
                                            bearer_token="s3cret")
    first = random_weights(1)
    async with cluster(tmp_path, fanout=2, replicas=0) as c:
        await c.pusher.push(first, step=1)
        await holdings.hold(await c.pusher.client.fetch(MODEL, want_version=1), first)
    anonymous = WeightClient(f"127.0.0.1:{port}", deadline_s=10)
    tree = TreeSync(WeightClient("127.0.0.1:1"), model=MODEL, replica="child", parent_deadline_s=7.0,
                    bearer_token="s3cret")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anonymous.fetch(MODEL, want_version=1)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The tree's client to a parent carries the token, its deadline the parent's depth's.
        deep = tree._parent(weights_pb2.TreePlacement(parent="p", parent_endpoint=f"127.0.0.1:{port}", depth=4))
        assert deep.deadline_s == 3 * 7.0
        fetched = await deep.fetch(MODEL, want_version=1)
        assert fetched.header.version == 1 and fetched.header.manifest_hash == first.manifest_hash
        assert tree._parent(weights_pb2.TreePlacement(parent="p", parent_endpoint=f"127.0.0.1:{port}",
                                                      depth=2)).deadline_s == 7.0
    finally:
        await anonymous.close()
        await tree.close()
        await tree.publisher.close()
        await server.stop(None)
