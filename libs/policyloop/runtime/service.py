"""What every service process does around its own loop: logging, connections to NATS and
Redis, the topology, /metrics and /healthz, a Redis heartbeat, and a graceful stop.

A service is an async function `body(ctx)` that runs until `ctx.stop` is set and then returns
once it has finished or handed back (nacked) what it holds.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import redis.asyncio as aioredis
import redis.exceptions
from google.protobuf import json_format
from google.protobuf.message import Message

from policyloop.bus import Bus, BusUnavailable, PullWorker
from policyloop.bus.topology import build_topology
from policyloop.common.clock import now_ms
from policyloop.runtime.settings import ServiceSettings
from policyloop.state import Heartbeat, HeartbeatRegistry, StateUnavailable, VersionRegistry, connect_redis
from policyloop.telemetry import tracing
from policyloop.telemetry.http import HealthReport, start_http
from policyloop.telemetry.logging import bind_policy_version, configure_logging, get_logger
from policyloop.telemetry.metrics import POLICY_VERSION, SERVICE_UP

log = get_logger(__name__)

HealthProbe = Callable[[], tuple[bool, str]]


@dataclass
class ServiceContext:
    name: str
    settings: ServiceSettings
    bus: Bus
    redis: aioredis.Redis
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    http_port: int = 0
    # The role's typed status (contracts status.proto), reported in every heartbeat and in
    # /healthz. A callable, so that figures kept outside the role's own code are read fresh.
    status: Callable[[], Message] | None = None
    _probes: dict[str, HealthProbe] = field(default_factory=dict)
    _policy_version: int = 0
    _version_moved: asyncio.Event = field(default_factory=asyncio.Event)
    redis_ok: bool = True
    health_url: str = ""
    grpc_endpoint: str = ""  # host:port of this process's gRPC server, if it has one (heartbeats)
    # False until the body says it can do its work (engine up, consumers bound, servers listening).
    ready: bool = False

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        if version != self._policy_version:
            self._version_moved.set()  # wakes whoever waits in version_moved
            self._version_moved = asyncio.Event()
        self._policy_version = version
        bind_policy_version(version)
        POLICY_VERSION.labels(self.name).set(version)

    async def version_moved(self, since: int, timeout_s: float) -> bool:
        """Waits until the policy version is other than `since`, at most `timeout_s`; whether it is."""
        if self._policy_version != since:
            return True
        moved = self._version_moved
        try:
            await asyncio.wait_for(moved.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    @functools.cached_property
    def versions(self) -> VersionRegistry:
        return VersionRegistry(self.redis, self.settings.namespace)

    def add_health_probe(self, name: str, probe: HealthProbe) -> None:
        """`probe` returns (healthy, reason); the service is healthy when all probes are."""
        self._probes[name] = probe

    def health(self) -> HealthReport:
        checks: dict[str, str] = {}
        healthy = True
        nats_ok = self.bus.nc.is_connected
        checks["nats"] = "ok" if nats_ok else "disconnected"
        checks["redis"] = "ok" if self.redis_ok else "unreachable"
        checks["ready"] = "ok" if self.ready else "starting"
        healthy = nats_ok and self.redis_ok and self.ready
        for name, probe in self._probes.items():
            ok, reason = probe()
            checks[name] = "ok" if ok else reason
            healthy = healthy and ok
        SERVICE_UP.labels(self.name).set(1 if healthy else 0)
        status = {} if self.status is None else json_format.MessageToDict(
            self.status(), preserving_proto_field_name=True)
        return HealthReport(
            healthy,
            {"service": self.name, "instance": self.settings.instance_id,
             "policy_version": self.policy_version, "checks": checks, **status},
        )

    def heartbeat(self, started_ms: int) -> Heartbeat:
        report = self.health()
        beat = Heartbeat(service=self.name, instance=self.settings.instance_id, healthy=report.healthy,
                         policy_version=self.policy_version, health_url=self.health_url,
                         checks=report.detail["checks"], pid=os.getpid(), host=socket.gethostname(),
                         started_unix_ms=started_ms, grpc_endpoint=self.grpc_endpoint)
        if self.status is not None:
            status = self.status()
            field = next((f for f in Heartbeat.DESCRIPTOR.oneofs_by_name["status"].fields
                          if f.message_type is status.DESCRIPTOR), None)
            if field is not None:  # a status the heartbeat has no field for is still in /healthz
                getattr(beat, field.name).CopyFrom(status)
        return beat


ServiceBody = Callable[[ServiceContext], Awaitable[None]]


class ServiceCannotStart(Exception):
    """Raised by a body before it takes work when this process cannot do its job (e.g. the
    device it was configured for is missing): one clear log line instead of a traceback."""


async def model_directory(name: str, setting: str = "model_path") -> Path:
    """The directory of the model a setting names (a directory, or a Hugging Face model id looked
    up in the Hugging Face cache: models.resolve), found off the event loop as a service starts;
    none stops the start with the reason."""
    from policyloop.models.resolve import ModelNotFound, resolve_model

    try:
        directory = await asyncio.to_thread(resolve_model, name, setting=setting)
    except ModelNotFound as exc:
        raise ServiceCannotStart(str(exc)) from exc
    if str(directory) != str(name):
        log.info("model_resolved", setting=setting, name=str(name), directory=str(directory))
    return directory


async def _heartbeat_loop(ctx: ServiceContext, registry: HeartbeatRegistry, started_ms: int) -> None:
    s = ctx.settings
    while True:
        try:
            await registry.beat(ctx.heartbeat(started_ms), s.heartbeat_ttl_s)
            ctx.redis_ok = True
        except (redis.exceptions.RedisError, OSError) as exc:
            ctx.redis_ok = False
            log.warning("heartbeat_failed", error=repr(exc))
        # redis-py can absorb a cancellation that lands during a call (the call returns or fails
        # instead): without this check the loop would go on beating and the service's stop,
        # which waits for it, would never end (seen when a body fails at once).
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        await asyncio.sleep(s.heartbeat_interval_s)


async def serve(name: str, settings: ServiceSettings, body: ServiceBody) -> int:
    """Runs one service until SIGTERM/SIGINT; returns the process exit code."""
    configure_logging(service=name, run_id=settings.run_id, instance=settings.instance_id,
                      level=settings.log_level)
    tracing.setup_tracing(name, settings.instance_id, settings.tracing)
    started_ms = now_ms()
    bus = await Bus.connect(settings.nats_url, name=f"{name}:{settings.instance_id}",
                            topology=build_topology(settings.bus),
                            connect_timeout_s=settings.connect_timeout_s)
    await bus.ensure_topology()
    client = await connect_redis(settings.redis_url, connect_timeout_s=settings.connect_timeout_s,
                                 pool=settings.redis_pool)
    ctx = ServiceContext(name=name, settings=settings, bus=bus, redis=client)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stop.set)
    runner, ctx.http_port = await start_http(ctx.health, settings.http_host, settings.http_port)
    ctx.health_url = f"http://{settings.advertise_host}:{ctx.http_port}/healthz"
    registry = HeartbeatRegistry(client, settings.namespace)
    heartbeat = asyncio.create_task(_heartbeat_loop(ctx, registry, started_ms))
    log.info("service_started", http_port=ctx.http_port, nats=settings.nats_url,
             redis=settings.redis_url)
    exit_code = 0
    body_task = asyncio.create_task(body(ctx))
    stop_wait = asyncio.create_task(ctx.stop.wait())
    try:
        await asyncio.wait({body_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not body_task.done():
            log.info("service_stopping", grace_s=settings.shutdown_grace_s)
            # The body drains within the grace period; a margin lets it nak what is left.
            done, _ = await asyncio.wait({body_task}, timeout=settings.shutdown_grace_s + 5)
            if not done:
                log.error("service_stop_timeout")
                body_task.cancel()
                await asyncio.gather(body_task, return_exceptions=True)
        if body_task.done() and not body_task.cancelled() and body_task.exception() is not None:
            exc = body_task.exception()
            if isinstance(exc, ServiceCannotStart):
                log.error("service_cannot_start", error=str(exc))
            else:
                log.error("service_failed", error=repr(exc), exc_info=exc)
            exit_code = 1
    finally:
        stop_wait.cancel()
        heartbeat.cancel()
        await asyncio.gather(heartbeat, stop_wait, return_exceptions=True)
        try:
            await registry.remove(name, settings.instance_id)
        except (redis.exceptions.RedisError, OSError):
            pass
        await runner.cleanup()
        await bus.close()
        await client.aclose()
        await asyncio.to_thread(tracing.shutdown_tracing)
        log.info("service_stopped", exit_code=exit_code)
    return exit_code


def limit_threads(threads: int = 1) -> None:
    """Keeps math libraries from starting one thread per core in every service process
    (several services share two cores here). Call before importing torch/numpy."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))


