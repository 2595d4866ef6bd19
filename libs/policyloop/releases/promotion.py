"""Promotions: which version of a run its serving deployment serves. Each run's promotions and
rollbacks are a log on PROMOTIONS (pl.promotions.<run>); serving replicas follow its newest
message. A promotion is appended only on top of the one its sequence was counted from
(Nats-Expected-Last-Subject-Sequence), so two promoters at once never both become sequence n.
Before a version is announced the publisher is told to keep it, so a rollback can return to it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import grpc
import nats.js.errors

from policyloop.bus import Bus, promotions_subject, weights_subject
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2, loop_pb2, weights_pb2
from policyloop.releases.evals import EvalStore
from policyloop.releases.verdict import ROLLBACK
from policyloop.rl.settings import run_policy_model
from policyloop.state.catalog import RunRegistry
from policyloop.weights.client import WeightClient

PROMOTIONS_STREAM = "PROMOTIONS"
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check



Refusal = Literal["invalid_argument", "failed_precondition", "not_found"]


class PromotionRefused(Exception):
    """The promotion cannot be made as asked; `field` names what the caller got wrong and `kind`
    says how (the gRPC status it answers with)."""

    def __init__(self, field: str, message: str, kind: Refusal = "failed_precondition") -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.kind = field, kind


class PromotionLog:
    """A run's promotions on PROMOTIONS, newest last."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def current(self, run_id: str) -> tuple[int, loop_pb2.Promotion | None]:
        """(stream sequence of the newest promotion, that promotion); (0, None) before the first."""
        try:
            msg = await self.bus.js.get_last_msg(PROMOTIONS_STREAM, promotions_subject(run_id))
        except nats.js.errors.NotFoundError:
            return 0, None
        return msg.seq, loop_pb2.Promotion.FromString(msg.data or b"")

    async def history(self, run_id: str) -> list[loop_pb2.Promotion]:
        return [loop_pb2.Promotion.FromString(msg.data)
                async for _, msg in self.bus.read(PROMOTIONS_STREAM, promotions_subject(run_id))]

    async def append(self, promotion: loop_pb2.Promotion, after_seq: int) -> bool:
        """Appends `promotion` if the run's newest promotion is still the one at `after_seq`;
        False when another promotion came first (count again)."""
        try:
            await self.bus.publish(promotions_subject(promotion.run_id), promotion,
                                   f"{promotion.run_id}:{promotion.sequence}:{uuid.uuid4().hex}",
                                   headers={EXPECTED_LAST_SUBJECT_SEQUENCE: str(after_seq)})
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise
        return True


@dataclass(frozen=True)
class Promoter:
    """Promotes and rolls back versions of runs: by hand (the gateway's RPCs) or by rule (the evaluator)."""

    bus: Bus
    runs: RunRegistry
    evals: EvalStore
    publisher: Callable[[str], WeightClient]  # a client of the publisher at an endpoint

    async def policy_model(self, run_id: str) -> str:
        definition = await self.runs.definition(run_id)
        if definition is None:
            raise PromotionRefused("run_id", f"no run {run_id}", "not_found")
        return run_policy_model(run_id, definition)

    async def promote(self, run_id: str, version: int, reason: str, *, force: bool = False) -> loop_pb2.Promotion:
        """Serves `version` (0: the newest evaluated version that did not regress)."""
        model = await self.policy_model(run_id)
        if version == 0:
            passing = [e for e in await self.evals.all(run_id) if not e.regressed]
            if not passing:
                raise PromotionRefused("version", "no evaluated version of the run passes the regression rule; "
                                                  "name one")
            version = passing[-1].version
        elif version < 0:
            raise PromotionRefused("version", "must be positive (0: the newest that passed its evaluation)",
                                   "invalid_argument")
        result = await self.evals.get(run_id, version)
        if result is not None and result.regressed and not force:
            raise PromotionRefused("version", f"version {version} regressed (pass rate {result.pass_rate:.3f}, "
                                              f"below version {result.best_version}'s); set force to promote it")
        return await self._announce(run_id, model, version, reason or "by hand")

    async def rollback(self, run_id: str, version: int, reason: str) -> loop_pb2.Promotion:
        """Serves an earlier version again: `version`, or (0) the one promoted before the current one."""
        model = await self.policy_model(run_id)
        if version < 0:
            raise PromotionRefused("version", "must be positive (0: the version promoted before the current one)",
                                   "invalid_argument")
        if version == 0:
            history = await PromotionLog(self.bus).history(run_id)
            if not history:
                raise PromotionRefused("run_id", "nothing was promoted yet: there is nothing to roll back")
            current = history[-1].version
            earlier = [p.version for p in history if p.version != current]
            if not earlier:
                raise PromotionRefused("version", f"only version {current} was ever promoted; name a version")
            version = earlier[-1]
        return await self._announce(run_id, model, version, f"{ROLLBACK}: {reason}" if reason else ROLLBACK)

    async def _announce(self, run_id: str, model: str, version: int, reason: str) -> loop_pb2.Promotion:
        endpoint = await self._publisher_endpoint(model)
        try:
            info = await self.publisher(endpoint).keep_version(model, version, f"promoted for {run_id}")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise PromotionRefused("version", f"the publisher does not hold version {version} of {model} "
                                                  f"({exc.details()})", "not_found") from exc
            raise
        weights = bus_pb2.WeightsPublished(
            model=model, version=version, manifest_hash=info.manifest_hash, codec=info.codec,
            fetch_endpoint=endpoint, step=info.step, published_unix_ms=info.created_unix_ms, run_id=run_id,
            trained_unix_ms=info.trained_unix_ms)
        log = PromotionLog(self.bus)
        for _ in range(20):
            seq, current = await log.current(run_id)
            promotion = loop_pb2.Promotion(
                run_id=run_id, model=model, version=version, reason=reason, promoted_unix_ms=now_ms(),
                sequence=(current.sequence if current else 0) + 1, weights=weights,
                previous_version=current.version if current else 0)
            if await log.append(promotion, seq):
                return promotion
            await asyncio.sleep(0.05)
        raise RuntimeError(f"promotions of {run_id} kept changing: 20 attempts lost the race")

    async def held_versions(self, model: str) -> list[weights_pb2.VersionInfo]:
        """The versions of `model` the publisher holds now, oldest first."""
        return await self.publisher(await self._publisher_endpoint(model)).list_versions(model)

    async def _publisher_endpoint(self, model: str) -> str:
        """The publisher that announced the model's versions (its newest announcement on WEIGHTS)."""
        try:
            msg = await self.bus.js.get_last_msg("WEIGHTS", weights_subject(model))
        except nats.js.errors.NotFoundError:
            raise PromotionRefused("version", f"no version of {model} was ever published") from None
        return bus_pb2.WeightsPublished.FromString(msg.data or b"").fetch_endpoint
