"""`policyloop demo` (what `make demo` runs): bring up the local cluster, submit an arithmetic
environment through the gateway's gRPC API, start a run, and follow its tasks through rollout,
reward and the learner until every group has arrived; then show the cluster's status.

The learning run arrives with the loop issue; this demo shows the services and the bus doing
their parts of it end to end.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from rich.console import Console

from policyloop.cluster.local import LocalCluster
from policyloop.cluster.status import ClusterStatus, cluster_status
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc
from policyloop.state import HeartbeatRegistry, connect_redis


def addition_environment(count: int, seed: int = 0, group_size: int = 4) -> loop_pb2.Environment:
    rng = random.Random(seed)
    tasks = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        tasks.append(loop_pb2.TaskSpec(prompt_text=f"{a}+{b}=", answer=str(a + b)))
    return loop_pb2.Environment(
        name="addition", version="demo", tasks=tasks,
        builtin=loop_pb2.BuiltinVerifier(kind=loop_pb2.BuiltinVerifier.KIND_EXACT_ANSWER),
        group_size=group_size,
        sampling=bus_pb2.SamplingParams(max_new_tokens=8, temperature=1.0),
    )


async def _learner_groups(redis_url: str, namespace: str) -> int:
    client = await connect_redis(redis_url)
    try:
        beats = await HeartbeatRegistry(client, namespace).alive("learner")
        return sum(int(b.detail.get("groups_complete", 0)) for b in beats)
    finally:
        await client.aclose()


async def _drive(cluster: LocalCluster, tasks: int, group_size: int, console: Console,
                 timeout_s: float) -> tuple[bool, ClusterStatus, loop_pb2.Run]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await cluster_status(cluster.nats_url, cluster.redis_url, cluster.namespace)
        if status.all_healthy:
            break
        if time.monotonic() > deadline:
            return False, status, loop_pb2.Run()
        await asyncio.sleep(0.5)
    console.print("[green]all six services are healthy[/green]")
    gateway = cluster.process("gateway-0").ports["grpc"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        env = addition_environment(tasks, group_size=group_size)
        reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=10)
        console.print(f"submitted environment {reply.environment} ({reply.num_tasks} tasks)")
        run = await stub.StartRun(loop_pb2.StartRunRequest(
            environments=[loop_pb2.EnvironmentMix(environment=reply.environment, weight=1.0)],
            num_tasks=tasks, seed=1,
        ), timeout=10)
        console.print(f"started {run.run_id}: {run.tasks_total} tasks × {group_size} samples")
        started = time.monotonic()
        groups = 0
        while groups < tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            groups = await _learner_groups(cluster.redis_url, cluster.namespace)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id=run.run_id), timeout=10)
        elapsed = time.monotonic() - started
        console.print(f"the learner received {groups} of {tasks} complete groups "
                      f"({groups * group_size} trajectories) in {elapsed:.1f}s")
    status = await cluster_status(cluster.nats_url, cluster.redis_url, cluster.namespace)
    return groups >= tasks, status, run


def run_demo(run_dir: Path, *, tasks: int, group_size: int, console: Console,
             print_status: Callable[[ClusterStatus], None], timeout_s: float = 120.0) -> int:
    cluster = LocalCluster(run_dir)
    console.print(f"starting the local cluster in {run_dir} …")
    cluster.start()
    try:
        ok, status, _run = asyncio.run(_drive(cluster, tasks, group_size, console, timeout_s))
        print_status(status)
        if ok and status.all_healthy:
            console.print("[green]demo complete[/green]: gateway → TASKS → rollout → ROLLOUTS → reward "
                          "→ TRAJECTORIES → learner, every message acknowledged once")
            return 0
        console.print(f"[red]demo did not complete[/red]; logs are in {cluster.run_dir}/logs")
        return 1
    finally:
        cluster.stop()
