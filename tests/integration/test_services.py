"""Service processes against real nats-server and redis-server: messages cross processes,
redelivery after a kill, graceful SIGTERM, dead letters, reconnects after a NATS restart."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

from policyloop.bus import Bus, rollouts_subject, sandbox_subject, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from tests.conftest import Server, ServiceLauncher
from tests.helpers import eventually, stored, stored_messages


def task(task_id: str, group_size: int = 3) -> bus_pb2.Task:
    return bus_pb2.Task(task_id=task_id, run_id="r1", environment="addition@v1", prompt_text="2+2=",
                        group_size=group_size, metadata={"answer": "4"})


async def trajectory_ids(bus: Bus) -> list[str]:
    return sorted(t.trajectory_id for t in await stored(bus, "TRAJECTORIES", bus_pb2.Trajectory))


async def test_task_crosses_rollout_and_reward_processes(bus: Bus, services: ServiceLauncher) -> None:
    rollout = services.start("rollout")
    reward = services.start("reward")
    await services.wait_healthy(rollout, reward)
    await bus.publish(tasks_subject("addition@v1"), task("t1"), "t1")

    async def arrived() -> bool:
        return await trajectory_ids(bus) == ["t1/0", "t1/1", "t1/2"]

    await eventually(arrived)
    trajectories = await stored(bus, "TRAJECTORIES", bus_pb2.Trajectory)
    assert {t.rollout_replica for t in trajectories} == {rollout.instance}
    assert all(t.metadata["answer"] == "4" and t.group_id == "t1" for t in trajectories)
    assert await stored_messages(bus, "TASKS") == [] and await stored_messages(bus, "ROLLOUTS") == []
    # Health and metrics over HTTP; JSON logs carrying the service's identity.
    with urllib.request.urlopen(f"http://127.0.0.1:{reward.ports['http']}/healthz", timeout=5) as r:
        health = json.loads(r.read())
    assert health["healthy"] is True and health["service"] == "reward"
    with urllib.request.urlopen(f"http://127.0.0.1:{reward.ports['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'policyloop_bus_consumed_total{consumer="reward",outcome="acked",stream="ROLLOUTS"} 3.0' in metrics
    assert rollout.terminate() == 0 and reward.terminate() == 0
    events = reward.log_events()
    assert events and all({"service", "run_id", "policy_version", "instance"} <= e.keys() for e in events)
    assert events[-1]["event"] == "service_stopped"


async def test_undecodable_message_is_dead_lettered_and_the_service_keeps_running(
    bus: Bus, services: ServiceLauncher
) -> None:
    reward = services.start("reward")
    await services.wait_healthy(reward)
    await bus.publish_bytes(rollouts_subject("addition@v1"), b"\x08\x96\x01\xff\xff", {"Nats-Msg-Id": "bad"})
    good = bus_pb2.Trajectory(trajectory_id="t1/0", task_id="t1", group_id="t1", group_size=1,
                              environment="addition@v1")
    await bus.publish(rollouts_subject("addition@v1"), good, "t1/0")

    async def settled() -> bool:
        return await trajectory_ids(bus) == ["t1/0"] and len(await stored_messages(bus, "DLQ")) == 1

    await eventually(settled)
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert letter.service == "reward" and letter.origin_stream == "ROLLOUTS"
    assert "cannot decode" in letter.reason and letter.payload == b"\x08\x96\x01\xff\xff"
    assert reward.proc.poll() is None


async def sandbox_results(bus: Bus, inbox: str) -> tuple[list[bus_pb2.SandboxResult], object]:
    results: list[bus_pb2.SandboxResult] = []

    async def on_result(msg) -> None:  # type: ignore[no-untyped-def]
        result = bus_pb2.SandboxResult()
        result.ParseFromString(msg.data)
        results.append(result)

    sub = await bus.nc.subscribe(inbox, cb=on_result)
    return results, sub


def sleeping_job(job_id: str, seconds: float, inbox: str) -> bus_pb2.SandboxJob:
    return bus_pb2.SandboxJob(
        job_id=job_id, command=["sh", "-c", f"sleep {seconds}; echo done"], reply_subject=inbox,
        limits=bus_pb2.SandboxLimits(wall_seconds=30),
    )


async def test_consumer_killed_while_holding_a_message_gets_it_redelivered_to_another(
    bus: Bus, services: ServiceLauncher
) -> None:
    results, _sub = await sandbox_results(bus, "test.results")
    first = services.start("sandbox", "sandbox-a")
    await services.wait_healthy(first)
    await bus.publish(sandbox_subject("shell"), sleeping_job("j1", 2, "test.results"), "j1")

    async def held() -> bool:
        return (await bus.backlog("sandbox")).ack_pending == 1

    await eventually(held)
    first.kill()  # SIGKILL: no chance to nak
    second = services.start("sandbox", "sandbox-b")
    await services.wait_healthy(second)

    async def finished() -> bool:
        return len(results) == 1

    await eventually(finished, timeout_s=30)
    [result] = results
    assert result.sandbox_instance == "sandbox-b" and result.exit_code == 0 and result.stdout == b"done\n"
    assert await stored_messages(bus, "SANDBOX") == [] and await stored_messages(bus, "DLQ") == []


async def test_sigterm_hands_back_what_the_service_holds(bus: Bus, services: ServiceLauncher) -> None:
    results, _sub = await sandbox_results(bus, "test.results")
    # Long ack wait: the job can only reach the second replica quickly if the first naks it.
    from tests.conftest import fast_limits

    slow_ack = fast_limits(sandbox_ack_wait_s=60.0)
    first = services.start("sandbox", "sandbox-a", env={"POLICYLOOP_SHUTDOWN_GRACE_S": "0.5"}, limits=slow_ack)
    await services.wait_healthy(first)
    await bus.publish(sandbox_subject("shell"), sleeping_job("j1", 3, "test.results"), "j1")

    async def held() -> bool:
        return (await bus.backlog("sandbox")).ack_pending == 1

    await eventually(held)
    first.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.proc.wait, 30) == 0
    second = services.start("sandbox", "sandbox-b", limits=slow_ack)
    await services.wait_healthy(second)

    async def finished() -> bool:
        return len(results) == 1

    # Well inside the 60 s ack wait: the first replica handed the job back when it stopped.
    await eventually(finished, timeout_s=20)
    assert results[0].sandbox_instance == "sandbox-b" and results[0].stdout == b"done\n"
    assert any(e["event"] == "service_stopped" for e in first.log_events())


async def test_services_reconnect_and_resume_after_nats_restart(
    bus: Bus, services: ServiceLauncher, nats_server: Server
) -> None:
    rollout = services.start("rollout")
    reward = services.start("reward")
    await services.wait_healthy(rollout, reward)
    await bus.publish(tasks_subject("addition@v1"), task("t1", 1), "t1")
    await eventually(lambda: _ids_are(bus, ["t1/0"]))
    nats_server.restart()
    await bus.publish(tasks_subject("addition@v1"), task("t2", 2), "t2", timeout_s=2, attempts=20)
    await eventually(lambda: _ids_are(bus, ["t1/0", "t2/0", "t2/1"]), timeout_s=40)
    assert rollout.proc.poll() is None and reward.proc.poll() is None
    await services.wait_healthy(rollout, reward)


async def _ids_are(bus: Bus, expected: list[str]) -> bool:
    return await trajectory_ids(bus) == expected


async def test_service_without_nats_exits_with_a_clear_reason(services: ServiceLauncher) -> None:
    from policyloop.cluster.local import free_port

    reward = services.start("reward", env={"POLICYLOOP_NATS_URL": f"nats://127.0.0.1:{free_port()}",
                                           "POLICYLOOP_CONNECT_TIMEOUT_S": "1"})
    assert await asyncio.to_thread(reward.proc.wait, 30) == 1
    [failure] = [e for e in reward.log_events() if e["event"] == "service_cannot_start"]
    assert failure["error"].startswith("no NATS server at nats://127.0.0.1:")
