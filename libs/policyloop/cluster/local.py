"""The local cluster: nats-server, redis-server and every service as plain processes.

`policyloop up` uses it; so do the tests. NATS and Redis start on free ports with their data
under the run directory, unless URLs of running ones are given. NATS is one server, or with
`nats_nodes=3` a JetStream cluster of three (every stream and consumer then kept on all three,
so the loop survives losing one). With a reward model, its engine runs as one more process
(reward-model-0) that the services scoring with it reach by URL. Every process is supervised: one
that exits unexpectedly is restarted on the same ports and data (a service recovers its work from
the bus).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from policyloop.cluster.catalogue import SERVICES, ServiceEntry
from policyloop.cluster.catalogue import entry as catalogue_entry
from policyloop.cluster.nats_cluster import node_command, plan_nodes, wait_cluster_ready
from policyloop.cluster.prometheus import (
    ScrapeTarget,
    prometheus_binary,
    prometheus_command,
    wait_ready,
    write_config,
    write_targets,
)
from policyloop.common.ports import free_port


class ClusterError(RuntimeError):
    pass


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ClusterError(f"nothing listens on {host}:{port} after {timeout_s}s")


def require_binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
    if path is None:
        raise ClusterError(f"{name} is not installed (Debian: apt-get install {name})")
    return path


@dataclass
class ManagedProcess:
    name: str                      # e.g. "rollout-0", "nats-server"
    command: list[str]
    env: dict[str, str]
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # Ctrl-C reaches only the launcher
        )
        log.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def start_nats(run_dir: Path, port: int | None = None) -> ManagedProcess:
    """nats-server with JetStream, its store in the run directory (survives restarts)."""
    port = port or free_port()
    store = run_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    managed = ManagedProcess(
        "nats-server",
        [require_binary("nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
        dict(os.environ), run_dir / "logs" / "nats-server.log", {"client": port},
    )
    managed.start()
    wait_for_port("127.0.0.1", port, 15, managed.proc)
    return managed


def start_nats_cluster(run_dir: Path, nodes: int, ready_timeout_s: float = 60.0) -> list[ManagedProcess]:
    """`nodes` nats-servers forming one JetStream cluster on loopback, named nats-0, nats-1, …,
    each storing under run_dir/nats/<name>; returns when a meta leader is elected."""
    binary = require_binary("nats-server")
    planned = plan_nodes(nodes, run_dir / "nats", [(free_port(), free_port(), free_port()) for _ in range(nodes)])
    started: list[ManagedProcess] = []
    try:
        for node in planned:
            node.store_dir.mkdir(parents=True, exist_ok=True)
            managed = ManagedProcess(node.name, node_command(binary, node, planned), dict(os.environ),
                                     run_dir / "logs" / f"{node.name}.log", node.ports)
            managed.start()
            started.append(managed)
        for managed in started:
            wait_for_port("127.0.0.1", managed.ports["client"], 15, managed.proc)
        wait_cluster_ready([node.monitor_url for node in planned], ready_timeout_s)
    except BaseException:
        for managed in started:
            managed.signal(signal.SIGKILL)
        _wait_all(started, 5)
        raise
    return started


def start_redis(run_dir: Path, port: int | None = None) -> ManagedProcess:
    """redis-server with an append-only file in the run directory (survives restarts)."""
    port = port or free_port()
    data = run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    managed = ManagedProcess(
        "redis-server",
        [require_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(data), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
         "--protected-mode", "no"],
        dict(os.environ), run_dir / "logs" / "redis-server.log", {"client": port},
    )
    managed.start()
    wait_for_port("127.0.0.1", port, 15, managed.proc)
    return managed


# The Tinker API's sampler: `policyloop serve rollout` with lora_runs and tinker_sampling (its
# base stays the base model), which `up --tinker` starts beside the loop's replicas.
TINKER_SAMPLER = "tinker-sampler"
# A serving replica (docs/evaluation.md): `policyloop serve rollout` with role=serving, the
# promoted versions of one run behind the OpenAI-compatible API. `LocalCluster(serving_run=…)`
# starts one beside the loop.
SERVING = "serving"


# The reward model's engine (docs/deploy.md, "A reward model"): the embedded engine serving a
# sequence-classification directory on SGLang's /classify, one process beside the services, under
# the name environments' reward_model scorers give it. `LocalCluster(reward_model=…)` starts it.
REWARD_MODEL = "reward-model"
REWARD_MODEL_NAME = "arith-rm"
# The services that score samples, and so call the reward model's engines.
SCORING_SERVICES = ("reward", "evaluator")


def service_of(instance: str) -> str:
    """The service an instance belongs to: rollout-0 → rollout (tinker-sampler-0 → tinker-sampler)."""
    return instance.rsplit("-", 1)[0]


def service_args(entry: ServiceEntry) -> list[str]:
    """Arguments after `policyloop`: the same in compose.yaml (checked by a test)."""
    return ["serve", entry.name]


def service_process(entry: ServiceEntry, index: int, run_dir: Path, nats_url: str, redis_url: str,
                    namespace: str, extra_env: dict[str, str] | None = None, *, role: str = "",
                    serve_run: str = "") -> ManagedProcess:
    """`role`: a process of the service in another role, named after it (TINKER_SAMPLER, or
    SERVING with `serve_run`, the run whose promoted versions it serves)."""
    if role == SERVING and not serve_run:
        raise ValueError("a serving replica needs serve_run: the run whose promoted versions it serves")
    instance = f"{role or entry.name}-{index}"
    ports = {"http": free_port()}
    env = dict(os.environ)
    env.update({
        "POLICYLOOP_NATS_URL": nats_url,
        "POLICYLOOP_REDIS_URL": redis_url,
        "POLICYLOOP_NAMESPACE": namespace,
        "POLICYLOOP_INSTANCE_ID": instance,
        "POLICYLOOP_HTTP_PORT": str(ports["http"]),
        "POLICYLOOP_RUN_ID": run_dir.name,
        # Several processes share the cores: one math thread each.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if entry.grpc:
        ports["grpc"] = free_port()
        env["POLICYLOOP_GRPC_PORT"] = str(ports["grpc"])
    if entry.name == "publisher":
        env["POLICYLOOP_STORE_DIR"] = str(run_dir / "weights")
    if entry.name == "rollout":
        env["POLICYLOOP_WEIGHTS_DIR"] = str(run_dir / "rollout-weights")
    if role == SERVING:
        # The run's promoted versions behind the OpenAI-compatible API, on a free port.
        ports["openai"] = free_port()
        env["POLICYLOOP_ROLE"] = "serving"
        env["POLICYLOOP_SERVE_RUN"] = serve_run
        env["POLICYLOOP_OPENAI_PORT"] = str(ports["openai"])
    if entry.name == "evaluator":
        # The version under evaluation, written for the evaluator's own engine.
        env["POLICYLOOP_WEIGHTS_DIR"] = str(run_dir / "evaluator-weights")
    if entry.name == "learner":
        env["POLICYLOOP_CHECKPOINT__DIR"] = str(run_dir / "checkpoints")
    if role == TINKER_SAMPLER:
        env["POLICYLOOP_LORA_RUNS"] = "true"
        env["POLICYLOOP_TINKER_SAMPLING"] = "true"
    if entry.name == "tinker":
        # The Tinker HTTP API (TINKER_BASE_URL http://127.0.0.1:<api>), on a free port like the others.
        ports["api"] = free_port()
        env["POLICYLOOP_API_PORT"] = str(ports["api"])
    env.update(extra_env or {})
    return ManagedProcess(
        instance, [sys.executable, "-m", "policyloop", *service_args(entry)], env,
        run_dir / "logs" / f"{instance}.log", ports,
    )


def reward_model_process(model_dir: Path, run_dir: Path, index: int = 0) -> ManagedProcess:
    """The embedded engine serving the reward model at `model_dir` on a free port (ports["http"]:
    /classify, /health and its /metrics, which Prometheus scrapes like a service's)."""
    instance = f"{REWARD_MODEL}-{index}"
    port = free_port()
    env = dict(os.environ)
    # One math thread, as every service here: the processes share the cores.
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    command = [sys.executable, "-m", "policyloop.engines.embedded", "--model-path", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port)]
    return ManagedProcess(instance, command, env, run_dir / "logs" / f"{instance}.log", {"http": port})


