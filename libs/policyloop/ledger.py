"""The ledger: what became of every trajectory, kept in the LEDGER stream.

Rollout records each group it stored in ROLLOUTS (generated); the learner records each step
before its version is published (trained: which trajectories, found by their groups'
TRAJECTORIES sequences, made which version with which manifest hash) and each group it acked
without training (dropped, with the reason). Scoring is recorded by TRAJECTORIES itself and dead
letters by DLQ. Together they let `audit` account for every generated trajectory, and let a
learner that resumes from a checkpoint replay the steps taken after it (see docs/recovery.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import nats.js.errors
from google.protobuf.message import DecodeError

from policyloop.bus import Bus, ledger_subject
from policyloop.common.clock import now_ms
from policyloop.contracts.v1 import bus_pb2

GENERATED = bus_pb2.LedgerEvent.KIND_GENERATED
TRAINED = bus_pb2.LedgerEvent.KIND_TRAINED
DROPPED = bus_pb2.LedgerEvent.KIND_DROPPED



async def record_generated(bus: Bus, group: Sequence[bus_pb2.Trajectory], instance: str) -> None:
    """After a group's samples are stored in ROLLOUTS (once per task: retries deduplicate)."""
    first = group[0]
    versions = [span.version for t in group for span in t.version_spans]
    event = bus_pb2.LedgerEvent(kind=GENERATED, run_id=first.run_id, trajectory_ids=[t.trajectory_id for t in group],
                                policy_version=max(versions, default=0), instance=instance,
                                recorded_unix_ms=now_ms())
    await bus.publish(ledger_subject(GENERATED, first.environment), event, f"generated:{first.task_id}")


@dataclass(frozen=True)
class StepRecord:
    """One learner step as the ledger holds it."""

    step: int
    version: int
    manifest_hash: str
    trajectory_ids: tuple[str, ...]
    stream_sequences: tuple[int, ...]   # of each one's group in TRAJECTORIES, batch order
    ledger_seq: int = 0                  # where this record is in LEDGER (0: not yet stored)


async def record_trained(bus: Bus, model: str, run_id: str, instance: str, record: StepRecord) -> int:
    """Write-ahead record of a step: stored before the version it made is published. Returns its
    LEDGER sequence (the same one when a replay records the step again)."""
    event = bus_pb2.LedgerEvent(kind=TRAINED, run_id=run_id, model=model, trajectory_ids=record.trajectory_ids,
                                stream_sequences=record.stream_sequences, step=record.step,
                                policy_version=record.version, manifest_hash=record.manifest_hash,
                                instance=instance, recorded_unix_ms=now_ms())
    ack = await bus.publish(ledger_subject(TRAINED, model), event, f"trained:{model}:{record.version}")
    if ack.duplicate:
        # Within the duplicate window JetStream keeps the first record of this version: it must
        # be this very step (a retry, or a replay), never another one under a used number.
        stored = bus_pb2.LedgerEvent.FromString((await bus.get_msg("LEDGER", ack.seq)).data or b"")
        if stored.policy_version != record.version or stored.manifest_hash != record.manifest_hash:
            raise VersionReused(f"{model} version {record.version} is already recorded (LEDGER {ack.seq}) with "
                                f"manifest {stored.manifest_hash}, not {record.manifest_hash}")
    return int(ack.seq)


class VersionReused(RuntimeError):
    """A step was about to be recorded under a version number another step already made."""


async def record_dropped(bus: Bus, model: str, run_id: str, instance: str, reason: str,
                         ids_and_sequences: Sequence[tuple[str, int]]) -> None:
    """Before dropped samples are acked (one event per group: its first id names it)."""
    event = bus_pb2.LedgerEvent(kind=DROPPED, run_id=run_id, model=model, reason=reason,
                                trajectory_ids=[i for i, _ in ids_and_sequences],
                                stream_sequences=[s for _, s in ids_and_sequences], instance=instance,
                                recorded_unix_ms=now_ms())
    await bus.publish(ledger_subject(DROPPED, model), event, f"dropped:{model}:{reason}:{ids_and_sequences[0][0]}")


async def trained_steps(bus: Bus, model: str, after_ledger_seq: int = 0) -> list[StepRecord]:
    """The steps recorded after LEDGER sequence `after_ledger_seq`, by version (a record stored
    twice, e.g. by a replay beyond the duplicate window, counts once)."""
    by_version: dict[int, StepRecord] = {}
    async for seq, msg in bus.read("LEDGER", ledger_subject(TRAINED, model), after_ledger_seq + 1):
        try:
            event = bus_pb2.LedgerEvent.FromString(msg.data)
        except DecodeError as exc:
            raise ValueError(f"LEDGER message {seq} on {msg.subject} is not a LedgerEvent: {exc}") from exc
        by_version.setdefault(event.policy_version, StepRecord(
            step=event.step, version=event.policy_version, manifest_hash=event.manifest_hash,
            trajectory_ids=tuple(event.trajectory_ids), stream_sequences=tuple(event.stream_sequences),
            ledger_seq=seq))
    return [by_version[v] for v in sorted(by_version)]


