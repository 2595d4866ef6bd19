"""The weight-update group: a torch.distributed group of its own between the learner (rank 0)
and every engine rank, and the receiving side of one broadcast.

The group is built from a TCPStore directly (rank 0 hosts it), never through
`init_process_group` or `_new_process_group_helper`: the learner's own default group (FSDP2) and
torch's registry of groups are left untouched, and torchrun's agent store
(`TORCHELASTIC_USE_AGENT_STORE`, which would make `rendezvous()` expect a store nobody hosts)
plays no part. The keys it writes mirror what SGLang's `init_custom_process_group` produces on the
engine side (`rendezvous("tcp://…")` → `PrefixStore(group_name)` → torch's
`PrefixStore(f"{group_name}/")` → `PrefixStore(f"{device}/")` with one backend for the first
device the backend supports: "cpu/" for gloo, "cuda/" for nccl), so a sender built here meets a
real SGLang engine in the same store namespace.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from policyloop.weights.broadcast.engine_control import BACKENDS, DEFAULT_GROUP_NAME
from policyloop.weights.broadcast.layout import FLATTENED_BUCKET, Bucket, TensorSpec, unflatten_bucket

T = TypeVar("T")



class WeightGroupError(RuntimeError):
    """The weight-update group cannot be formed or used (bad backend, no CUDA, out of step)."""



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
