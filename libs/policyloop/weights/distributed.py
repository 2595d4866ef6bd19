"""The colocated weight-sync path: the learner broadcasts its weights to SGLang engines (or the
embedded engine) over a torch.distributed group of its own, in buckets, driven by SGLang's HTTP
routes `/init_weights_update_group`, `/begin_weight_update`, `/update_weights_from_distributed`,
`/end_weight_update` and `/destroy_weights_update_group`.

    sender = DistributedWeightSender(backend="nccl", master_address="10.0.0.5")
    await sender.init([EngineTarget(client, tp_size=2), EngineTarget(other_client, tp_size=2)])
    await sender.send(model_state, weight_version="7")     # every step
    await sender.close()

The group. The sender is rank 0 of a world of 1 + every engine rank; engine i's ranks start at its
`rank_offset` (1 for the first engine, then after the previous engine's tp_size ranks), and each
of an engine's tensor-parallel ranks joins as rank_offset + tp_rank, as SGLang does. The group is
built from a TCPStore directly (the sender hosts it), never through `init_process_group` or
`_new_process_group_helper`: the learner's own default group (FSDP2) and torch's registry of groups
are left untouched, and torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE`, which would make
`rendezvous()` expect a store nobody hosts) plays no part. The keys it writes mirror what SGLang's
`init_custom_process_group` produces on the engine side (`rendezvous("tcp://…")` → `PrefixStore(
group_name)` → torch's `PrefixStore(f"{group_name}/")` → `PrefixStore(f"{device}/")` with one
backend for the first device the backend supports: "cpu/" for gloo, "cuda/" for nccl), so a
sender built here meets a real SGLang engine in the same store namespace.

The layout ("flattened_bucket"). SGLang 0.5.23 receives `load_format="flattened_bucket"` with
`FlattenedTensorBucket.empty(names, dtypes, shapes)`: one 1-D torch.uint8 buffer of the summed
byte sizes, every tensor's raw bytes back to back in the order of `names`, no padding, and it
refuses a tensor whose byte offset is not a multiple of its dtype's size; it broadcasts that
buffer from rank 0 and views each slice as `dtype` and `shape`. The sender here broadcasts exactly
such a uint8 buffer (same element type and count on every rank, as NCCL requires), and the
planner puts one dtype in each bucket, so every offset is aligned by construction and the bucket
means the same to older SGLang releases that concatenated tensors of the bucket's dtype.

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
waits for a broadcast the sender will not repeat. A failed send raises WeightUpdateError and
leaves the engines paused (part of the buckets may have loaded: serving them under the old
version would mislabel tokens); the next successful send, or the caller's continue_generation
after repairing the weights (e.g. update_weights_from_disk), resumes them. When an engine failed
before taking part in a broadcast, the sender's broadcast is still waiting for it: the group is out
of step and every later send refuses until `close()` and `init()` build a new one.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from policyloop.common.ports import free_port
from policyloop.engines.protocol import PAUSE_MODES
from policyloop.engines.sglang_client import EngineError, SGLangClient, WeightUpdateError

T = TypeVar("T")

FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's load_format for a bucket broadcast as one flattened uint8 buffer."""

DEFAULT_GROUP_NAME = "weight_update_group"
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
BackendName = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl")


class WeightGroupError(RuntimeError):
    """The weight-update group cannot be formed or used (bad backend, no CUDA, out of step)."""


# ---------------------------------------------------------------------------------------------
# Dtype names on the wire: SGLang resolves them with getattr(torch, name).


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16" (what SGLang's receiver passes to getattr(torch, …))."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" → torch.bfloat16; ValueError for a name that is not a torch dtype."""
    value = getattr(torch, name, None) if name and not name.startswith("_") else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