def engine_url(managed: ManagedProcess) -> str:
    return f"http://127.0.0.1:{managed.ports['http']}"


def reward_model_env(engines: dict[str, list[str]]) -> dict[str, str]:
    """The setting that points the scoring services at reward models' engines, by model name."""
    return {"POLICYLOOP_REWARD_MODELS__ENGINES": json.dumps(engines)}


def wait_engine_healthy(managed: ManagedProcess, timeout_s: float) -> None:
    """Returns once the engine answers /health with 200; raises ClusterError if it exits first or
    does not within `timeout_s` (loading torch and the model)."""
    url = f"{engine_url(managed)}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        if managed.proc is not None and managed.proc.poll() is not None:
            raise ClusterError(f"{managed.name} exited with {managed.proc.returncode} before it was healthy "
                               f"(log: {managed.log_path})")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            raise ClusterError(f"{managed.name} at {url} is not healthy after {timeout_s:.0f}s "
                               f"(log: {managed.log_path})")
        time.sleep(0.25)


@dataclass
class ClusterInfo:
    """What `policyloop status` needs to find a running cluster (written to cluster.json)."""

    run_dir: str
    nats_url: str
    redis_url: str
    namespace: str
    launcher_pid: int
    processes: dict[str, dict[str, int]]   # name -> ports
    pids: dict[str, int] = field(default_factory=dict)
    nats_nodes: int = 1                    # >1: nats_url lists the nodes nats-0, nats-1, …
    prometheus_url: str = ""               # "" when the cluster runs without Prometheus

    def save(self) -> None:
        path = Path(self.run_dir) / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, run_dir: Path) -> ClusterInfo:
        path = run_dir / "cluster.json"
        if not path.exists():
            raise ClusterError(f"no cluster.json in {run_dir}: is `policyloop up` running there?")
        return cls(**json.loads(path.read_text()))


