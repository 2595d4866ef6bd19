"""Sandbox sessions through the real sandbox service: one isolated process keeps its state across
the steps of an episode, each step and the whole episode have time limits, the session ends when
the caller closes it, and its result says what it used."""

from __future__ import annotations

import pytest

from policyloop.bus import Bus
from policyloop.contracts.v1 import bus_pb2
from policyloop.sandbox.runner import SandboxUnavailable, check_isolation
from policyloop.sandbox.session import Session, SessionEnded
from tests.conftest import ServiceLauncher

try:
    check_isolation()
except SandboxUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"the sandbox cannot isolate jobs here: {exc}", allow_module_level=True)

# A stateful process: it keeps a running total, sleeps when told to, and tries the network.
COUNTER = b'''
import socket, sys, time
total = 0
for line in sys.stdin:
    word, _, arg = line.strip().partition(" ")
    if word == "add":
        total += int(arg)
        print(total, flush=True)
    elif word == "sleep":
        time.sleep(float(arg))
        print("awake", flush=True)
    elif word == "net":
        try:
            socket.create_connection(("127.0.0.1", int(arg)), timeout=2)
            print("connected", flush=True)
        except OSError as exc:
            print("no network:", type(exc).__name__, flush=True)
    elif word == "exit":
        sys.exit(3)
'''


def counter_job(wall_seconds: float = 30.0) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(job_id="counter", run_id="run-1", files={"counter.py": COUNTER},
                              command=["python3", "-I", "counter.py"],
                              limits=bus_pb2.SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=wall_seconds))


async def test_a_session_keeps_its_state_and_ends_when_closed(bus: Bus, services: ServiceLauncher,
                                                             nats_server) -> None:  # type: ignore[no-untyped-def]
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=60)
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        assert [await session.step(f"add {n}".encode()) for n in (2, 3, 10)] == [b"2", b"5", b"15"]
        port = int(nats_server.url.rsplit(":", 1)[1])
        assert (await session.step(f"net {port}".encode())).startswith(b"no network")
        result = await session.close()
    assert result is not None and result.exit_code == 0 and not result.error
    assert result.limit_hit == bus_pb2.SANDBOX_LIMIT_NONE and result.cpu_seconds > 0
    assert result.accounting != bus_pb2.SANDBOX_ACCOUNTING_UNSPECIFIED
    # Another episode is another process: nothing of the first one's state.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        assert await session.step(b"add 1") == b"1"


async def test_a_step_past_its_limit_ends_the_session(bus: Bus, services: ServiceLauncher) -> None:
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox, timeout_s=60)
    async with Session(bus, counter_job(), kind="test", step_seconds=1, open_timeout_s=60) as session:
        assert await session.step(b"add 1") == b"1"
        with pytest.raises(SessionEnded, match="STEP_TIME"):
            await session.step(b"sleep 30")
        assert session.result is not None and session.result.limit_hit == bus_pb2.SANDBOX_LIMIT_STEP_TIME
        with pytest.raises(SessionEnded):  # and it stays over
            await session.step(b"add 1")
    # The episode's wall clock bounds it too, however quickly each step answers.
    async with Session(bus, counter_job(wall_seconds=2), kind="test", step_seconds=30, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="WALL_TIME"):
            for _ in range(100):
                await session.step(b"sleep 0.5")
    # A process that exits mid-episode ends it with its exit code.
    async with Session(bus, counter_job(), kind="test", step_seconds=5, open_timeout_s=60) as session:
        with pytest.raises(SessionEnded, match="exit code 3"):
            await session.step(b"exit")
