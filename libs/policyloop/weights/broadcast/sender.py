"""The learner's side of the colocated path: it broadcasts its weights to SGLang engines (or
the embedded engine) over the weight-update group, in buckets, driving each engine through the
`EngineControl` protocol (SGLang's routes `/init_weights_update_group`, `/begin_weight_update`,
`/update_weights_from_distributed`, `/end_weight_update` and `/destroy_weights_update_group`).

    sender = DistributedWeightSender(backend="nccl", master_address="10.0.0.5")
    await sender.init([EngineTarget(client, tp_size=2), EngineTarget(other_client, tp_size=2)])
    await sender.send(model_state, weight_version="7")     # every step
    await sender.close()

The group. The sender is rank 0 of a world of 1 + every engine rank; engine i's ranks start at its
`rank_offset` (1 for the first engine, then after the previous engine's tp_size ranks), and each
of an engine's tensor-parallel ranks joins as rank_offset + tp_rank, as SGLang does. The sender
broadcasts each bucket as the uint8 buffer of `layout` (same element type and count on every
rank, as NCCL requires).

Sending. SGLang's HTTP call returns only once the engine has received the bucket, so for every
bucket the sender issues the calls to all engines and the broadcast at the same time. A bucket
is "sent" when every engine answered success and the broadcast completed. SGLang 0.5.23 refuses
a distributed update outside a weight-update session without joining the broadcast, so a send
opens one (`/begin_weight_update`) and closes it (`/end_weight_update`). Each bucket is loaded as
soon as it arrives, so a send of several buckets first pauses generation (`in_place` by default:
requests keep their state and continue on the new weights, as with update_weights_from_disk) and
continues it after the last bucket; `weight_version` travels with the last bucket only, so no
engine reports the new version before it holds every tensor.

Failures. A distributed update cannot be retried blindly: an engine that receives a request twice
waits for a broadcast the sender will not repeat. A failed send raises WeightSyncError and
leaves the engines paused (part of the buckets may have loaded: serving them under the old
version would mislabel tokens); the next successful send, or the caller's continue_generation
after repairing the weights (e.g. update_weights_from_disk), resumes them. When an engine failed
before taking part in a broadcast, the sender's broadcast is still waiting for it: the group is out
of step and every later send refuses until `close()` and `init()` build a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from policyloop.common.ports import free_port
from policyloop.weights.broadcast.engine_control import (
    BACKENDS,
    DEFAULT_GROUP_NAME,
    PAUSE_MODES,
    BackendName,
    EngineControl,
    EngineControlError,
    WeightSyncError,
)
from policyloop.weights.broadcast.group import (
    WeightGroupError,
    WeightUpdateGroup,
    check_backend,
    in_daemon_thread,
    join_weight_update_group,
)
from policyloop.weights.broadcast.layout import (
    DEFAULT_BUCKET_BYTES,
    FLATTENED_BUCKET,
    Bucket,
    TensorSpec,
    flatten_bucket,
    plan_buckets,
    rank_offsets,
)


@dataclass(frozen=True)
class EngineTarget:
    """An engine to keep in sync: its client and how many ranks it brings (its TP size)."""

    client: EngineControl
    tp_size: int = 1


@dataclass(frozen=True)
class SendStats:
    weight_version: str
    buckets: int
    tensors: int
    nbytes: int
    seconds: float


class DistributedWeightSender:
    """The learner's side of the colocated path (see the module doc). One sender owns one group;
    call `init` once, `send` for every new version, `close` at the end."""

    def __init__(self, *, backend: BackendName = "gloo", master_address: str = "127.0.0.1",
                 master_port: int | None = None, group_name: str = DEFAULT_GROUP_NAME,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0, settle_s: float = 10.0) -> None:
        """`timeout_s` bounds the rendezvous and every broadcast (the group's timeout). `settle_s`:
        after an engine failed a bucket, how long to let this side's broadcast finish before
        calling the group out of step (an engine that failed after receiving lets it finish at
        once; one that never took part keeps it waiting until `timeout_s`)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._engines: list[EngineTarget] = []
        self._group: WeightUpdateGroup | None = None
        self._unsettled: asyncio.Future[None] | None = None  # a broadcast not known to have completed
        self._lock = asyncio.Lock()

    @property
    def world_size(self) -> int:
        return self._group.world_size if self._group is not None else 0

    async def init(self, engines: Sequence[EngineTarget | EngineControl]) -> None:
        """Forms the group: asks every engine to join at its rank offset while joining as rank 0.
        Raises WeightSyncError (an engine refused or could not join) or WeightGroupError (this
        process cannot use the backend, or the group could not be formed)."""
        async with self._lock:
            await self._init(engines)

    async def _init(self, engines: Sequence[EngineTarget | EngineControl]) -> None:
        if self._group is not None:
            raise WeightGroupError("already initialised: close() first")
        targets = [e if isinstance(e, EngineTarget) else EngineTarget(e) for e in engines]
        if not targets:
            raise ValueError("no engines to send to")
        check_backend(self.backend)  # before any engine starts waiting for this process
        offsets, world_size = rank_offsets([t.tp_size for t in targets])
        port = self.master_port or free_port()
        joining = asyncio.ensure_future(in_daemon_thread(lambda: join_weight_update_group(
            master_address=self.master_address, master_port=port, rank=0, world_size=world_size,
            group_name=self.group_name, backend=self.backend, timeout_s=self.timeout_s), "weights-group-join"))
        calls = [asyncio.ensure_future(t.client.init_weights_update_group(
            self.master_address, port, offset, world_size, group_name=self.group_name, backend=self.backend))
            for t, offset in zip(targets, offsets, strict=True)]
        done, _ = await asyncio.wait([joining, *calls], return_when=asyncio.FIRST_EXCEPTION)
        failed = [task for task in done if task.exception() is not None]
        if failed:
            for task in calls:
                task.cancel()
            _settle_later(joining, close_group=True)
            await asyncio.gather(*calls, return_exceptions=True)
            await self._destroy_on([t for t, c in zip(targets, calls, strict=True)
                                    if not c.cancelled() and c.exception() is None])
            raise _first_failure(failed, joining, "joining the weight-update group as rank 0 failed")
        self._group = joining.result()
        self._engines = targets

    async def send(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   weight_version: str, *, pause_mode: str | None = "in_place", flush_cache: bool = False
                   ) -> SendStats:
        """Broadcasts the tensors in buckets and makes `weight_version` the engines' version.

        `pause_mode` pauses generation for the whole send (None: do not pause; a send of several
        buckets is then served half-updated between buckets). `flush_cache` asks the engines to
        drop their prefix cache after the last bucket; SGLang refuses that, failing the update,
        while requests are held, so use it with pause_mode "abort" or idle engines. Tensors are
        sent with their own dtype (the engine casts into its parameters) and must be full
        tensors (gather FSDP shards first). One send at a time."""
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be None or one of {PAUSE_MODES}, got {pause_mode!r}")
        async with self._lock:
            group, recovered = self._require_group()
            started = time.perf_counter()
            tensors = self._on_device(named_tensors, group.device)
            buckets = plan_buckets([TensorSpec.of(name, t) for name, t in tensors.items()], self.bucket_bytes)
            clients = [t.client for t in self._engines]
            if recovered:  # close what the earlier failed send left open (an engine without one says so)
                await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
            if pause_mode is not None:
                await _all(c.pause_generation(pause_mode) for c in clients)
            try:
                await _all(c.begin_weight_update() for c in clients)
                for index, bucket in enumerate(buckets):
                    last = index == len(buckets) - 1
                    await self._send_bucket(group, bucket, tensors, flush_cache=flush_cache and last,
                                            weight_version=str(weight_version) if last else None)
            except BaseException as exc:
                if self._unsettled is None:  # members in step: close the sessions that were opened
                    await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
                if not isinstance(exc, EngineControlError | WeightGroupError):
                    raise
                state = ("the group is out of step: close() and init() again" if self._unsettled is not None
                         else "the group is still usable")
                paused = "; the engines stay paused" if pause_mode is not None else ""
                raise WeightSyncError(f"sending weight version {weight_version} failed: {exc} ({state}{paused}; "
                                        f"buckets sent before the failure are loaded)") from exc
            await _all(c.end_weight_update() for c in clients)
            if pause_mode is not None:
                await _all(c.continue_generation() for c in clients)
            return SendStats(str(weight_version), len(buckets), len(tensors), sum(b.nbytes for b in buckets),
                             time.perf_counter() - started)

    async def close(self) -> None:
        """Destroys the group on every engine and here. Raises WeightSyncError afterwards when
        an engine could not destroy its side, or when the group was out of step: an engine still
        waiting in a broadcast answers only at its timeout, so it is not asked (it keeps the group
        name until then: a new sender should use another group_name)."""
        async with self._lock:
            group, self._group = self._group, None
            engines, self._engines = self._engines, []
            unsettled, self._unsettled = self._unsettled, None
            if group is None:
                return
            in_step = unsettled is None or (unsettled.done() and not unsettled.cancelled()
                                            and unsettled.exception() is None)
            errors: list[BaseException] = []
            if in_step:
                results = await asyncio.gather(*(t.client.destroy_weights_update_group(self.group_name)
                                                  for t in engines), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
            if unsettled is not None and not unsettled.done():
                _settle_later(unsettled, close_group=False, then=group.close)  # close once it gives up
            else:
                group.close()
            if not in_step:
                raise WeightSyncError(f"the weight-update group {self.group_name!r} was out of step: the engines "
                                        f"were not asked to destroy it")
            if errors:
                raise WeightSyncError(f"destroying the weight-update group failed on {len(errors)} engine(s): "
                                        f"{errors[0]}")

    # -- internals -----------------------------------------------------------------------------

    def _require_group(self) -> tuple[WeightUpdateGroup, bool]:
        """The group, and whether a broadcast given up on has completed since (the sessions of
        that send were then left open)."""
        if self._group is None:
            raise WeightGroupError("not initialised: call init() first")
        if self._unsettled is None:
            return self._group, False
        if not self._unsettled.done() or self._unsettled.cancelled() or self._unsettled.exception() is not None:
            raise WeightGroupError("a previous broadcast did not complete: the group is out of step; "
                                   "close() and init() again")
        self._unsettled = None  # it completed after all: every member received it, they are in step
        return self._group, True

    @staticmethod
    def _on_device(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   device: torch.device) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in items:
            if isinstance(tensor, DTensor):
                raise TypeError(f"{name!r} is a DTensor shard: send full tensors (e.g. tensor.full_tensor())")
            if name in tensors:
                raise ValueError(f"{name!r} is given twice")
            tensors[name] = tensor.detach().to(device)
        if not tensors:
            raise ValueError("no tensors to send")
        return tensors

    async def _send_bucket(self, group: WeightUpdateGroup, bucket: Bucket, tensors: Mapping[str, torch.Tensor], *,
                           weight_version: str | None, flush_cache: bool) -> None:
        """One bucket: the HTTP calls to every engine and the broadcast, at the same time."""
        # Flattening copies up to bucket_bytes: done on the broadcast's thread, off the event loop.
        broadcast = asyncio.ensure_future(in_daemon_thread(
            lambda: group.broadcast(flatten_bucket(bucket, tensors, group.device), src=0), "weights-broadcast"))
        calls = [asyncio.ensure_future(t.client.update_weights_from_distributed(
            bucket.names, bucket.dtype_names, bucket.shapes, group_name=self.group_name,
            load_format=FLATTENED_BUCKET, weight_version=weight_version, flush_cache=flush_cache))
            for t in self._engines]
        try:
            done, _ = await asyncio.wait([broadcast, *calls], return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled: whether the members are in step is unknown
            self._abandon(broadcast, calls)
            raise
        failed = [task for task in done if task.exception() is not None]
        if not failed:
            return
        if not broadcast.done():  # the failure may have come after the engine received its bytes
            await asyncio.wait({broadcast}, timeout=self.settle_s)
        if broadcast.done() and broadcast.exception() is None:
            # Every engine has its bytes: the others are only loading them; hear them out.
            await asyncio.gather(*calls, return_exceptions=True)
        else:
            self._abandon(broadcast, calls)
        raise _first_failure(failed, broadcast, "the broadcast failed")

    def _abandon(self, broadcast: asyncio.Future[None], calls: list[asyncio.Future]) -> None:
        for call in calls:
            call.cancel()
        if not (broadcast.done() and not broadcast.cancelled() and broadcast.exception() is None):
            self._unsettled = broadcast
            broadcast.add_done_callback(_retrieve)

    async def _destroy_on(self, targets: Sequence[EngineTarget]) -> None:
        """Best effort after a failed init: engines that joined leave the half-formed group."""
        await asyncio.gather(*(t.client.destroy_weights_update_group(self.group_name) for t in targets),
                             return_exceptions=True)


def _first_failure(failed: list[asyncio.Future], local: asyncio.Future, what: str) -> BaseException:
    """The exception to raise: an engine's answer when there is one (it says more), else the
    local collective's, as a WeightGroupError."""
    engine_errors = [exc for f in failed if f is not local and (exc := f.exception()) is not None]
    if engine_errors:
        return engine_errors[0]
    exc = local.exception()
    assert exc is not None
    if isinstance(exc, WeightGroupError):
        return exc
    error = WeightGroupError(f"{what}: {exc}")
    error.__cause__ = exc
    return error


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: a broadcast that failed late is expected here


def _settle_later(future: asyncio.Future, *, close_group: bool, then: Callable[[], None] | None = None) -> None:
    """Cleans up after a join or broadcast that nobody waits for any more, once it ends."""

    def done(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None and close_group:
            result = f.result()
            if isinstance(result, WeightUpdateGroup):
                result.close()
        if then is not None:
            then()

    future.add_done_callback(done)


async def _all(calls: Iterable[object]) -> None:
    """Awaits every call; raises the first failure after all of them ended."""
    results = await asyncio.gather(*calls, return_exceptions=True)  # type: ignore[arg-type]
    for result in results:
        if isinstance(result, BaseException):
            raise result