# ---------------------------------------------------------------------------------------------
# Bucket planning and byte layout (pure).


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate a tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(int(d) for d in tensor.shape))


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a bucket and where its bytes sit in the flattened buffer."""

    spec: TensorSpec
    offset: int  # in bytes, from the start of the buffer

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast together as one uint8 buffer: each one's bytes at `offset`, back to
    back in order, `nbytes` in all (SGLang's FlattenedTensorBucket layout)."""

    entries: tuple[BucketEntry, ...]
    nbytes: int

    @classmethod
    def layout(cls, specs: Sequence[TensorSpec]) -> Bucket:
        """Lays `specs` out in order. Raises ValueError for an empty bucket, a negative dimension,
        or a tensor whose offset is not a multiple of its element size (SGLang refuses those:
        the receiver views each slice as its dtype)."""
        if not specs:
            raise ValueError("a bucket needs at least one tensor")
        entries = []
        offset = 0
        for spec in specs:
            if any(d < 0 for d in spec.shape):
                raise ValueError(f"{spec.name!r}: negative dimension in shape {spec.shape}")
            if offset % spec.dtype.itemsize:
                raise ValueError(f"{spec.name!r}: byte offset {offset} is not aligned to its {dtype_name(spec.dtype)} "
                                 f"elements ({spec.dtype.itemsize} bytes)")
            entries.append(BucketEntry(spec, offset))
            offset += spec.nbytes
        return cls(tuple(entries), offset)

    @property
    def specs(self) -> list[TensorSpec]:
        return [e.spec for e in self.entries]

    @property
    def names(self) -> list[str]:
        return [e.spec.name for e in self.entries]

    @property
    def dtype_names(self) -> list[str]:
        return [dtype_name(e.spec.dtype) for e in self.entries]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(e.spec.shape) for e in self.entries]


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Groups tensors into buckets of at most `bucket_bytes`, one dtype per bucket.

    Tensors keep their order within each dtype (one bucket per dtype fills at a time); a bucket
    is emitted when the next tensor of its dtype would not fit, and a tensor larger than the
    limit goes alone into its own bucket. Buckets come out in the order they were closed, the
    ones still open at the end last (in the order their dtype first appeared)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    open_buckets: dict[torch.dtype, list[TensorSpec]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    planned: list[Bucket] = []
    for spec in specs:
        current = open_buckets.setdefault(spec.dtype, [])
        if current and open_bytes[spec.dtype] + spec.nbytes > bucket_bytes:
            planned.append(Bucket.layout(current))
            current = open_buckets[spec.dtype] = []
        if spec.nbytes > bucket_bytes:  # too big for any bucket: alone (after what came before it)
            planned.append(Bucket.layout([spec]))
            continue
        current.append(spec)
        open_bytes[spec.dtype] = sum(s.nbytes for s in current)
    planned.extend(Bucket.layout(rest) for rest in open_buckets.values() if rest)
    return planned


def flatten_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
                   ) -> torch.Tensor:
    """The bucket's uint8 buffer: each tensor's raw bytes (contiguous, native byte order) at its
    offset. `tensors` must hold every entry's name with the planned dtype and shape."""
    first = tensors[bucket.entries[0].spec.name] if bucket.entries else None
    target = torch.device(device) if device is not None else (first.device if first is not None else "cpu")
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=target)
    for entry in bucket.entries:
        spec = entry.spec
        tensor = tensors.get(spec.name)
        if tensor is None:
            raise KeyError(f"{spec.name!r}: no tensor given for this bucket entry")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{spec.name!r}: planned {dtype_name(spec.dtype)}{list(spec.shape)}, got "
                             f"{dtype_name(tensor.dtype)}{list(tensor.shape)}")
        buffer[entry.offset:entry.end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unflatten_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received buffer, in bucket order: views into `buffer` (no copy),
    with each entry's dtype and shape and exactly the bytes that were sent."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != bucket.nbytes:
        raise ValueError(f"expected a 1-D uint8 buffer of {bucket.nbytes} bytes, got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    return [(e.spec.name, buffer[e.offset:e.end].view(e.spec.dtype).reshape(e.spec.shape)) for e in bucket.entries]


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each engine's first rank and the world size, with the sender as rank 0: engines with
    tp_sizes [2, 2] get offsets [1, 3] in a world of 5."""
    if any(tp < 1 for tp in tp_sizes):
        raise ValueError(f"tp sizes must be >= 1, got {list(tp_sizes)}")
    offsets = []
    next_rank = 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


# ---------------------------------------------------------------------------------------------
# The process group.


def _backend_device(backend: str) -> str:
    # torch registers a single backend object for a backend string whose devices all map to it,
    # under the store prefix of the first device it supports ("cpu" for gloo, "cuda" for nccl).
    return dist.Backend.backend_capability[backend][0]


@dataclass(eq=False)
class WeightUpdateGroup:
    """One member's handle on the weight-update group: broadcast from rank 0, then `close()`.
    Tensors to broadcast must live on `device` (CPU for gloo, the current CUDA device for nccl)."""

    rank: int
    world_size: int
    backend: str
    group_name: str
    device: torch.device
    _store: dist.Store
    _pg: C10dBackend | None  # ProcessGroupGloo / ProcessGroupNCCL, used directly (no ProcessGroup wrapper)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocks until `tensor` holds rank `src`'s bytes on this member (a collective: every
        member must call it in the same order)."""
        if self._pg is None:
            raise WeightGroupError(f"weight-update group {self.group_name!r} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._pg.broadcast([tensor], options).wait()
        if tensor.device.type == "cuda":  # NCCL's wait() only orders the stream: wait for the bytes
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Releases the connections (does not wait for peers)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()


def check_backend(backend: str) -> None:
    """Raises WeightGroupError unless this process can use `backend` for the group."""
    if backend not in BACKENDS:
        raise WeightGroupError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise WeightGroupError("backend 'nccl' needs CUDA and a torch build with NCCL; use 'gloo' on CPU")


def join_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo",
                             timeout_s: float = 600.0) -> WeightUpdateGroup:
    """Joins (rank 0: hosts) the group; blocks until every member has joined or `timeout_s`.

    Builds the backend directly on a TCPStore, with SGLang's key layout (see the module doc),
    so the caller's default process group, if any, is neither needed nor touched."""
    check_backend(backend)
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is outside a world of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    device_type = _backend_device(backend)
    prefixed = dist.PrefixStore(f"{device_type}/", dist.PrefixStore(f"{group_name}/",
                                                                     dist.PrefixStore(group_name, store)))
    pg: C10dBackend
    if backend == "gloo":
        gloo = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        gloo._set_sequence_number_for_group()
        pg, device = gloo, torch.device("cpu")
    else:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = []
        options.group_name = group_name
        nccl = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        nccl._set_sequence_number_for_group()
        pg, device = nccl, torch.device("cuda", torch.cuda.current_device())
    return WeightUpdateGroup(rank, world_size, backend, group_name, device, store, pg)


def receive_named_tensors(group: WeightUpdateGroup, specs: Sequence[TensorSpec], load_format: str | None
                          ) -> list[tuple[str, torch.Tensor]]:
    """The receiving side of one update_weights_from_distributed call, as SGLang does it: one
    flattened uint8 buffer for "flattened_bucket", otherwise one broadcast per tensor in order.
    Blocks until the data arrived; the tensors are on `group.device`."""
    if load_format == FLATTENED_BUCKET:
        bucket = Bucket.layout(specs)
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer, src=0)
        return unflatten_bucket(bucket, buffer)
    received = []
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=group.device)
        group.broadcast(tensor, src=0)
        received.append((spec.name, tensor))
    return received


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """Runs blocking `fn` on a new daemon thread and awaits its result. A collective that waits
    for a peer that never comes blocks until the group's timeout; on a daemon thread it cannot
    keep the process from exiting (executor threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: object) -> None:
        if future.done():  # the awaiting task was cancelled: nobody wants the answer
            return
        if ok:
            future.set_result(value)  # type: ignore[arg-type]
        else:
            future.set_exception(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[bool, object] = (True, fn())
        except BaseException as exc:  # handed to the awaiting task
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop is closed
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


# ---------------------------------------------------------------------------------------------
# The sender (learner side).


@dataclass(frozen=True)
class EngineTarget:
    """An engine to keep in sync: its client and how many ranks it brings (its TP size)."""

    client: SGLangClient
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

    async def init(self, engines: Sequence[EngineTarget | SGLangClient]) -> None:
        """Forms the group: asks every engine to join at its rank offset while joining as rank 0.
        Raises WeightUpdateError (an engine refused or could not join) or WeightGroupError (this
        process cannot use the backend, or the group could not be formed)."""
        async with self._lock:
            await self._init(engines)

    async def _init(self, engines: Sequence[EngineTarget | SGLangClient]) -> None:
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
                if not isinstance(exc, EngineError | WeightGroupError):
                    raise
                state = ("the group is out of step: close() and init() again" if self._unsettled is not None
                         else "the group is still usable")
                paused = "; the engines stay paused" if pause_mode is not None else ""
                raise WeightUpdateError(f"sending weight version {weight_version} failed: {exc} ({state}{paused}; "
                                        f"buckets sent before the failure are loaded)") from exc
            await _all(c.end_weight_update() for c in clients)
            if pause_mode is not None:
                await _all(c.continue_generation() for c in clients)
            return SendStats(str(weight_version), len(buckets), len(tensors), sum(b.nbytes for b in buckets),
                             time.perf_counter() - started)

    async def close(self) -> None:
        """Destroys the group on every engine and here. Raises WeightUpdateError afterwards when
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
                raise WeightUpdateError(f"the weight-update group {self.group_name!r} was out of step: the engines "
                                        f"were not asked to destroy it")
            if errors:
                raise WeightUpdateError(f"destroying the weight-update group failed on {len(errors)} engine(s): "
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