async def stored_trajectories(bus: Bus, trajectory_ids: Sequence[str], sequences: Sequence[int]
                              ) -> list[bus_pb2.Trajectory]:
    """The trajectories `trajectory_ids`, read straight from TRAJECTORIES (it keeps them: LIMITS
    retention) in the group messages at `sequences` (one per id, in the same order)."""
    if len(trajectory_ids) != len(sequences):
        raise ValueError(f"{len(trajectory_ids)} trajectory ids for {len(sequences)} sequences")
    groups: dict[int, dict[str, bus_pb2.Trajectory]] = {}
    out = []
    for trajectory_id, seq in zip(trajectory_ids, sequences, strict=True):
        if seq not in groups:
            try:
                msg = await bus.get_msg("TRAJECTORIES", seq)
            except nats.js.errors.NotFoundError as exc:
                raise LookupError(f"TRAJECTORIES no longer holds sequence {seq} (trajectory_max_age_s?)") from exc
            members = bus_pb2.TrajectoryGroup.FromString(msg.data or b"").trajectories
            groups[seq] = {t.trajectory_id: t for t in members}
        if trajectory_id not in groups[seq]:
            raise LookupError(f"the group at TRAJECTORIES sequence {seq} has no trajectory {trajectory_id}")
        out.append(groups[seq][trajectory_id])
    return out


def regroup(samples: Sequence[bus_pb2.Trajectory]) -> list[list[bus_pb2.Trajectory]]:
    """Batch order back into groups (a group's samples are consecutive)."""
    groups: list[list[bus_pb2.Trajectory]] = []
    for traj in samples:
        if groups and groups[-1][0].group_id == traj.group_id:
            groups[-1].append(traj)
        else:
            groups.append([traj])
    return groups


# -- audit -----------------------------------------------------------------------------------


@dataclass
class Audit:
    """Every generated trajectory's fate. `lost`: generated, and neither trained, dropped,
    dead-lettered nor still waiting on the bus for a consumer."""

    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dead_lettered: int = 0
    pending: int = 0
    lost: int = 0
    trained_twice: int = 0
    trained_not_generated: int = 0   # a gap in the ledger: trained ids no generated record names
    not_generated_ids: list[str] = field(default_factory=list)
    steps: int = 0
    versions_monotonic: bool = True
    lost_ids: list[str] = field(default_factory=list)        # a few, for a person to look up
    twice_ids: list[str] = field(default_factory=list)
    # Taken while the loop was live: a trajectory that moves on while the bus is read can show as
    # lost or as trained_not_generated, gaps that vanish at rest. Final figures: audit at rest.
    provisional: bool = False
    provisional_reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def audit(events: Iterable[bus_pb2.LedgerEvent], *, scored: Iterable[str] = (), dead_lettered: Iterable[str] = (),
          pending: Iterable[str] = ()) -> Audit:
    """Accounts for every generated trajectory from the LEDGER events (in stream order), the
    ids stored in TRAJECTORIES (`scored`), the ids in DLQ and those still waiting on the bus."""
    generated: set[str] = set()
    trained_in: defaultdict[str, set[int]] = defaultdict(set)
    dropped_for: dict[str, str] = {}
    # Each model (the full policy, or a LoRA run's adapter) has its own version sequence.
    steps: dict[tuple[str, int], tuple[str, tuple[str, ...]]] = {}
    monotonic = True
    last_version: defaultdict[str, int] = defaultdict(int)
    for event in events:
        if event.kind == GENERATED:
            generated.update(event.trajectory_ids)
        elif event.kind == TRAINED:
            record = (event.manifest_hash, tuple(event.trajectory_ids))
            key = (event.model, event.policy_version)
            if key in steps:
                # The same step recorded again (a replay) is fine; another step under a used
                # version number is not.
                monotonic &= steps[key] == record
                continue
            monotonic &= event.policy_version == last_version[event.model] + 1
            last_version[event.model] = event.policy_version
            steps[key] = record
            for trajectory_id in event.trajectory_ids:
                trained_in[trajectory_id].add(key)
        elif event.kind == DROPPED:
            for trajectory_id in event.trajectory_ids:
                dropped_for.setdefault(trajectory_id, event.reason)
    dead = set(dead_lettered)
    waiting = set(pending)
    report = Audit(generated=len(generated), scored=len(generated & set(scored)), steps=len(steps),
                   versions_monotonic=monotonic)
    twice = sorted(t for t, versions in trained_in.items() if len(versions) > 1)
    report.trained_twice, report.twice_ids = len(twice), twice[:10]
    report.trained = len(generated & trained_in.keys())
    not_generated = sorted(trained_in.keys() - generated)
    report.trained_not_generated, report.not_generated_ids = len(not_generated), not_generated[:10]
    reasons: Counter[str] = Counter()
    lost = []
    for trajectory_id in sorted(generated):
        if trajectory_id in trained_in:
            continue
        if trajectory_id in dropped_for:
            reasons[dropped_for[trajectory_id]] += 1
        elif trajectory_id in dead:
            report.dead_lettered += 1
        elif trajectory_id in waiting:
            report.pending += 1
        else:
            lost.append(trajectory_id)
    report.dropped = dict(reasons)
    report.lost, report.lost_ids = len(lost), lost[:10]
    return report


