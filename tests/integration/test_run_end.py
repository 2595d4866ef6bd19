"""A run ends: FINISHED once every task it fed is trained, dropped or dead-lettered, with counts in
its Run that add up; its last groups, which fill no learner batch, are trained as one of their own;
a stopped run accounts for what it had in flight; WatchRun and `policyloop run watch` end with it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc

from policyloop.bus import Bus
from policyloop.bus.deadletter import publish_dead_letter
from policyloop.contracts.ids import task_id
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc
from policyloop.gateway.dead_letters import dead_task
from policyloop.state import IdempotencyKeys
from policyloop.state.outcomes import TaskCount
from tests.conftest import ServiceLauncher
from tests.helpers import addition_environment, eventually

POLICYLOOP = [sys.executable, "-m", "policyloop"]
LOOP = {"POLICYLOOP_GROUPS_PER_STEP": "3"}  # the learner's and the replicas' (they must agree)


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POLICYLOOP, *args], capture_output=True, text=True, timeout=timeout_s)


def accounted(run: loop_pb2.Run) -> int:
    return run.progress.tasks_trained + run.progress.tasks_dropped + run.progress.tasks_dead_lettered


async def test_a_run_finishes_with_its_last_partial_batch_trained_and_a_stopped_run_accounts_for_all(
        bus: Bus, services: ServiceLauncher, redis_client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    learner = services.start("learner", env=LOOP | {"POLICYLOOP_PUBLISHER_ENDPOINT":
                                                    f"127.0.0.1:{publisher.ports['grpc']}"})
    rollout, reward = services.start("rollout", env=LOOP), services.start("reward")
    gateway = services.start("gateway")
    await services.wait_healthy(learner, rollout, reward, gateway, timeout_s=120)
    address = ["--gateway", f"127.0.0.1:{gateway.ports['grpc']}"]
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(10, 30)))
    submitted = await asyncio.to_thread(cli, "env", "submit", str(tasks), "--name", "sums", "--group-size", "2",
                                        *address)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    # 4 tasks for batches of 3 groups: one full step, then the last group alone.
    started = await asyncio.to_thread(cli, "run", "start", "--env", "sums@v1", "--num-tasks", "4", "--run-id",
                                      "four", *address)
    assert started.returncode == 0, started.stdout + started.stderr
    watched = await asyncio.to_thread(cli, "run", "watch", "four", *address, timeout_s=240)  # returns when it ends
    assert watched.returncode == 0, watched.stdout + watched.stderr
    last = watched.stdout.strip().splitlines()[-1]
    assert last.startswith("finished") and "tasks trained 4 dropped 0 dead-lettered 0 in flight 0" in last, last
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id="four"))
        assert run.state == loop_pb2.RUN_STATE_FINISHED
        assert (run.tasks_total, run.tasks_enqueued, accounted(run), run.progress.tasks_trained) == (4, 4, 4, 4)
        assert run.progress.trained_samples == 8 and run.progress.learner_step == 2
        steps = [e for e in learner.log_events() if e["event"] == "step"]
        assert [e["samples"] for e in steps] == [6, 2]

        # A run stopped with tasks queued and groups in flight: each is trained or dropped, none left.
        await stub.StartRun(loop_pb2.StartRunRequest(
            run_id="stopped", num_tasks=30, environments=[loop_pb2.EnvironmentMix(environment="sums@v1", weight=1)]))

        async def some_trained() -> bool:
            return (await stub.GetRun(loop_pb2.GetRunRequest(run_id="stopped"))).progress.tasks_trained > 0

        await eventually(some_trained, timeout_s=120)
        await stub.StopRun(loop_pb2.StopRunRequest(run_id="stopped"))
        leases = IdempotencyKeys(redis_client, "default")

        async def all_accounted() -> bool:
            # The feeder has let the run go (having recorded how many it fed) and nothing is in flight.
            run = await stub.GetRun(loop_pb2.GetRunRequest(run_id="stopped"))
            return await leases.owner("feeder:stopped") is None and run.progress.tasks_in_flight == 0 and \
                accounted(run) == run.tasks_enqueued

        await eventually(all_accounted, timeout_s=120)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id="stopped"))
    assert run.state == loop_pb2.RUN_STATE_STOPPED and run.progress.tasks_dead_lettered == 0
    assert run.progress.tasks_dropped == sum(run.progress.tasks_dropped_by_reason.values())
    assert set(run.progress.tasks_dropped_by_reason) <= {"run_stopped", "stale"}
    assert run.progress.trained_samples == 2 * run.progress.tasks_trained


async def test_dead_lettered_tasks_count_in_their_run_which_then_finishes(
        bus: Bus, services: ServiceLauncher) -> None:
    """No rollout replica runs: the run's two tasks are dead-lettered by hand, one as it was, one
    as bytes no one can decode (named by its message id), and again (counted once)."""
    gateway = services.start("gateway")
    await services.wait_healthy(gateway)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=addition_environment(4)))
        await stub.StartRun(loop_pb2.StartRunRequest(run_id="doomed", num_tasks=2, environments=[
            loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)]))

        async def fed() -> bool:
            return (await bus.backlog("rollout")).pending == 2

        await eventually(fed, timeout_s=30)
        first = bus_pb2.Task.FromString((await bus.js.get_msg("TASKS", 1)).data or b"")
        letters = [(1, first.SerializeToString(), first.task_id), (2, b"\xff\x00garbage", task_id("doomed", 1)),
                   (1, first.SerializeToString(), first.task_id)]
        for seq, payload, msg_id in letters:
            await publish_dead_letter(bus, origin_stream="TASKS", origin_subject="pl.tasks.addition_demo",
                                      stream_seq=seq, consumer="rollout", payload=payload,
                                      headers={"Nats-Msg-Id": msg_id}, reason="test", kind="invalid",
                                      delivery_count=1, service="test")

        async def finished() -> bool:
            return (await stub.GetRun(loop_pb2.GetRunRequest(run_id="doomed"))).state == loop_pb2.RUN_STATE_FINISHED

        await eventually(finished, timeout_s=30)
        run = await stub.GetRun(loop_pb2.GetRunRequest(run_id="doomed"))
        watched = [r async for r in stub.WatchRun(loop_pb2.WatchRunRequest(run_id="doomed"))]  # ends at once
    assert (run.progress.tasks_dead_lettered, run.progress.tasks_trained, run.progress.tasks_in_flight) == (2, 0, 0)
    assert [r.state for r in watched] == [loop_pb2.RUN_STATE_FINISHED]


def test_a_dead_letter_names_its_run_and_task_by_payload_or_message_id() -> None:
    sample = bus_pb2.Trajectory(run_id="r", task_id="r:000000007", trajectory_id="r:000000007/0")
    group = bus_pb2.TrajectoryGroup(group_id="r:000000007", trajectories=[sample, sample])
    task = bus_pb2.Task(run_id="r", task_id="r:000000003")
    letter = bus_pb2.DeadLetter(origin_stream="TRAJECTORIES", payload=group.SerializeToString())
    assert dead_task(letter) == ("r", TaskCount("r:000000007", 2))
    assert dead_task(bus_pb2.DeadLetter(origin_stream="TASKS", payload=task.SerializeToString())) == \
        ("r", TaskCount("r:000000003", 0))
    about = bus_pb2.DeadLetter(origin_stream="DLQ", payload=letter.SerializeToString())  # the gateway failed on it
    assert dead_task(about) == ("r", TaskCount("r:000000007", 2))
    garbage = bus_pb2.DeadLetter(origin_stream="ROLLOUTS", payload=b"\xff\x00",
                                 headers={"Nats-Msg-Id": "a:b:000000001"})
    assert dead_task(garbage) == ("a:b", TaskCount("a:b:000000001", 0))
    assert dead_task(bus_pb2.DeadLetter(origin_stream="ROLLOUTS", payload=b"\xff\x00")) is None
    assert dead_task(bus_pb2.DeadLetter(origin_stream="SANDBOX", payload=b"")) is None  # its caller accounts
