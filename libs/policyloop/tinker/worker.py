"""The learner's side of the Tinker API: it follows TINKER from the oldest sequence its models'
checkpoints do not cover, applies each request in stream order (compute runs on a worker
thread, one request at a time), publishes the result under the request id, then checkpoints a
model whose weights changed. A request that cannot be decoded goes to the DLQ with the reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from policyloop.bus import Bus, PermanentError, decode_message, tinker_result_subject
from policyloop.bus.deadletter import publish_dead_letter
from policyloop.contracts.v1 import tinker_pb2
from policyloop.rl.settings import adapter_model_name
from policyloop.telemetry.logging import get_logger
from policyloop.tinker.trainer import TinkerRequestError, TinkerTrainer
from policyloop.weights.client import WeightClient
from policyloop.weights.publication import Version, VersionPublication
from policyloop.weights.push import VersionPusher
from policyloop.weights.torch_io import weight_set

log = get_logger(__name__)
T = TypeVar("T")

STREAM = "TINKER"
RESULTS_STREAM = "TINKER_RESULTS"
SUBJECTS = "pl.tinkerreq.>"


class TinkerWorker:
    def __init__(self, bus: Bus, trainer: TinkerTrainer, service: str = "learner", *,
                 publisher: WeightClient | None = None, fetch_endpoint: str = "",
                 weights_model: str = "policy", turns: asyncio.Lock | None = None) -> None:
        """`publisher`: where save_weights_for_sampler publishes adapter versions (under
        `<weights_model>.lora.<model id>`; engines fetch them from `fetch_endpoint`). `turns`: the
        device's lock, taken in turn with the other kinds of run the learner process trains."""
        self.bus, self.trainer, self.service = bus, trainer, service
        self.publisher, self.fetch_endpoint, self.weights_model = publisher, fetch_endpoint, weights_model
        self.publications: dict[str, VersionPublication] = {}
        self.turns = turns or asyncio.Lock()
        self.applied = 0               # requests applied since start (replayed ones included)
        self.position = 0              # the last TINKER sequence handled
        self.replay_until = 0          # the last TINKER sequence stored when this worker started
        self._moved = asyncio.Condition()

    async def run(self, stop: asyncio.Event) -> None:
        """Follows TINKER until `stop`. A request whose result cannot be published, or that fails
        in a way no check foresaw, ends it (after publishing that failure as the request's
        result): the learner restarts from its checkpoints, and the replay skips the requests
        whose stored result is a failure (they changed nothing)."""
        start = await self._compute(self.trainer.restore_all)
        self.position = start - 1
        info = await self.bus.js.stream_info(STREAM)
        self.replay_until = info.state.last_seq  # requests before a restart may have results already
        log.info("tinker_worker_started", from_seq=start, replay_until=self.replay_until,
                 models=len(self.trainer.models))
        while not stop.is_set():
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                        opt_start_seq=self.position + 1)
            try:
                sub = await self.bus.js.subscribe(SUBJECTS, stream=STREAM, ordered_consumer=True, config=config)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("tinker_subscribe_retry", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            try:
                while not stop.is_set():
                    try:
                        msg = await sub.next_msg(timeout=0.5)
                    except TimeoutError:
                        continue
                    except nats.errors.Error as exc:  # the connection went: resume after the last handled
                        log.warning("tinker_follow_retry", error=repr(exc))
                        await asyncio.sleep(0.5)
                        break
                    await self.handle(msg)
            finally:
                try:
                    await sub.unsubscribe()
                except (TimeoutError, nats.errors.Error):
                    pass

    async def handle(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.position:
            return  # delivered again after a resubscription
        try:
            request = decode_message(msg, tinker_pb2.TinkerRequest)
            if not request.request_id or not request.model_id or request.WhichOneof("op") is None:
                raise PermanentError("a TinkerRequest needs request_id, model_id and an op")
        except PermanentError as exc:
            await publish_dead_letter(self.bus, origin_stream=STREAM, origin_subject=msg.subject, stream_seq=seq,
                                      consumer="", payload=msg.data, headers=msg.headers, reason=str(exc),
                                      kind="malformed", delivery_count=1, service=self.service)
            await self._advance(seq)
            return
        if not self.trainer.covers(request.model_id, seq) and not await self._failed_before(request, seq):
            try:
                if request.WhichOneof("op") == "save_weights" and request.save_weights.for_sampler and self.publisher:
                    result = await self._publish_for_sampler(request, seq)
                else:
                    result = await self._compute(self.trainer.apply, request, seq)
            except Exception as exc:
                # The model's memory may hold half of it (gradients of some micro-batches): the
                # failure is the request's result, and the learner starts again from checkpoints.
                log.error("tinker_request_crashed", seq=seq, model=request.model_id, error=repr(exc))
                failed = tinker_pb2.TinkerResult(request_id=request.request_id, model_id=request.model_id,
                                                 error=tinker_pb2.TinkerError(message=f"the learner failed: {exc!r}",
                                                                              category="server"))
                await self.bus.publish(tinker_result_subject(request.request_id), failed, f"tinker-result-{seq}")
                raise
            await self.bus.publish(tinker_result_subject(request.request_id), result, f"tinker-result-{seq}")
            await self._compute(self.trainer.commit, request.model_id)
            self.applied += 1
            log.info("tinker_applied", seq=seq, model=request.model_id, op=request.WhichOneof("op"),
                     error=result.error.message if result.HasField("error") else None)
        await self._advance(seq)

    async def _failed_before(self, request: tinker_pb2.TinkerRequest, seq: int) -> bool:
        """A request replayed after a restart whose result is a failure: it changed nothing then,
        and is not applied again (a failure nothing foresaw would fail again)."""
        if seq > self.replay_until:
            return False
        try:
            stored = await self.bus.js.get_last_msg(RESULTS_STREAM, tinker_result_subject(request.request_id))
        except nats.js.errors.NotFoundError:
            return False
        return tinker_pb2.TinkerResult.FromString(stored.data).HasField("error")

    async def _publish_for_sampler(self, request: tinker_pb2.TinkerRequest, seq: int) -> tinker_pb2.TinkerResult:
        """Publishes the model's adapter as its next sampler version (an exact delta from the last)."""
        result = tinker_pb2.TinkerResult(request_id=request.request_id, model_id=request.model_id)
        try:
            version, tensors, spec = await self._compute(self.trainer.sampler_weights, request.model_id)
        except TinkerRequestError as exc:
            result.error.CopyFrom(tinker_pb2.TinkerError(message=str(exc), category="user"))
            return result
        name = adapter_model_name(self.weights_model, request.model_id)
        publication = self.publications.get(request.model_id)
        if publication is None:
            publication = self.publications[request.model_id] = VersionPublication(
                self.bus, name, request.model_id, self.service,
                pusher=VersionPusher(self.publisher, name, run_id=request.model_id), versions=None)
        try:
            weights = await asyncio.to_thread(weight_set, version, tensors)
            now = time.time_ns()
            await publication.publish(Version(version, version, now, now, ()), weights)
        except Exception as exc:  # noqa: BLE001 - the publisher refused or is gone: the client is told
            log.warning("tinker_sampler_publish_failed", model=request.model_id, error=repr(exc))
            result.error.CopyFrom(tinker_pb2.TinkerError(message=f"publishing the weights failed: {exc}",
                                                         category="server"))
            return result
        self.trainer.published_for_sampler(request.model_id, version, seq)
        path = f"tinker://{request.model_id}/sampler_weights/{request.save_weights.name}" \
            if request.save_weights.name else ""
        result.saved.CopyFrom(tinker_pb2.TinkerSaved(path=path, version=version, weights_model=name,
                                                     fetch_endpoint=self.fetch_endpoint, lora=spec.to_proto()))
        return result

    async def _compute(self, call: Callable[..., T], *args: object) -> T:
        """`call(*args)` on a worker thread, in this worker's turn on the device."""
        async with self.turns:
            return await asyncio.to_thread(call, *args)

    async def _advance(self, seq: int) -> None:
        async with self._moved:
            self.position = seq
            self._moved.notify_all()

    async def reached(self, seq: int, timeout_s: float) -> None:
        """Returns once the request at `seq` is handled (TimeoutError after `timeout_s`)."""
        async with self._moved:
            await asyncio.wait_for(self._moved.wait_for(lambda: self.position >= seq), timeout_s)