def of_run(run_id: str, events: Iterable[bus_pb2.LedgerEvent]) -> list[bus_pb2.LedgerEvent]:
    """The events as far as they concern one run's trajectories (whose ids are its tasks',
    `<run>:<index>/<sample>`), with the others' ids left out."""
    prefix = f"{run_id}:"
    out = []
    for event in events:
        ids = [t for t in event.trajectory_ids if t.startswith(prefix)]
        if ids:
            kept = bus_pb2.LedgerEvent()
            kept.CopyFrom(event)
            del kept.trajectory_ids[:]
            kept.trajectory_ids.extend(ids)
            out.append(kept)
    return out


def member_ids(payload: bytes | None) -> list[str]:
    """The trajectory ids of a TrajectoryGroup message."""
    return [t.trajectory_id for t in bus_pb2.TrajectoryGroup.FromString(payload or b"").trajectories]


async def audit_bus(bus: Bus, run_id: str | None = None) -> Audit:
    """`audit` over what the bus holds, while the loop runs (`run_id`: of that run's trajectories
    alone). Waiting: in ROLLOUTS (not yet scored) or in TRAJECTORIES above the learner's ack floor
    (everything at or below it was acked). The reads go in the order a trajectory travels, so one
    moving on meanwhile is seen at its next stop: generated events first, then the ack floor,
    ROLLOUTS, TRAJECTORIES, the learner's events (recorded before its acks) and DLQ.

    The report is `provisional` when the loop is live: groups wait in ROLLOUTS to be scored, or
    the streams changed while they were read; its gaps may then be work in flight."""
    before = await _stream_marks(bus)
    generated = [bus_pb2.LedgerEvent.FromString(m.data) async for _, m in bus.read("LEDGER", "pl.ledger.generated.>")]
    floor = (await bus.js.consumer_info("TRAJECTORIES", "learner")).ack_floor.stream_seq
    pending = set()
    async for _, stored in bus.stored("ROLLOUTS"):  # one removed meanwhile is in TRAJECTORIES
        pending.update(member_ids(stored.data))
    scored = set()
    async for seq, msg in bus.read("TRAJECTORIES", "pl.traj.>"):
        ids = member_ids(msg.data)
        scored.update(ids)
        if seq > floor:
            pending.update(ids)
    learner = [bus_pb2.LedgerEvent.FromString(m.data) async for _, m in bus.read("LEDGER", "pl.ledger.>")
               if not m.subject.startswith("pl.ledger.generated.")]
    dead = set()
    async for _, msg in bus.read("DLQ", "pl.dlq.>"):
        letter = bus_pb2.DeadLetter.FromString(msg.data)
        if letter.origin_stream in ("ROLLOUTS", "TRAJECTORIES"):
            try:
                dead.update(member_ids(letter.payload))
            except DecodeError:  # garbage dead-lettered as undecodable: no trajectory to name
                continue
    events = [*generated, *learner]
    if run_id is not None:
        prefix = f"{run_id}:"
        events = of_run(run_id, events)
        scored, dead, pending = ({t for t in ids if t.startswith(prefix)} for ids in (scored, dead, pending))
    report = audit(events, scored=scored, dead_lettered=dead, pending=pending)
    after = await _stream_marks(bus)
    reasons = []
    if before["ROLLOUTS"][1]:
        reasons.append(f"{before['ROLLOUTS'][1]} groups wait in ROLLOUTS to be scored")
    moved = [name for name in before if before[name] != after[name]]
    if moved:
        reasons.append(f"{', '.join(moved)} changed while the audit read the bus")
    if reasons:
        report.provisional = True
        report.provisional_reason = ("the loop is live (" + "; ".join(reasons) + "): lost and trained_not_generated "
                                     "may count work in flight; audit at rest (--settle-s) for final figures")
    return report


async def _stream_marks(bus: Bus) -> dict[str, tuple[int, int]]:
    """stream -> (last sequence, messages held) for the streams a trajectory moves through."""
    marks = {}
    for name in ("ROLLOUTS", "TRAJECTORIES", "LEDGER"):
        state = (await bus.js.stream_info(name)).state
        marks[name] = (state.last_seq, state.messages)
    return marks


async def wait_settled(bus: Bus, quiet_s: float, timeout_s: float) -> bool:
    """Waits until the groups in flight have moved on — ROLLOUTS empty and LEDGER unchanged for
    `quiet_s` — so that an audit after a run stops sees finished work (a partial batch stays
    held by the learner and is counted as pending). False when `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        ledger = (await bus.js.stream_info("LEDGER")).state.last_seq
        rollouts = (await bus.js.stream_info("ROLLOUTS")).state.messages
        if ledger != last or rollouts:
            last, since = ledger, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
        await asyncio.sleep(0.5)
    return False
