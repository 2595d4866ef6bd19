"""Service processes against real nats-server and redis-server: messages cross processes,
redelivery after a kill, graceful SIGTERM, dead letters, reconnects after a NATS restart."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

import pytest

from policyloop.bus import Bus, rollouts_subject, sandbox_subject, tasks_subject
from policyloop.contracts.v1 import bus_pb2
from tests.conftest import Server, ServiceLauncher
from tests.helpers import cgroups_available, eventually, publish_group, stored, stored_messages, stored_samples

# How the reward service scores "12+34=": the exact answer, typed on the Task and its Trajectories.
EXACT_46 = bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_EXACT_ANSWER), answer="46")


def task(task_id: str, group_size: int = 3) -> bus_pb2.Task:
    return bus_pb2.Task(task_id=task_id, run_id="r1", environment="addition@v1", prompt_text="12+34=",
                        group_size=group_size, scorer=EXACT_46, metadata={"source": "test"},
                        sampling=bus_pb2.SamplingParams(max_new_tokens=6, temperature=1.0, seed=7))


async def trajectory_ids(bus: Bus) -> list[str]:
    return sorted(t.trajectory_id for t in await stored_samples(bus, "TRAJECTORIES"))


async def test_task_crosses_rollout_and_reward_processes(bus: Bus, services: ServiceLauncher) -> None:
    rollout = services.start("rollout")
    reward = services.start("reward")
    await services.wait_healthy(rollout, reward)
    await bus.publish(tasks_subject("addition@v1"), task("t1"), "t1")

    async def arrived() -> bool:
        return await trajectory_ids(bus) == ["t1/0", "t1/1", "t1/2"]

    await eventually(arrived)
    trajectories = await stored_samples(bus, "TRAJECTORIES")
    assert {t.rollout_replica for t in trajectories} == {rollout.instance}
    for t in trajectories:
        n = len(t.response_token_ids)
        assert t.group_id == "t1" and t.scorer == EXACT_46 and t.metadata["source"] == "test"
        assert t.prompt_text == "12+34="
        assert 1 <= n <= 6 and len(t.behaviour_logprobs) == n and all(lp <= 0 for lp in t.behaviour_logprobs)
        assert list(t.loss_mask) == [True] * n
        assert [(s.version, s.start, s.end) for s in t.version_spans] == [(0, 0, n)]
        assert t.finish_reason in (bus_pb2.FINISH_REASON_STOP, bus_pb2.FINISH_REASON_LENGTH)
        assert t.scored and {c.name for c in t.reward_breakdown} == {"format", "exact_answer"}
        assert t.reward == sum(c.value * c.weight for c in t.reward_breakdown)
    # Seeded sampling: sample i of the group used seed 7 + i, so the samples differ.
    assert len({tuple(t.response_token_ids) for t in trajectories}) > 1
    assert await stored_messages(bus, "TASKS") == [] and await stored_messages(bus, "ROLLOUTS") == []
    # Health and metrics over HTTP; JSON logs carrying the service's identity.
    with urllib.request.urlopen(f"http://127.0.0.1:{reward.ports['http']}/healthz", timeout=5) as r:
        health = json.loads(r.read())
    assert health["healthy"] is True and health["service"] == "reward"
    with urllib.request.urlopen(f"http://127.0.0.1:{reward.ports['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    # The group went as one message.
    assert 'policyloop_bus_consumed_total{consumer="reward",outcome="acked",stream="ROLLOUTS"} 1.0' in metrics
    assert rollout.terminate() == 0 and reward.terminate() == 0
    events = reward.log_events()
    assert events and all({"service", "run_id", "policy_version", "instance"} <= e.keys() for e in events)
    assert events[-1]["event"] == "service_stopped"


async def test_undecodable_message_is_dead_lettered_and_the_service_keeps_running(
    bus: Bus, services: ServiceLauncher
) -> None:
    """So are a rollout with a malformed scorer and one that names no scorer, each with its reason, and a
    group with one such sample, whole."""
    reward = services.start("reward")
    await services.wait_healthy(reward)
    await bus.publish_bytes(rollouts_subject("addition@v1"), b"\x08\x96\x01\xff\xff", {"Nats-Msg-Id": "bad"})

    def rollout(trajectory_id: str, scorer: bus_pb2.Scorer | None) -> bus_pb2.Trajectory:
        task_id = trajectory_id.split("/")[0]
        return bus_pb2.Trajectory(trajectory_id=trajectory_id, task_id=task_id, group_id=task_id, group_size=1,
                                  environment="addition@v1", response_text="46",
                                  finish_reason=bus_pb2.FINISH_REASON_STOP, scorer=scorer)

    malformed = bus_pb2.Scorer(builtin=bus_pb2.BuiltinVerifier(kind=bus_pb2.BuiltinVerifier.KIND_REGEX))
    for traj in (rollout("t1/0", EXACT_46), rollout("malformed/0", malformed), rollout("unscored/0", None)):
        await publish_group(bus, rollouts_subject("addition@v1"), traj)
    # A group is scored whole or not at all: GRPO's advantages need every member.
    mixed = [rollout("mixed/0", EXACT_46), rollout("mixed/1", None)]
    for i, traj in enumerate(mixed):
        traj.group_size, traj.sample_index = 2, i
    await publish_group(bus, rollouts_subject("addition@v1"), *mixed)

    async def settled() -> bool:
        return await trajectory_ids(bus) == ["t1/0"] and len(await stored_messages(bus, "DLQ")) == 4

    await eventually(settled)
    letters = {letter.headers.get("Nats-Msg-Id"): letter for letter in await stored(bus, "DLQ", bus_pb2.DeadLetter)}
    [scored] = await stored_samples(bus, "TRAJECTORIES")
    assert scored.scored and scored.reward == pytest.approx(1.1)
    assert all(letter.service == "reward" and letter.origin_stream == "ROLLOUTS" for letter in letters.values())
    assert "cannot decode" in letters["bad"].reason and letters["bad"].payload == b"\x08\x96\x01\xff\xff"
    # Each names the sample and the field.
    assert "trajectories[0].scorer.builtin.pattern: a regex verifier needs a pattern" in letters["malformed"].reason
    assert "unscored/0" in letters["unscored"].reason
    assert "scorer: the trajectory names none" in letters["unscored"].reason
    assert "mixed/1" in letters["mixed"].reason and "scorer: the trajectory names none" in letters["mixed"].reason
    assert [t.trajectory_id for t in bus_pb2.TrajectoryGroup.FromString(letters["mixed"].payload).trajectories] == [
        "mixed/0", "mixed/1"]  # the whole group, as it came
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


def engine_pids(port: str) -> list[int]:
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"policyloop.engines.embedded" in cmd and port.encode() in cmd:
                pids.append(int(proc.name))
    return pids


async def test_embedded_engine_dies_with_its_rollout_replica(bus: Bus, services: ServiceLauncher) -> None:
    from policyloop.state import HeartbeatRegistry, connect_redis

    rollout = services.start("rollout")
    await services.wait_healthy(rollout)
    client = await connect_redis(services.redis.url)
    try:
        [beat] = await HeartbeatRegistry(client, "default").alive("rollout")
    finally:
        await client.aclose()
    port = beat.rollout.engine_url.rsplit(":", 1)[1]
    assert len(engine_pids(port)) == 1
    rollout.kill()  # SIGKILL: the replica cannot stop its engine itself

    async def gone() -> bool:
        return engine_pids(port) == []

    await eventually(gone, timeout_s=15)


# Two nodes: slow (two torchrun agents and a resume); the default run covers two agents'
# rendezvous and their update in test_trainer.py::test_two_torchrun_nodes_make_the_single_rank_update
# and this service path on one agent.
@pytest.mark.parametrize("nodes", [1, pytest.param(2, marks=pytest.mark.slow)])
async def test_learner_on_two_ranks_trains_and_publishes(bus: Bus, services: ServiceLauncher, nodes: int) -> None:
    """Two ranks: one torchrun agent with two processes, or two agents of one process each — two
    "nodes", as pods are, rendezvousing on node 0's address (its rank 0 is the service; node 1
    only follows) and sharing the checkpoint directory."""
    import sys

    from policyloop.bus import trajectories_subject
    from policyloop.cluster.local import free_port
    from policyloop.weights.client import WeightClient

    publisher = services.start("publisher")
    await services.wait_healthy(publisher)
    env = {"POLICYLOOP_GROUPS_PER_STEP": "2", "OMP_NUM_THREADS": "1",
           "POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"}
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        learner = services.start("learner", env=env, launcher=[*torchrun, "--nproc_per_node=2", "--nnodes=1",
                                                               f"--master_port={free_port()}"])
        follower = learner
    else:
        node = [*torchrun, "--nproc_per_node=1", "--nnodes=2", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}"]
        learner = services.start("learner", env=env, launcher=[*node, "--node_rank=0"])
        follower = services.start("learner", instance="learner-node1", env=env, launcher=[*node, "--node_rank=1"])
    await services.wait_healthy(learner, timeout_s=60)
    for task in ("a", "b"):
        for i in range(2):
            traj = bus_pb2.Trajectory(
                trajectory_id=f"{task}/{i}", task_id=task, group_id=task, sample_index=i, group_size=2,
                environment="addition@v1", prompt_token_ids=[5, 14, 6, 16], response_token_ids=[7 + i, 1],
                behaviour_logprobs=[-2.0, -2.0], loss_mask=[True, True], scored=True, reward=float(i),
                finish_reason=bus_pb2.FINISH_REASON_STOP,
                version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=2)],
            )
            await publish_group(bus, trajectories_subject("addition@v1"), traj, msg_id=traj.trajectory_id)
    client = WeightClient(f"127.0.0.1:{publisher.ports['grpc']}")
    try:
        async def published() -> bool:
            return [v.version for v in await client.list_versions("policy")] == [1]

        await eventually(published, timeout_s=60)
    finally:
        await client.close()

    async def acked() -> bool:
        b = await bus.backlog("learner")
        return b.pending == 0 and b.ack_pending == 0

    await eventually(acked)
    # torchrun turns SIGTERM into its own failure exit; what matters is that rank 0 stopped
    # gracefully (handing back what it held) and released the other rank.
    learner.terminate(timeout_s=60)
    if follower is not learner:  # node 1 ends with its follower, released by rank 0
        assert await asyncio.to_thread(follower.proc.wait, 60) is not None
    events = learner.log_events()
    assert any(e["event"] == "service_stopped" and e["exit_code"] == 0 for e in events)
    assert any(e["event"] == "follower_stopped" and e["steps"] == 1 for e in follower.log_events())
    # SIGTERM wrote a checkpoint (both ranks their shards); one rank resumes from it.
    assert any(e["event"] == "checkpoint_written" and e["version"] == 1 for e in events)
    single = services.start("learner", env={"POLICYLOOP_PUBLISHER_ENDPOINT": f"127.0.0.1:{publisher.ports['grpc']}"})
    await services.wait_healthy(single, timeout_s=60)
    [resumed] = [e for e in single.log_events() if e["event"] == "learner_resumed"]
    assert resumed["checkpoint_version"] == 1 and resumed["version"] == 1 and resumed["replayed"] == 0


async def test_a_runs_sandbox_jobs_share_its_quota(bus: Bus, services: ServiceLauncher) -> None:
    """per_run_concurrency 1: two jobs of one run never overlap, and the one waiting for its run's
    slot does not take a running slot: with two slots, a job of another run runs beside the first
    (it used to wait, the second slot held by the job waiting for its quota)."""
    results, _sub = await sandbox_results(bus, "test.quota")
    accounting = "required" if cgroups_available() else "off"
    sandbox = services.start("sandbox", env={"POLICYLOOP_CONCURRENCY": "2", "POLICYLOOP_PER_RUN_CONCURRENCY": "1",
                                             "POLICYLOOP_CGROUPS": accounting})
    await services.wait_healthy(sandbox)
    timed = ["sh", "-c", "date +%s.%N; sleep 1; date +%s.%N"]
    for job_id, run_id in (("r1", "r"), ("r2", "r"), ("s1", "s")):
        await bus.publish(sandbox_subject("shell"), bus_pb2.SandboxJob(
            job_id=job_id, run_id=run_id, command=timed, reply_subject="test.quota",
            limits=bus_pb2.SandboxLimits(wall_seconds=10)), job_id)

    async def finished() -> bool:
        return len(results) == 3

    await eventually(finished, timeout_s=30)
    spans = {r.job_id: tuple(float(t) for t in r.stdout.split()) for r in results}
    first, second = sorted((spans["r1"], spans["r2"]))
    assert first[1] <= second[0], spans  # run r: one at a time
    s_start, s_end = spans["s1"]
    assert s_start < first[1] and first[0] < s_end, spans  # run s beside run r's first job
    expected = bus_pb2.SANDBOX_ACCOUNTING_CGROUP if accounting == "required" else bus_pb2.SANDBOX_ACCOUNTING_RLIMIT
    assert all(r.accounting == expected for r in results)


async def test_a_sandbox_job_its_caller_gave_up_on_is_not_run(bus: Bus, services: ServiceLauncher) -> None:
    """A job still queued after its caller stopped waiting (expires_unix_ms) is acked unrun."""
    import time

    results, _sub = await sandbox_results(bus, "test.expiry")
    now_ms = int(time.time() * 1000)
    for job_id, expires in (("stale", now_ms - 1000), ("fresh", now_ms + 60_000), ("no-deadline", 0)):
        await bus.publish(sandbox_subject("shell"), bus_pb2.SandboxJob(
            job_id=job_id, command=["echo", job_id], reply_subject="test.expiry", expires_unix_ms=expires), job_id)
    sandbox = services.start("sandbox")
    await services.wait_healthy(sandbox)

    async def done() -> bool:
        backlog = await bus.backlog("sandbox")
        return len(results) == 2 and backlog.pending == 0 and backlog.ack_pending == 0

    await eventually(done, timeout_s=30)
    assert sorted(r.job_id for r in results) == ["fresh", "no-deadline"]
    assert [e for e in sandbox.log_events() if e["event"] == "job_expired"][0]["job"] == "stale"


async def test_a_task_whose_prompt_gives_no_tokens_is_dead_lettered(bus: Bus, services: ServiceLauncher) -> None:
    rollout = services.start("rollout", env={"POLICYLOOP_MAX_LAG": "-1"})
    await services.wait_healthy(rollout, timeout_s=60)
    # The test model's character tokenizer knows no letters: this prompt would be <unk> tokens only.
    await bus.publish(tasks_subject("addition@v1"), bus_pb2.Task(
        task_id="letters", run_id="r", environment="addition@v1", prompt_text="abc", group_size=2,
        sampling=bus_pb2.SamplingParams(max_new_tokens=4)), "letters")

    async def dead() -> bool:
        return len(await stored_messages(bus, "DLQ")) == 1

    await eventually(dead, timeout_s=30)
    [letter] = await stored(bus, "DLQ", bus_pb2.DeadLetter)
    assert letter.service == "rollout" and "prompt_text" in letter.reason and letter.delivery_count == 1
    assert "'a', 'b', 'c'" in letter.reason, letter.reason  # the characters it has no token for
    assert await stored_messages(bus, "ROLLOUTS") == []


async def test_a_stopped_runs_queued_tasks_are_acked_unsampled(
        bus: Bus, services: ServiceLauncher, redis_client) -> None:  # type: ignore[no-untyped-def]
    """After StopRun the rollout samples nothing more of the run: its queued Tasks are acked
    without a trajectory; Tasks of runs still going (or not registered) are sampled."""
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.state import HeartbeatRegistry
    from policyloop.state.catalog import RunRegistry

    runs = RunRegistry(redis_client, "default")
    await runs.create("stopped", loop_pb2.StartRunRequest(run_id="stopped"), 1)
    await runs.set_state("stopped", loop_pb2.RUN_STATE_STOPPED)
    await runs.create("going", loop_pb2.StartRunRequest(run_id="going"), 1)
    for run_id in ("stopped", "going"):
        await bus.publish(tasks_subject("addition@v1"), bus_pb2.Task(
            task_id=f"{run_id}-t", run_id=run_id, environment="addition@v1", prompt_text="12+34=", group_size=2,
            scorer=EXACT_46,
            sampling=bus_pb2.SamplingParams(max_new_tokens=4)), f"{run_id}-t")
    rollout = services.start("rollout", env={"POLICYLOOP_MAX_LAG": "-1"})
    await services.wait_healthy(rollout, timeout_s=60)

    async def done() -> bool:
        backlog = await bus.backlog("rollout")
        beats = await HeartbeatRegistry(redis_client, "default").alive("rollout")
        return backlog.pending == 0 and backlog.ack_pending == 0 and bool(beats) and \
            beats[0].rollout.tasks_skipped == 1 and beats[0].rollout.tasks_done == 1

    await eventually(done, timeout_s=60)
    assert {t.run_id for t in await stored_samples(bus, "ROLLOUTS")} == {"going"}
