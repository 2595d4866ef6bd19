"""Real servers for the tests: each test that asks gets its own nats-server (JetStream, a
temporary store) and redis-server on free ports, started by the same code `policyloop up`
uses, and stopped at the end. Service processes are started with `python -m policyloop serve`.

Models are built before the first test runs (pytest_collection_finish), never inside a test: a
build takes from seconds to minutes depending on how busy the machine is, and inside a test it
counts against that test's timeout. The tiny test model is built when a selected test uses it,
and each bootstrap model (cached across sessions) when a selected test's module is listed in
MODULE_MODELS as running on it."""

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

    async def wait_healthy(self, *services: ServiceProcess, timeout_s: float = 120) -> None:
        """Waits until each service's heartbeat in Redis says healthy. The deadline is generous: a
        rollout's engine takes 20 s to start on a 2-core machine at load 4, longer when busier."""
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

    async def start_loop(self, model_dir: Path, groups_per_step: int, timeout_s: float = 120,
                         names: tuple[str, ...] = ("gateway", "rollout", "reward", "sandbox"),
                         env: dict[str, str] | None = None) -> dict[str, ServiceProcess]:
        """The whole loop on `model_dir`: the publisher, the learner pushing to it, and `names`,
        all healthy, with `env` besides; by service name."""
        model = {"POLICYLOOP_MODEL_PATH": str(model_dir), "POLICYLOOP_GROUPS_PER_STEP": str(groups_per_step),
                 **(env or {})}
        publisher = self.start("publisher", env=model)
        await self.wait_healthy(publisher)
        learner = self.start("learner", env={**model,
                                             "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"})
        started = {name: self.start(name, env=model) for name in names}
        await self.wait_healthy(learner, *started.values(), timeout_s=timeout_s)
        return {"publisher": publisher, "learner": learner, **started}

    def stop_all(self) -> None:
        for service in self.started:
            if service.proc.poll() is None:
                service.proc.kill()
                service.proc.wait(timeout=10)


def suite_models() -> dict:  # name -> BootstrapRecipe (imported late: conftest stays light)
    """The bootstrap models the tests run on, by name."""
    from policyloop.models.bootstrap import TOOLS_BOOTSTRAP, BootstrapConfig
    from policyloop.models.chat import CHAT_BOOTSTRAP
    from policyloop.models.reward_model import REWARD_MODEL_BOOTSTRAP

    return {"arithmetic": BootstrapConfig(), "tools": TOOLS_BOOTSTRAP, "chat": CHAT_BOOTSTRAP,
            "reward_model": REWARD_MODEL_BOOTSTRAP}


# The bootstrap models each test module runs on, directly or through a process it starts
# (`policyloop demo` builds "arithmetic" when given no model), by path below tests/. Only these
# are built for a session, so a run that needs none builds none; test_suite_models checks that
# every module calling bootstrap() or starting a demo is listed.
MODULE_MODELS: dict[str, tuple[str, ...]] = {
    "integration/test_multiturn.py": ("tools",),
    "integration/test_openai_endpoint.py": ("arithmetic",),
    "integration/test_evaluation.py": ("arithmetic",),
    "integration/test_tinker_api.py": ("arithmetic",),
    "integration/test_judge.py": ("arithmetic",),
    "integration/test_suite_models.py": ("arithmetic", "tools", "chat", "reward_model"),
    "integration/test_reward_model_bootstrap.py": ("reward_model",),
    "integration/test_reward_scoring.py": ("arithmetic", "reward_model"),
    "integration/test_chat_model.py": ("chat",),
    "integration/test_agents.py": ("chat",),
    "integration/test_program_env.py": ("chat",),
    "integration/test_openenv.py": ("chat",),
    "integration/test_verifiers_env.py": ("chat",),
    "e2e/test_learning.py": ("arithmetic",),
    "e2e/test_local_cluster.py": ("arithmetic",),
    "e2e/test_production_demo.py": ("arithmetic",),
    "e2e/test_agent_demo.py": ("chat",),
    "e2e/test_environment_learning.py": ("chat",),
    "e2e/test_agent_env_demo.py": ("chat",),
}


