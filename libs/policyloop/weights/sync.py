"""A replica's side of the weights: bring held weights to a new version — a delta when possible,
a keyframe when the delta cannot be applied — and verify every tensor."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from policyloop.contracts.v1 import weights_pb2
from policyloop.telemetry.logging import get_logger
from policyloop.weights import codec
from policyloop.weights.client import FetchedVersion, FetchError, WeightClient, refused

log = get_logger(__name__)


@dataclass(frozen=True)
class SyncReport:
    """How one update went: what came over the wire and where the time went."""

    version: int
    kind: str               # "delta" or "keyframe"
    payload_bytes: int
    raw_bytes: int
    transfer_s: float
    apply_s: float
    fallback_reason: str    # why a delta was refused and a keyframe fetched instead ("" if not)
    # The verified payload itself, which a relaying replica serves on to its children.
    fetched: FetchedVersion | None = field(default=None, repr=False, compare=False)


async def sync_weights(client: WeightClient, model: str, held: codec.WeightSet | None, want_version: int
                       ) -> tuple[codec.WeightSet, SyncReport]:
    """Brings `held` (None: nothing yet) to `want_version` (0: newest) and verifies every tensor.

    A delta that cannot be applied — wrong base, hash mismatch, damaged or truncated payload,
    unknown tensor, changed shape — or that the publisher refuses to serve (DATA_LOSS: the
    publisher lost what it needs) leaves `held` untouched (codec.apply is all or nothing); the
    error is logged with its reason and a keyframe is fetched instead. A keyframe that fails the
    same checks raises: there is nothing better to fall back to, and the caller keeps serving."""
    fallback = ""
    have = held.version if held is not None else 0
    while True:
        started = time.monotonic()
        try:
            fetched = await client.fetch(model, have_version=have, want_version=want_version)
        except FetchError as exc:
            if have == 0:
                raise
            fallback, have = f"transfer: {exc}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        except grpc.aio.AioRpcError as exc:
            if have == 0 or not refused(exc) or exc.code() == grpc.StatusCode.NOT_FOUND:
                raise
            fallback, have = f"publisher: {exc.code().name}: {exc.details()}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        transfer_s = time.monotonic() - started
        started = time.monotonic()
        try:
            check_labels(fetched, want_version)
            weights = await asyncio.to_thread(codec.apply, held if have else None, fetched.payload)
        except codec.CodecError as exc:
            if have == 0:
                raise
            fallback, have = f"{type(exc).__name__}: {exc}", 0
            log.warning("weights_delta_refused", model=model, reason=fallback)
            continue
        kind = "delta" if fetched.header.kind == weights_pb2.PAYLOAD_KIND_DELTA else "keyframe"
        return weights, SyncReport(weights.version, kind, len(fetched.payload), weights.raw_bytes, transfer_s,
                                   time.monotonic() - started, fallback, fetched)


def check_labels(fetched: FetchedVersion, want_version: int) -> None:
    """Refuses a payload that is not the version the Fetch announced (and asked for) before it is
    applied: its own header's version and manifest must be the ones the publisher named."""
    header = codec.read_header(fetched.payload)
    announced = fetched.header
    if header.version != announced.version or header.manifest_hash != announced.manifest_hash:
        raise codec.CorruptPayload(f"payload: it is version {header.version} (manifest {header.manifest_hash}), the "
                                   f"publisher announced {announced.version} ({announced.manifest_hash})")
    if want_version and header.version != want_version:
        raise codec.CorruptPayload(f"payload: it is version {header.version}, version {want_version} was asked for")