async def run_pull_workers(ctx: ServiceContext, *workers: PullWorker) -> None:  # type: ignore[type-arg]
    """Runs pull workers until the stop signal, then drains them: in-flight messages get the
    grace period to finish and are nacked after it."""
    for worker in workers:
        ctx.add_health_probe(
            f"consumer:{worker.consumer.durable}",
            lambda w=worker: (w.bound, f"not bound: {w.last_error}"),
        )
    loops = [asyncio.create_task(w.run(ctx.stop)) for w in workers]
    backlogs = asyncio.create_task(_report_backlogs(ctx, [w.consumer.durable for w in workers]))
    ctx.ready = True  # from here on, health follows the workers' probes
    try:
        await ctx.stop.wait()
    finally:
        backlogs.cancel()  # figures only: a consumer_info call in flight must not delay the drain
        await asyncio.gather(backlogs, *loops, return_exceptions=True)
        await asyncio.gather(*(w.drain(ctx.settings.shutdown_grace_s) for w in workers))


async def run_loops(ctx: ServiceContext, loops: dict[str, Coroutine[Any, Any, None]], *workers: PullWorker,  # type: ignore[type-arg]
                    after_stop: Callable[[], Awaitable[None]] | None = None, finish_s: float = 5.0) -> None:
    """Runs a role's loops beside its pull workers (or, with none, until the stop signal). A loop
    that fails stops the process — the workers hand back what they hold and a supervisor restarts
    it — and is raised. At the stop, the loops get `finish_s` to finish (a step under way) before
    they are cancelled; then `after_stop` (e.g. waiting for a checkpoint being written)."""
    tasks = {name: asyncio.create_task(loop, name=name) for name, loop in loops.items()}

    def on_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("loop_failed", loop=task.get_name(), error=repr(task.exception()))
            ctx.stop.set()

    for task in tasks.values():
        task.add_done_callback(on_done)
    done: set[asyncio.Task[None]] = set()
    try:
        if workers:
            await run_pull_workers(ctx, *workers)
        else:
            ctx.ready = True
            await ctx.stop.wait()
    finally:
        if tasks:
            done, pending = await asyncio.wait(set(tasks.values()), timeout=finish_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if after_stop is not None:
            await after_stop()
    failed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if failed:
        raise RuntimeError(f"the {failed[0].get_name()} loop failed") from failed[0].exception()


async def _report_backlogs(ctx: ServiceContext, durables: list[str]) -> None:
    """Keeps policyloop_bus_backlog_messages of the consumers this process reads current (every
    replica reports the same figures: a dashboard takes the max over instances)."""
    while not ctx.stop.is_set():
        for durable in durables:
            try:
                await ctx.bus.backlog(durable)
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                log.debug("backlog_unknown", consumer=durable, error=repr(exc))
        try:
            await asyncio.wait_for(ctx.stop.wait(), ctx.settings.heartbeat_interval_s)
        except TimeoutError:
            pass


def run_main(name: str, settings_model: type[ServiceSettings], body: ServiceBody,
             argv: list[str] | None) -> int:
    """Entry point of a service process: settings from env and flags, then `serve`."""
    from policyloop.runtime.settings import load_settings

    settings = load_settings(settings_model, list(argv or []))
    try:
        return asyncio.run(serve(name, settings, body))
    except (BusUnavailable, StateUnavailable) as exc:
        # Nothing was taken from the bus yet: say why and let the supervisor retry.
        log.error("service_cannot_start", error=str(exc))
        return 1