class LocalCluster:
    def __init__(
        self,
        run_dir: Path,
        *,
        nats_url: str | None = None,
        redis_url: str | None = None,
        namespace: str = "default",
        replicas: dict[str, int] | None = None,
        services: tuple[ServiceEntry, ...] = SERVICES,
        extra_env: dict[str, str] | None = None,
        stop_grace_s: float = 20.0,
        fresh: bool = False,
        nats_nodes: int = 1,
        prometheus: bool | None = False,
        tinker: bool = False,
        serving_run: str = "",
        reward_model: Path | None = None,
        engine_start_timeout_s: float = 180.0,
        relay_fanout: int = 0,
    ) -> None:
        """`prometheus`: start one scraping every service (None: when it is installed).
        `tinker`: the Tinker API trains and samples: the learner trains its models too
        (tinker=true) and a rollout replica samples for it (TINKER_SAMPLER). `serving_run`: also start a
        serving replica (SERVING, process serving-0) of that run's promoted versions, its
        OpenAI-compatible API on a free port (ports["openai"]). `reward_model`: a sequence-classification
        model directory served as REWARD_MODEL_NAME by an embedded engine (process reward-model-0,
        healthy within `engine_start_timeout_s`), which the SCORING_SERVICES score with. `relay_fanout`:
        the publisher places the rollout replicas in a tree of that fan-out and they relay versions
        to one another (docs/weights.md; 0: each fetches from the publisher)."""
        if nats_nodes < 1:
            raise ValueError("nats_nodes must be at least 1")
        if nats_nodes > 1 and nats_url:
            raise ValueError("nats_nodes starts a NATS cluster: give no nats_url with it")
        self.run_dir = Path(run_dir).resolve()
        self.given_nats_url = nats_url
        self.given_redis_url = redis_url
        self.namespace = namespace
        self.replicas = replicas or {}
        self.services = services
        self.extra_env = extra_env or {}
        self.stop_grace_s = stop_grace_s
        self.fresh = fresh
        self.nats_nodes = nats_nodes
        self.nats_servers: list[ManagedProcess] = []   # one, or the cluster's nodes
        self.redis: ManagedProcess | None = None
        self.processes: list[ManagedProcess] = []
        self.nats_url = nats_url or ""
        self.redis_url = redis_url or ""
        self.want_prometheus = prometheus
        self.prometheus: ManagedProcess | None = None
        self.tinker = tinker
        self.serving_run = serving_run
        self.reward_model = reward_model
        self.engine_start_timeout_s = engine_start_timeout_s
        self.reward_model_engine: ManagedProcess | None = None
        if relay_fanout < 0:
            raise ValueError("relay_fanout must not be negative")
        self.relay_fanout = relay_fanout

    def _service_env(self, entry: ServiceEntry) -> dict[str, str]:
        """What this cluster sets for every process of `entry` beyond its own (extra_env wins)."""
        env: dict[str, str] = {}
        if self.nats_nodes > 1:  # every stream and consumer on every node
            env["POLICYLOOP_BUS__STREAM_REPLICAS"] = str(self.nats_nodes)
        if self.tinker and entry.name == "learner":  # the one learner trains the Tinker API's models too
            env["POLICYLOOP_TINKER"] = "true"
        if self.relay_fanout and entry.name == "publisher":
            env["POLICYLOOP_TREE__FANOUT"] = str(self.relay_fanout)
        if self.relay_fanout and entry.name == "rollout":  # its relay on any free port of 127.0.0.1
            env["POLICYLOOP_RELAY__ENABLED"] = "true"
        if self.reward_model_engine is not None and entry.name in SCORING_SERVICES:
            env |= reward_model_env({REWARD_MODEL_NAME: [engine_url(self.reward_model_engine)]})
        return env | self.extra_env

    def start(self) -> ClusterInfo:
        if self.fresh:
            # A new run: no streams, versions or weights left from an earlier one.
            for data in ("nats", "redis", "weights", "rollout-weights", "evaluator-weights", "checkpoints",
                         "logs", "prometheus"):
                shutil.rmtree(self.run_dir / data, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.given_nats_url and self.nats_nodes == 1:
                self.nats_servers = [start_nats(self.run_dir)]
                self.nats_url = f"nats://127.0.0.1:{self.nats_servers[0].ports['client']}"
            elif not self.given_nats_url:
                self.nats_servers = start_nats_cluster(self.run_dir, self.nats_nodes)
                self.nats_url = ",".join(f"nats://127.0.0.1:{m.ports['client']}" for m in self.nats_servers)
            if not self.given_redis_url:
                self.redis = start_redis(self.run_dir)
                self.redis_url = f"redis://127.0.0.1:{self.redis.ports['client']}/0"
            if self.reward_model is not None:
                # First, so that its URL is known to the services that score with it.
                self.reward_model_engine = reward_model_process(self.reward_model, self.run_dir)
                self.processes.append(self.reward_model_engine)
            for entry in self.services:
                env = self._service_env(entry)
                for index in range(self.replicas.get(entry.name, 1)):
                    self.processes.append(service_process(entry, index, self.run_dir, self.nats_url,
                                                          self.redis_url, self.namespace, env))
            rollout = catalogue_entry("rollout")
            if self.tinker:
                self.processes.append(service_process(rollout, 0, self.run_dir, self.nats_url, self.redis_url,
                                                      self.namespace, self._service_env(rollout),
                                                      role=TINKER_SAMPLER))
            if self.serving_run:
                self.processes.append(service_process(rollout, 0, self.run_dir, self.nats_url, self.redis_url,
                                                      self.namespace, self._service_env(rollout), role=SERVING,
                                                      serve_run=self.serving_run))
            for proc in self.processes:
                if proc is not self.reward_model_engine:
                    self._point_at_publisher(proc)
                proc.start()
            if self.reward_model_engine is not None:
                # The services load meanwhile; a scoring before the engine answers is retried anyway.
                wait_engine_healthy(self.reward_model_engine, self.engine_start_timeout_s)
            self._start_prometheus()
        except BaseException:
            self.stop()
            raise
        info = self.info()
        info.save()
        return info

    def _point_at_publisher(self, proc: ManagedProcess) -> None:
        """The learner pushes versions to the (single) publisher, unless extra_env names one."""
        publishers = [p for p in self.processes if service_of(p.name) == "publisher"]
        if publishers and "POLICYLOOP_PUBLISHER_ENDPOINT" not in self.extra_env:
            proc.env["POLICYLOOP_PUBLISHER_ENDPOINT"] = f"127.0.0.1:{publishers[0].ports['grpc']}"

    def _start_prometheus(self) -> None:
        binary = prometheus_binary()
        if self.want_prometheus is False or (binary is None and self.want_prometheus is None):
            return
        if binary is None:
            raise ClusterError("prometheus is not installed (Debian: apt-get install prometheus)")
        directory = self.run_dir / "prometheus"
        write_config(directory)
        write_targets(directory, self.scrape_targets())
        port = free_port()
        self.prometheus = ManagedProcess("prometheus", prometheus_command(binary, directory, port), dict(os.environ),
                                         self.run_dir / "logs" / "prometheus.log", {"client": port})
        self.prometheus.start()
        wait_for_port("127.0.0.1", port, 30, self.prometheus.proc)
        if not wait_ready(self.prometheus_url, 30):
            raise ClusterError(f"prometheus at {self.prometheus_url} is not ready (log: {self.prometheus.log_path})")

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus.ports['client']}" if self.prometheus is not None else ""

    def scrape_targets(self) -> list[ScrapeTarget]:
        return [ScrapeTarget(service_of(p.name), p.name, f"127.0.0.1:{p.ports['http']}")
                for p in self.processes if "http" in p.ports]

    def write_scrape_targets(self) -> None:
        """Tells Prometheus (when it runs) which processes to scrape: after every change to them."""
        if self.prometheus is not None:
            write_targets(self.run_dir / "prometheus", self.scrape_targets())

    def scale(self, service: str, replicas: int) -> None:
        """Starts or stops (SIGTERM, the highest indexes first) instances of `service` until it
        has `replicas`; Prometheus scrapes the new set."""
        entry = next((e for e in self.services if e.name == service), None)
        if entry is None or replicas < 0:
            raise ValueError(f"cannot scale {service!r} to {replicas}")
        running = [p for p in self.processes if service_of(p.name) == service]
        for index in range(len(running), replicas):
            managed = service_process(entry, index, self.run_dir, self.nats_url, self.redis_url, self.namespace,
                                      self._service_env(entry))
            self._point_at_publisher(managed)
            managed.start()
            self.processes.append(managed)
        leaving = running[replicas:]
        for managed in leaving:
            managed.signal(signal.SIGTERM)
        _wait_all(leaving, self.stop_grace_s)
        self.processes = [p for p in self.processes if p not in leaving]
        self.write_scrape_targets()
        self.info().save()

    @property
    def infrastructure(self) -> list[ManagedProcess]:
        """The NATS server(s), Redis and Prometheus this cluster started."""
        return self.nats_servers + [m for m in (self.redis, self.prometheus) if m is not None]

    @property
    def nats_monitor_urls(self) -> list[str]:
        """Monitoring endpoints of the cluster's nodes (empty for one server)."""
        return [f"http://127.0.0.1:{m.ports['monitor']}" for m in self.nats_servers if "monitor" in m.ports]

    def info(self) -> ClusterInfo:
        managed = self.infrastructure + self.processes
        return ClusterInfo(
            str(self.run_dir), self.nats_url, self.redis_url, self.namespace, os.getpid(),
            processes={p.name: p.ports for p in managed},
            pids={p.name: p.proc.pid for p in managed if p.proc is not None},
            nats_nodes=self.nats_nodes, prometheus_url=self.prometheus_url,
        )

    def supervise(self, keep_down: Collection[str] = ()) -> list[str]:
        """Restarts processes that exited, except those named in `keep_down`; returns the names
        restarted."""
        restarted = []
        infrastructure = self.infrastructure
        for managed in infrastructure + self.processes:
            if managed.name in keep_down:
                continue
            if managed.proc is not None and managed.proc.poll() is not None:
                managed.restarts += 1
                managed.start()
                if managed in infrastructure:
                    wait_for_port("127.0.0.1", managed.ports["client"], 15, managed.proc)
                restarted.append(managed.name)
        if restarted:
            self.write_scrape_targets()
            self.info().save()
        return restarted

    def process(self, name: str) -> ManagedProcess:
        for managed in self.infrastructure + self.processes:
            if managed.name == name:
                return managed
        raise KeyError(name)

    def stop(self) -> None:
        """SIGTERM to every service (they finish or nak what they hold), then the servers."""
        for managed in self.processes:
            managed.signal(signal.SIGTERM)
        _wait_all(self.processes, self.stop_grace_s)
        infra = list(reversed(self.infrastructure))
        for managed in infra:
            managed.signal(signal.SIGTERM)
        _wait_all(infra, 10)


def _wait_all(processes: list[ManagedProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for managed in processes:
        if managed.proc is None:
            continue
        try:
            managed.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            managed.proc.kill()
            managed.proc.wait()