@dataclass
class PrebuiltModels:
    """What pytest_collection_finish built before the first test: model name -> directory, and
    the error of a build that failed (its tests fail with it rather than build again)."""
    built: dict[str, Path] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    tiny_dir: Path | None = None


PREBUILT = pytest.StashKey[PrebuiltModels]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Builds the models the selected tests use before any of them runs, outside every test's
    timeout (pytest-timeout times each test's setup, call and teardown, not this hook)."""
    prebuilt = session.config.stash[PREBUILT] = PrebuiltModels()
    if session.config.option.collectonly or not session.items:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)

    if any("tiny_model_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        import tempfile

        from tests.tiny_model import build_tiny_model

        started = time.monotonic()
        prebuilt.tiny_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="policyloop-tiny-model-")))
        say(f"tiny test model built in {time.monotonic() - started:.0f} s (before the tests)")
    tests = REPO / "tests"
    modules = {Path(str(item.path)) for item in session.items}
    needed = {name for module in modules if module.is_relative_to(tests)
              for name in MODULE_MODELS.get(module.relative_to(tests).as_posix(), ())}
    if not needed:
        return
    import fcntl

    from policyloop.models.bootstrap import bootstrap, bootstrap_dir, is_complete

    for name, config in suite_models().items():
        if name not in needed:
            continue
        if not is_complete(bootstrap_dir(config)):
            say(f"building the {name} bootstrap model (once; cached in {bootstrap_dir(config).parent}) ...")
        started = time.monotonic()
        try:
            bootstrap_dir(config).parent.mkdir(parents=True, exist_ok=True)
            # Sessions started side by side on a fresh machine wait for one build instead of each
            # running its own (the waiters then find it in the cache).
            with open(bootstrap_dir(config).parent / f".{config.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                prebuilt.built[name] = bootstrap(config)
        except Exception as exc:  # noqa: BLE001 - reported by the tests that need it
            prebuilt.failed[name] = repr(exc)
            say(f"the {name} bootstrap model could not be built: {exc!r}")
            continue
        if time.monotonic() - started > 1:
            say(f"{name} bootstrap model ready after {time.monotonic() - started:.0f} s (before the tests)")


def pytest_sessionfinish(session: pytest.Session) -> None:
    prebuilt = session.config.stash.get(PREBUILT, None)
    if prebuilt is not None and prebuilt.tiny_dir is not None:
        import shutil

        shutil.rmtree(prebuilt.tiny_dir, ignore_errors=True)


def prebuilt_model(config: pytest.Config, name: str) -> Path:
    """The directory of a bootstrap model built before the tests; never builds one (a build
    inside a test would count against its timeout)."""
    prebuilt = config.stash[PREBUILT]
    if name in prebuilt.failed:
        pytest.fail(f"the {name} bootstrap model could not be built before the tests: {prebuilt.failed[name]}")
    if name not in prebuilt.built:
        pytest.fail(f"no {name!r} bootstrap model was built before the tests: list it for this module in "
                    f"MODULE_MODELS (tests/conftest.py)")
    return prebuilt.built[name]


@pytest.fixture(scope="session")
def tiny_model_dir(request: pytest.FixtureRequest) -> Path:
    """A tiny random Qwen2 policy with the project's tokenizer (a standard HF directory), built
    before the first test (pytest_collection_finish)."""
    tiny = request.config.stash[PREBUILT].tiny_dir
    assert tiny is not None, "pytest_collection_finish builds the tiny model for every test that uses it"
    return tiny


@pytest.fixture
def services(
    tmp_path: Path, nats_server: Server, redis_server: Server, tiny_model_dir: Path
) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path, nats_server, redis_server, tiny_model_dir)
    yield launcher
    launcher.stop_all()


def redis_sync(url: str) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(url, decode_responses=True)
