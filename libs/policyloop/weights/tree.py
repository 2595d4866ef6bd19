"""A replica's fetches through the fan-out tree: it joins the tree at the publisher (JoinTree), fetches
each version from the parent it was given, and when that parent dies, lags past
`parent_deadline_s` or sends what does not verify, it reports it (which drops it from the tree),
takes the new placement and fetches again — from a new parent or the publisher. A parent that
only lacks what this replica needs (NOT_FOUND: no keyframe to make) is not reported: that one fetch
goes to the publisher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from policyloop.contracts.v1 import weights_pb2
from policyloop.telemetry.logging import get_logger
from policyloop.telemetry.metrics import WEIGHTS_TREE_FALLBACKS
from policyloop.weights import codec
from policyloop.weights.client import FetchError, WeightClient
from policyloop.weights.fanout import PUBLISHER
from policyloop.weights.relay import RelayHoldings
from policyloop.weights.sync import SyncReport, sync_weights

log = get_logger(__name__)
T = TypeVar("T")


class TreeSync:
    def __init__(self, publisher: WeightClient, *, model: str, replica: str, relay_endpoint: str = "",
                 node: str = "", zone: str = "", parent_deadline_s: float = 30.0, bearer_token: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.publisher = publisher
        self.bearer_token = bearer_token
        self.request = weights_pb2.JoinTreeRequest(model=model, replica=replica, relay_endpoint=relay_endpoint,
                                                   node=node, zone=zone)
        self.parent_deadline_s = parent_deadline_s
        self.clock = clock
        self.current: weights_pb2.TreePlacement | None = None
        self._joined_at = 0.0
        self._parents: dict[str, WeightClient] = {}
        self.fallbacks = 0

    async def placement(self, failed_parent: str = "") -> weights_pb2.TreePlacement:
        """Where to fetch from, joining again when the lease is a third gone (or a parent failed)."""
        current = self.current
        due = current is None or current.lease_s <= 0 or self.clock() - self._joined_at >= current.lease_s / 3
        if failed_parent or due:
            request = weights_pb2.JoinTreeRequest()
            request.CopyFrom(self.request)
            request.failed_parent = failed_parent
            self.current = await self.publisher.join_tree(request)
            self._joined_at = self.clock()
        assert self.current is not None
        return self.current

    async def keep_joined(self, stop: asyncio.Event) -> None:
        """Joins again every third of the lease until `stop`, versions or not (a tree whose
        members joined only to fetch would lapse between versions slower than the lease)."""
        while not stop.is_set():
            lease_s = self.current.lease_s if self.current is not None else 0.0
            if self.current is not None and lease_s <= 0:
                return  # the publisher keeps no tree
            try:
                await self.placement()
            except grpc.aio.AioRpcError as exc:
                log.warning("weights_tree_join_failed", code=exc.code().name, reason=exc.details())
            try:
                await asyncio.wait_for(stop.wait(), max(1.0, (lease_s or 3.0) / 3))
            except TimeoutError:
                continue

    def _parent(self, placement: weights_pb2.TreePlacement) -> WeightClient:
        client = self._parents.get(placement.parent_endpoint)
        if client is None:
            client = self._parents[placement.parent_endpoint] = WeightClient(
                placement.parent_endpoint, bearer_token=self.bearer_token, deadline_s=self.parent_deadline_s)
        # Deeper replicas wait longer: a parent's own fetch may fall back after the deadline of its
        # depth, and its children should not give up on it at that same moment.
        client.deadline_s = self.parent_deadline_s * max(1, placement.depth - 1)
        return client

    async def fetch(self, attempt: Callable[[WeightClient], Awaitable[T]]) -> tuple[T, str]:
        """`attempt` (a fetch and its verification) against the parent, its fetch within the
        parent's deadline; again after each failed parent; at the publisher last. Returns its result
        and the source (a parent's replica id, or PUBLISHER). The deadline is the gRPC call's: a
        payload that arrived is applied and verified to the end, never abandoned half-applied."""
        placement = await self.placement()
        tried: set[str] = set()
        while placement.parent and placement.parent not in tried:
            parent = placement.parent
            tried.add(parent)
            try:
                return await attempt(self._parent(placement)), parent
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # it lacks what this replica needs: not a failure
                    log.info("weights_parent_lacks", parent=parent, reason=exc.details())
                    break
                reason = f"{exc.code().name}: {exc.details()}"
            except (FetchError, codec.CodecError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            self.fallbacks += 1
            WEIGHTS_TREE_FALLBACKS.inc()
            log.warning("weights_parent_failed", parent=parent, reason=reason)
            failed = self._parents.pop(placement.parent_endpoint, None)
            if failed is not None:
                await failed.close()
            placement = await self.placement(failed_parent=parent)
        return await attempt(self.publisher), PUBLISHER

    async def close(self) -> None:
        for client in self._parents.values():
            await client.close()
        self._parents.clear()


async def sync_through_tree(tree: TreeSync, holdings: RelayHoldings | None, model: str, held: codec.WeightSet | None,
                            want_version: int) -> tuple[codec.WeightSet, SyncReport, str]:
    """sync_weights through the tree; the verified version is then held for this replica's own
    children (`holdings`; None: a leaf). Returns the weights, the report and the source."""
    if holdings is not None:
        await holdings.release_weights(model)  # `held` changes in place as the delta is applied
    (weights, report), source = await tree.fetch(lambda client: sync_weights(client, model, held, want_version))
    if holdings is not None and report.fetched is not None:
        await holdings.hold(report.fetched, weights)
    return weights, report, source
