"""The bus on a 3-node JetStream cluster (nats-server 2.9): replicated streams and consumers,
and losing the node that leads TRAJECTORIES."""

from __future__ import annotations

import asyncio
from pathlib import Path

from policyloop.bus import Bus, Delivery, PullWorker, build_topology, trajectories_subject
from policyloop.bus.connection import retry_transient
from policyloop.cluster.local import ClusterInfo, LocalCluster
from policyloop.cluster.nats_cluster import meta_leader, node_stream_state, stream_leader
from policyloop.contracts.v1 import bus_pb2
from tests.conftest import NatsCluster, fast_limits
from tests.helpers import eventually, until

SUBJECT = trajectories_subject("e@v1")  # "@" leaves subjects (see subject_token)


def trajectory(i: int) -> bus_pb2.TrajectoryGroup:
    return bus_pb2.TrajectoryGroup(group_id=f"task-{i}", trajectories=[bus_pb2.Trajectory(
        trajectory_id=f"traj-{i}", task_id=f"task-{i}", group_id=f"task-{i}", run_id="r", environment="e")])


async def publish(bus: Bus, ids: range) -> None:
    for i in ids:
        await bus.publish(SUBJECT, trajectory(i), f"traj-{i}")


async def test_replicated_bus_survives_losing_the_stream_leader(nats_cluster: NatsCluster) -> None:
    topology = build_topology(fast_limits(stream_replicas=3))
    bus = await Bus.connect(nats_cluster.url, name="t", topology=topology, connect_timeout_s=10)
    handled: list[str] = []

    async def handle(delivery: Delivery[bus_pb2.TrajectoryGroup]) -> None:
        handled.append(delivery.msg_id)

    worker = PullWorker(bus, topology.consumers["learner"], bus_pb2.TrajectoryGroup, handle, service="t",
                        fetch_timeout_s=0.3)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await bus.ensure_topology()

        async def led_with_two_followers() -> bool:
            # Just created, a stream may still be electing its leader (all three then listed).
            for name in topology.streams:
                info = await retry_transient(lambda n=name: bus.js.stream_info(n), 30, "stream info")
                assert info.config.num_replicas == 3, name
                if info.cluster is None or not info.cluster.leader or len(info.cluster.replicas or []) != 2:
                    return False
            return True

        await eventually(led_with_two_followers, what="every stream led, with two followers")
        for spec in topology.consumers.values():
            assert (await bus.js.consumer_info(spec.stream, spec.durable)).config.num_replicas == 3

        async def acked(count: int) -> bool:
            info = await retry_transient(lambda: bus.js.consumer_info("TRAJECTORIES", "learner"), 30, "info")
            return info.ack_floor.stream_seq == count and not info.num_ack_pending

        await publish(bus, range(10))
        # Every ack reached the consumer's leader: nothing of the first half may come again.
        await eventually(lambda: acked(10), what="first half acked")

        leader = await stream_leader(bus.js, "TRAJECTORIES")
        assert leader in nats_cluster.nodes
        nats_cluster.kill(leader)
        # Publishing goes on through the election (retried, deduplicated by Nats-Msg-Id).
        await publish(bus, range(10, 20))
        await eventually(lambda: acked(20), timeout_s=60, what="second half acked")
        assert sorted(handled) == sorted(f"traj-{i}" for i in range(20))  # none lost, none twice
        assert (await bus.js.stream_info("TRAJECTORIES")).state.messages == 20

        async def led_by_a_survivor() -> bool:
            return await retry_transient(lambda: stream_leader(bus.js, "TRAJECTORIES"), 30, "leader") not in (
                None, leader)

        await eventually(led_by_a_survivor, what="TRAJECTORIES led by a survivor")

        # A client given the dead node first connects to a survivor.
        survivors = [n for n in nats_cluster.nodes if n != leader]
        ordered = [nats_cluster.nodes[n] for n in (leader, *survivors)]
        other = await Bus.connect(",".join(f"nats://127.0.0.1:{m.ports['client']}" for m in ordered),
                                  name="t2", topology=topology, connect_timeout_s=10)
        try:
            assert (await other.js.stream_info("TRAJECTORIES")).state.messages == 20
        finally:
            await other.close()

        # The restarted node catches up with what was written while it was down.
        nats_cluster.restart(leader)
        monitor = f"http://127.0.0.1:{nats_cluster.nodes[leader].ports['monitor']}"

        async def caught_up() -> bool:
            try:
                state = await asyncio.to_thread(node_stream_state, monitor, "TRAJECTORIES")
            except OSError:  # its monitoring port not open yet
                return False
            return state is not None and state.get("messages") == 20 and state.get("last_seq") == 20

        await eventually(caught_up, timeout_s=60, what=f"{leader} caught up")
        assert meta_leader(nats_cluster.monitor_urls) in nats_cluster.nodes
        assert len(handled) == 20
    finally:
        stop.set()
        await running
        await worker.drain(1)
        await bus.close()


async def test_local_cluster_with_three_nats_nodes(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "run", services=(), nats_nodes=3)
    info = cluster.start()
    try:
        assert info.nats_nodes == 3 and len(info.nats_url.split(",")) == 3
        assert {"nats-0", "nats-1", "nats-2", "redis-server"} <= set(info.processes)
        assert ClusterInfo.load(tmp_path / "run").nats_nodes == 3
        assert all((tmp_path / "run" / "nats" / f"nats-{i}").is_dir() for i in range(3))
        assert meta_leader(cluster.nats_monitor_urls) in {"nats-0", "nats-1", "nats-2"}
        # A node that dies is restarted on the same ports by the supervisor.
        node = cluster.process("nats-1")
        ports = dict(node.ports)
        node.signal(9)
        await until(lambda: not node.alive, what="nats-1 dead")
        assert cluster.supervise() == ["nats-1"]
        assert node.alive and node.ports == ports
    finally:
        cluster.stop()
