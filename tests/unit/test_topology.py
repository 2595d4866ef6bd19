"""The topology table is consistent and uses only what nats-server 2.9 understands."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policyloop.bus.connection import nats_servers
from policyloop.bus.consume import retry_delay
from policyloop.bus.topology import (
    BusLimits,
    _subject_matches,
    build_topology,
    dlq_subject,
    rollouts_subject,
    sandbox_subject,
    session_subject,
    subject_token,
    tasks_subject,
    trajectories_subject,
    weights_subject,
)


def test_subjects_of_streams_do_not_overlap() -> None:
    topo = build_topology()
    patterns = [(s.name, p) for s in topo.streams.values() for p in s.subjects]
    for name, pattern in patterns:
        probe = pattern.replace(">", "x")
        owners = [n for n, p in patterns if _subject_matches(p, probe)]
        assert owners == [name], f"{probe} is taken by {owners}"


def test_consumers_read_existing_streams_within_their_subjects() -> None:
    topo = build_topology()
    for consumer in topo.consumers.values():
        stream = topo.streams[consumer.stream]
        assert any(_subject_matches(p, consumer.filter_subject.replace(">", "x")) for p in stream.subjects)
        config = consumer.config()
        # No server-side backoff: on 2.9.10 it overrides nak delays (see topology's docstring).
        assert config.backoff is None and config.ack_wait == consumer.ack_wait_s


@pytest.mark.parametrize(("subject", "stream"), [
    (tasks_subject("addition@v1.2"), "TASKS"),
    (rollouts_subject("code env"), "ROLLOUTS"),
    (trajectories_subject("a.b"), "TRAJECTORIES"),
    (sandbox_subject("python"), "SANDBOX"),
    (session_subject("program"), "SESSIONS"),
    (weights_subject("qwen2.5"), "WEIGHTS"),
    (dlq_subject("TASKS"), "DLQ"),
])
def test_subject_helpers_land_in_their_stream(subject: str, stream: str) -> None:
    assert build_topology().stream_for_subject(subject).name == stream
    assert subject.count(".") == 2  # one token after the prefix, whatever the name held


def test_ledger_subjects_name_the_kind_and_scope() -> None:
    from policyloop.bus import ledger_subject
    from policyloop.contracts.v1 import bus_pb2

    subject = ledger_subject(bus_pb2.LedgerEvent.KIND_TRAINED, "qwen2.5")
    assert subject == "pl.ledger.trained.qwen2_5"
    assert build_topology().stream_for_subject(subject).name == "LEDGER"
    with pytest.raises(KeyError):
        ledger_subject(bus_pb2.LedgerEvent.KIND_UNSPECIFIED, "m")


def test_subject_token() -> None:
    assert subject_token("addition@v1.2") == "addition_v1_2"
    assert subject_token("a b*c>d") == "a_b_c_d"
    with pytest.raises(ValueError):
        subject_token("")


def test_retry_delays_grow_and_are_bounded() -> None:
    assert [retry_delay(n, (1, 2, 3)) for n in (1, 2, 3, 9)] == [1, 2, 3, 3]


def test_stream_replicas_reach_every_stream_and_consumer() -> None:
    assert BusLimits().stream_replicas == 1
    topo = build_topology(BusLimits(stream_replicas=3))
    assert {s.config().num_replicas for s in topo.streams.values()} == {3}
    # Consumers state the stream's count rather than inherit it, so a change reaches them.
    assert {c.config().num_replicas for c in topo.consumers.values()} == {3}
    assert {c.config().num_replicas for c in build_topology().consumers.values()} == {1}


@pytest.mark.parametrize("replicas", [0, 6])
def test_stream_replicas_are_bounded(replicas: int) -> None:
    with pytest.raises(ValidationError, match="stream_replicas"):
        BusLimits(stream_replicas=replicas)


def test_stream_replicas_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from policyloop.runtime.settings import ServiceSettings

    monkeypatch.setenv("POLICYLOOP_BUS__STREAM_REPLICAS", "3")
    monkeypatch.setenv("POLICYLOOP_NATS_URL", "nats://a:4222,nats://b:4222,nats://c:4222")
    settings = ServiceSettings()
    assert settings.bus.stream_replicas == 3
    assert nats_servers(settings.nats_url) == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]


def test_nats_servers_split_a_list() -> None:
    assert nats_servers("nats://h:1") == ["nats://h:1"]
    assert nats_servers(" nats://a:1 , nats://b:2,") == ["nats://a:1", "nats://b:2"]
    with pytest.raises(ValueError):
        nats_servers(" , ")
