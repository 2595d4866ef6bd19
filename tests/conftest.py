"""Real servers for the tests: each test that asks gets its own nats-server (JetStream, a
temporary store) and redis-server on free ports, started by the same code `policyloop up`
uses, and stopped at the end. Service processes are started with `python -m policyloop serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as sync_redis

from policyloop.bus import Bus, build_topology
from policyloop.bus.topology import BusLimits
from policyloop.cluster.local import (
    ManagedProcess,
    free_port,
    start_nats,
    start_nats_cluster,
    start_redis,
    wait_for_port,
)
from policyloop.state import connect_redis

REPO = Path(__file__).resolve().parents[1]
# Tests never reach an experiment tracker's servers (the services they start inherit this): wandb
# writes offline runs only and reports no errors, MLflow's store is the one each test names, and
# neither sends usage telemetry.
os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_ERROR_REPORTING="false",
                  MLFLOW_DISABLE_TELEMETRY="true")
os.environ.pop("MLFLOW_TRACKING_URI", None)


@dataclass
class Server:
    managed: ManagedProcess
    url: str

    def stop(self, sig: int = signal.SIGTERM) -> None:
        assert self.managed.proc is not None
        self.managed.proc.send_signal(sig)
        self.managed.proc.wait(timeout=15)

    def restart(self) -> None:
        """Stops the server and starts it again on the same port with the same data."""
        self.stop()
        self.managed.start()
        wait_for_port("127.0.0.1", self.managed.ports["client"], 15, self.managed.proc)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Server]:
    managed = start_nats(tmp_path / "nats-run")
    server = Server(managed, f"nats://127.0.0.1:{managed.ports['client']}")
    yield server
    if managed.alive:
        server.stop()


@dataclass
class NatsCluster:
    """A 3-node JetStream cluster; nodes by server name (nats-0, nats-1, nats-2)."""

    nodes: dict[str, ManagedProcess]

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{m.ports['client']}" for m in self.nodes.values())

    @property
    def monitor_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{m.ports['monitor']}" for m in self.nodes.values()]

    def kill(self, name: str) -> None:
        managed = self.nodes[name]
        managed.signal(signal.SIGKILL)
        assert managed.proc is not None
        managed.proc.wait(timeout=15)

    def restart(self, name: str) -> None:
        """Starts a stopped node again on its ports and store."""
        managed = self.nodes[name]
        managed.start()
        wait_for_port("127.0.0.1", managed.ports["client"], 15, managed.proc)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster({m.name: m for m in start_nats_cluster(tmp_path / "nats-cluster", 3)})
    yield cluster
    for managed in cluster.nodes.values():
        managed.signal(signal.SIGTERM)
    for managed in cluster.nodes.values():
        if managed.proc is not None:
            managed.proc.wait(timeout=15)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Server]:
    managed = start_redis(tmp_path / "redis-run")
    server = Server(managed, f"redis://127.0.0.1:{managed.ports['client']}/0")
    yield server
    if managed.alive:
        server.stop()


HEARTBEAT_INTERVAL_S = 0.5  # of the services tests start


def fast_limits(**overrides: object) -> BusLimits:
    """Short ack waits so that redelivery tests take seconds, not minutes."""
    values: dict[str, object] = dict(
        rollout_ack_wait_s=3.0, reward_ack_wait_s=3.0, learner_ack_wait_s=3.0,
        sandbox_ack_wait_s=3.0, max_deliver=4,
    )
    values.update(overrides)
    return BusLimits(**values)  # type: ignore[arg-type]


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_server.url, name="test", topology=build_topology(fast_limits()),
                                  connect_timeout_s=10)
    await connected.ensure_topology()
    yield connected
    await connected.close()


@pytest.fixture
async def redis_client(redis_server: Server):  # type: ignore[no-untyped-def]
    client = await connect_redis(redis_server.url)
    yield client
    await client.aclose()


def limits_env(limits: BusLimits) -> dict[str, str]:
    return {f"POLICYLOOP_BUS__{k.upper()}": str(v) for k, v in limits.model_dump().items()}


@dataclass
class ServiceProcess:
    name: str
    instance: str
    proc: subprocess.Popen
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_events(self) -> list[dict]:
        events = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return events

    def terminate(self, timeout_s: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class ServiceLauncher:
    """Starts service processes against the test's servers and cleans them up."""

    def __init__(self, tmp_path: Path, nats: Server, redis_srv: Server, model_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.nats = nats
        self.redis = redis_srv
        self.model_dir = model_dir
        self.started: list[ServiceProcess] = []

    def start(self, name: str, instance: str | None = None, env: dict[str, str] | None = None,
              limits: BusLimits | None = None, launcher: list[str] | None = None) -> ServiceProcess:
        """`launcher` replaces `python` in front of `-m policyloop serve <name>` (e.g. torchrun)."""
        instance = instance or f"{name}-{len(self.started)}"
        ports = {"http": free_port()}
        full_env = dict(os.environ)
        full_env.update({
            "POLICYLOOP_NATS_URL": self.nats.url,
            "POLICYLOOP_REDIS_URL": self.redis.url,
            "POLICYLOOP_INSTANCE_ID": instance,
            "POLICYLOOP_HTTP_PORT": str(ports["http"]),
            "POLICYLOOP_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
            "POLICYLOOP_HEARTBEAT_TTL_S": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "POLICYLOOP_MODEL_PATH": str(self.model_dir),
            "POLICYLOOP_WEIGHTS_DIR": str(self.tmp_path / "rollout-weights"),
        })
        if name in ("gateway", "publisher"):
            ports["grpc"] = free_port()
            full_env["POLICYLOOP_GRPC_PORT"] = str(ports["grpc"])
        if name == "publisher":
            full_env["POLICYLOOP_STORE_DIR"] = str(self.tmp_path / "weights")
        full_env.update(limits_env(limits or fast_limits()))
        full_env.update(env or {})
        log_path = self.tmp_path / f"{instance}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([*(launcher or [sys.executable]), "-m", "policyloop", "serve", name], env=full_env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp_path)
        service = ServiceProcess(name, instance, proc, log_path, ports)
        self.started.append(service)
        return service

    async def wait_healthy(self, *services: ServiceProcess, timeout_s: float = 30) -> None:
        """Waits until each service's heartbeat in Redis says healthy."""
        from policyloop.state import HeartbeatRegistry

        client = await connect_redis(self.redis.url)
        try:
            registry = HeartbeatRegistry(client, "default")
            deadline = time.monotonic() + timeout_s
            pending = {s.instance for s in services}
            while pending:
                for s in services:
                    if s.proc.poll() is not None:
                        raise AssertionError(f"{s.instance} exited with {s.proc.returncode}:\n{s.log()[-3000:]}")
                beats = {b.instance: b for b in await registry.alive()}
                pending = {i for i in pending if not (i in beats and beats[i].healthy)}
                if time.monotonic() > deadline:
                    logs = "\n".join(s.log()[-2000:] for s in services if s.instance in pending)
                    raise AssertionError(f"not healthy within {timeout_s}s: {pending}\n{logs}")
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    def stop_all(self) -> None:
        for service in self.started:
            if service.proc.poll() is None:
                service.proc.kill()
                service.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 policy with the project's tokenizer (a standard HF directory)."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def services(
    tmp_path: Path, nats_server: Server, redis_server: Server, tiny_model_dir: Path
) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path, nats_server, redis_server, tiny_model_dir)
    yield launcher
    launcher.stop_all()


def redis_sync(url: str) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(url, decode_responses=True)
