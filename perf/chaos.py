"""Chaos: the local cluster trains on the arithmetic environment while processes are killed.

A fresh local cluster (nats-server, redis-server and every service as processes) runs the
arithmetic environment. At random moments a random process is killed with SIGKILL — each kind
at least once when --kills allows it, nats-server and redis-server included — and restarted by
the cluster's supervisor, `--kills` times. When the learner has gone `--steps-after-kills` steps
beyond the version of the last kill (and at least `--steps`), the run is stopped, the loop left
to settle (ROLLOUTS empty, LEDGER unchanged for --settle-s) and the ledger audited
(policyloop.ledger.audit_bus). Prints JSON:

- `kills` (in order, with the learner version at the time), `generated`, `scored`, `trained`,
  `dropped` (by reason), `dead_lettered`, `pending` (still waiting on the bus for a consumer),
  `lost` (generated and accounted nowhere), `trained_twice`;
- `trained_not_generated` (trained ids the ledger never saw generated: a gap in the ledger);
- `versions_monotonic` (the recorded steps make versions 1, 2, … once each), `registry_version`
  and `publisher_newest_version` (`versions_agree`: Redis and the publisher agree with the ledger);
- `reached_target_steps` (the learner reached --steps), `wall_seconds`;
- `time_to_next_step` (`median_s`, `max_s`, `per_kill_s`, `missed`, `killed_again_before_step`): for
  each learner kill, seconds from its restart to the first step it recorded in LEDGER (a version
  newer than the newest before the kill; the replay of steps recorded before the kill does not
  count), none for a learner killed again before it stepped (a learner kill follows the previous
  kill by --min-gap-s to --max-gap-s: widen them to measure every kill); each learner kill also
  carries `restart_phases_s`, read from the learner's log: seconds from the restart to
  `service_started` (interpreter, imports, connections), `trainer_loaded` (torch, the model),
  `resumed` (checkpoint, replay) and the first `step`.

With `--nats-nodes 3` NATS is a 3-node JetStream cluster (every stream and consumer on all three)
and the NATS kills pick a node right before killing it: the current JetStream meta leader, or
the current leader of TRAJECTORIES (both kinds are in every schedule), once the learner is
stepping (`waited_for_training_s`: a process killed just before may still be coming back). A
killed node stays down `--node-down-s` while everything else goes on (and is restarted if it
dies), then comes back and the cluster is waited on until every node is current again. Each
node kill records the learner steps the ledger gained while the node was down
(`steps_while_node_down`); `ok` then also requires at least one step during every node's
absence and the cluster whole again after each restart (`cluster_whole_after_restart_s`).
Prints `nats_nodes`, `steps_while_node_down` (per node kill) and `steps_while_node_down_total`,
`meta_leader_kills` and `trajectories_leader_kills` (kills of the node leading it then).

    .venv/bin/python perf/chaos.py --kills 10
    .venv/bin/python perf/chaos.py --kills 3 --steps 20     # a quicker look
    .venv/bin/python perf/chaos.py --nats-nodes 3 --kills 8
    .venv/bin/python perf/chaos.py --kills 10 --kinds learner-0  # learner kills only: time_to_next_step
    .venv/bin/python perf/chaos.py --runs 2 --kills 10        # two LoRA runs, each audited (`runs`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import nats.js.errors  # noqa: E402

from policyloop.bus import Bus, ledger_subject  # noqa: E402
from policyloop.cluster.catalogue import SERVICES  # noqa: E402
from policyloop.cluster.local import LocalCluster  # noqa: E402
from policyloop.cluster.nats_cluster import meta_leader, stream_leader, wait_cluster_ready  # noqa: E402
from policyloop.contracts.v1 import bus_pb2, loop_pb2, loop_pb2_grpc  # noqa: E402
from policyloop.demo.loop import arithmetic_environment, require_healthy, start_arithmetic_run  # noqa: E402
from policyloop.demo.runs import start_lora_runs  # noqa: E402
from policyloop.ledger import TRAINED, Audit, audit_bus, trained_steps, wait_settled  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.rl.lora import adapter_model_name  # noqa: E402
from policyloop.state import VersionRegistry, connect_redis  # noqa: E402
from policyloop.weights.client import WeightClient  # noqa: E402

KINDS = ("nats-server", "redis-server", *(f"{s.name}-0" for s in SERVICES))
# In a NATS cluster a node is named when it is killed: the one leading then.
META_LEADER, TRAJECTORIES_LEADER = "nats:meta-leader", "nats:trajectories-leader"
CLUSTER_KINDS = (META_LEADER, TRAJECTORIES_LEADER, "redis-server", *(f"{s.name}-0" for s in SERVICES))


def kill_schedule(kills: int, rng: random.Random, kinds: tuple[str, ...] = KINDS,
                  required: tuple[str, ...] = ()) -> list[str]:
    """`kills` process names: every kind once (shuffled) while the budget lasts, then at random;
    the `required` kinds among the first whatever the budget."""
    first = list(kinds)
    rng.shuffle(first)
    if required:
        first = [k for k in first if k in required] + [k for k in first if k not in required]
        head = first[:kills]
        rng.shuffle(head)
        first = head + first[kills:]
    return first[:kills] + [rng.choice(kinds) for _ in range(kills - len(first))]


async def nats_leaders(cluster: LocalCluster, timeout_s: float = 60.0) -> dict[str, str]:
    """The node names leading now: the JetStream meta leader (from /jsz) and the leader of
    TRAJECTORIES (from its stream info). Asked again while an election is under way."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            meta = await asyncio.to_thread(meta_leader, cluster.nats_monitor_urls)
            bus = await Bus.connect(cluster.nats_url, name="chaos-leaders", connect_timeout_s=10)
            try:
                trajectories = await stream_leader(bus.js, "TRAJECTORIES")
            finally:
                await bus.close()
            if meta and trajectories:
                return {"meta_leader": meta, "trajectories_leader": trajectories}
        except Exception:  # noqa: BLE001 - an election or a restart under way: ask again
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("no JetStream meta leader or TRAJECTORIES leader")
        await asyncio.sleep(0.5)


async def kill_node(cluster: LocalCluster, kind: str, version: int, args: argparse.Namespace,
                    started: float) -> dict:
    """Once the learner is stepping (a process killed just before may still be coming back),
    kills the node leading what `kind` names, keeps it down --node-down-s while the rest is
    supervised as usual, restarts it and waits until the cluster is whole again."""
    waited_from = time.monotonic()

    async def stepped() -> bool:
        cluster.supervise()
        return await learner_version(cluster) > version

    await until(stepped, args.catch_up_timeout_s, poll_s=0.5)
    waited_for_training_s = round(time.monotonic() - waited_from, 1)
    version = await learner_version(cluster)
    leaders = await nats_leaders(cluster)
    name = leaders["meta_leader"] if kind == META_LEADER else leaders["trajectories_leader"]
    node = cluster.process(name)
    killed_at = time.monotonic()
    node.signal(signal.SIGKILL)
    await asyncio.to_thread(node.proc.wait)  # type: ignore[union-attr]
    restarted_while_down: list[str] = []
    while time.monotonic() - killed_at < args.node_down_s:
        restarted_while_down += cluster.supervise(keep_down={name})
        await asyncio.sleep(1.0)
    version_at_restart = await learner_version(cluster)
    down_s = time.monotonic() - killed_at
    restarted = cluster.supervise()
    try:
        await asyncio.to_thread(wait_cluster_ready, cluster.nats_monitor_urls, args.catch_up_timeout_s)
        whole_after_s: float | None = round(time.monotonic() - killed_at - down_s, 1)
    except TimeoutError:
        whole_after_s = None
    return {"process": name, "picked": kind, **leaders, "waited_for_training_s": waited_for_training_s,
            "at_version": version,
            "version_at_restart": version_at_restart, "steps_while_node_down": version_at_restart - version,
            "down_s": round(down_s, 1), "cluster_whole_after_restart_s": whole_after_s,
            "restarted_while_down": restarted_while_down, "restarted": restarted,
            "at_s": round(killed_at - started, 1)}


async def kill_process(cluster: LocalCluster, name: str, version: int, down_s: float, started: float,
                       models: tuple[str, ...]) -> dict:
    """SIGKILLs `name`, leaves it dead `down_s`, and has the supervisor restart it. A learner's
    record also takes the newest version each model's ledger holds once it is dead (its next
    step is measured from there) and the moment of its restart."""
    process = cluster.process(name)
    process.signal(signal.SIGKILL)
    await asyncio.to_thread(process.proc.wait)  # type: ignore[union-attr]
    killed_at = time.monotonic()
    kill: dict = {"process": name, "at_version": version}
    if name.startswith("learner"):
        bus = await Bus.connect(cluster.nats_url, name="chaos-newest", connect_timeout_s=30)
        try:
            kill["newest_before_restart"] = await newest_versions(bus, models)
        finally:
            await bus.close()
    await asyncio.sleep(max(0.0, down_s - (time.monotonic() - killed_at)))  # stays dead a little while
    kill["restarted"] = cluster.supervise()
    kill["restarted_unix"] = time.time()
    kill["at_s"] = round(time.monotonic() - started, 1)
    return kill


async def newest_versions(bus: Bus, models: tuple[str, ...]) -> dict[str, int]:
    """Each model's newest version in LEDGER: its last step record, one request each."""
    newest = {}
    for model in models:
        try:
            msg = await bus.js.get_last_msg("LEDGER", ledger_subject(TRAINED, model))
            newest[model] = bus_pb2.LedgerEvent.FromString(msg.data or b"").policy_version
        except nats.js.errors.NotFoundError:
            newest[model] = 0
    return newest


async def time_to_next_step(cluster: LocalCluster, models: tuple[str, ...], kill: dict, timeout_s: float) -> None:
    """Fills in `kill["time_to_next_step_s"]`: seconds from the learner's restart until a model's
    ledger holds a version newer than it held while the learner was dead (None: not within
    `timeout_s`), and `restart_phases_s` from the learner's log."""
    before = kill["newest_before_restart"]
    # One connection for the polls (it reconnects by itself while a nats-server restarts).
    bus = await Bus.connect(cluster.nats_url, name="chaos-next-step", connect_timeout_s=30)

    async def stepped() -> bool:
        newest = await newest_versions(bus, models)
        return any(newest[m] > before[m] for m in models)

    kill["time_to_next_step_s"] = None
    try:
        if await until(stepped, timeout_s, poll_s=0.2):
            kill["time_to_next_step_s"] = round(time.time() - kill["restarted_unix"], 2)
    except asyncio.CancelledError:
        kill["killed_again_before_step"] = True
    finally:
        await bus.close()
        kill["restart_phases_s"] = restart_phases(cluster.process(kill["process"]).log_path, kill["restarted_unix"])


async def interrupt(timings: list[asyncio.Task[None]]) -> None:
    """Before the learner is killed again: the previous kill's wait for its next step ends without
    a figure (`killed_again_before_step`)."""
    for task in timings:
        task.cancel()
    await asyncio.gather(*timings, return_exceptions=True)


def restart_phases(log_path: Path, restarted_unix: float) -> dict[str, float]:
    """Seconds from a restart to the first `service_started`, `trainer_loaded`, `learner_resumed`
    and `step` the process logged after it (JSON lines with ISO timestamps)."""
    from datetime import datetime

    phases: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
            at = datetime.fromisoformat(event["timestamp"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue  # not a line of ours (a library's, a traceback)
        name = {"service_started": "service_started", "trainer_loaded": "trainer_loaded",
                "learner_resumed": "resumed", "step": "first_step"}.get(event.get("event"))
        if name and at >= restarted_unix and name not in phases:
            phases[name] = round(at - restarted_unix, 2)
    return phases


def next_step_figures(kills: list[dict]) -> dict:
    """The median and the most of the learner kills' times to their next step."""
    learner = [k for k in kills if "time_to_next_step_s" in k]
    done = sorted(k["time_to_next_step_s"] for k in learner if k["time_to_next_step_s"] is not None)
    again = sum(1 for k in learner if k.get("killed_again_before_step"))
    return {"learner_kills": len(learner), "per_kill_s": [k["time_to_next_step_s"] for k in learner],
            "killed_again_before_step": again, "missed": len(learner) - len(done) - again,
            "median_s": statistics.median(done) if done else None, "max_s": done[-1] if done else None}


async def learner_version(cluster: LocalCluster, models: tuple[str, ...] = ("policy",), attempts: int = 30) -> int:
    """The newest step the ledger holds (what survives any one process's death); with several
    models (LoRA runs), the least of theirs. Asked again while a restarted nats-server's
    JetStream is not answering yet."""
    for attempt in range(attempts):
        try:
            bus = await Bus.connect(cluster.nats_url, name="chaos", connect_timeout_s=30)
            try:
                newest = []
                for model in models:
                    steps = await trained_steps(bus, model)
                    newest.append(steps[-1].version if steps else 0)
                return min(newest)
            finally:
                await bus.close()
        except Exception:  # noqa: BLE001 - a server being restarted
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


async def until(check, timeout_s: float, poll_s: float = 1.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await check():
                return True
        except Exception:  # noqa: BLE001 - a server being restarted: ask again
            pass
        await asyncio.sleep(poll_s)
    return False


async def audit_after(cluster: LocalCluster, runs: list[loop_pb2.Run], models: tuple[str, ...],
                      args: argparse.Namespace) -> tuple[bool, Audit, dict[str, dict]]:
    """Once the loop settled: the ledger's audit (of each run, with several), and whether each
    model's version registry and publisher agree with its ledger."""
    bus = await Bus.connect(cluster.nats_url, name="chaos-audit", connect_timeout_s=30)
    redis_client = await connect_redis(cluster.redis_url)
    publisher = WeightClient(f"127.0.0.1:{cluster.process('publisher-0').ports['grpc']}")
    try:
        settled = await wait_settled(bus, args.settle_s, timeout_s=120)
        report = await audit_bus(bus)
        per_model = {}
        for run, model in zip(runs, models, strict=True):
            audited = await audit_bus(bus, run.run_id) if args.runs > 1 else report
            registry = await VersionRegistry(redis_client, cluster.namespace).get(model)
            # A publisher killed last may still be rebuilding its store: the loop reached its target
            # on versions recorded before their push.
            held = sorted(v.version for v in await publisher.list_versions(model, wait_for_ready=True))
            per_model[model] = {
                "run_id": run.run_id, "lost": audited.lost, "trained_twice": audited.trained_twice,
                "versions_monotonic": audited.versions_monotonic, "steps": audited.steps,
                "trained_not_generated": audited.trained_not_generated, "registry_version": registry,
                "publisher_newest_version": held[-1] if held else 0,
                # The learner may be one step ahead of what was read a moment earlier.
                "versions_agree": abs(registry - audited.steps) <= 1 and bool(held)
                and abs(held[-1] - audited.steps) <= 1}
    finally:
        await publisher.close()
        await bus.close()
        await redis_client.aclose()
    return settled, report, per_model


async def drive(cluster: LocalCluster, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    started = time.monotonic()
    await require_healthy(cluster, 180)
    gateway = f"127.0.0.1:{cluster.process('gateway-0').ports['grpc']}"
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = loop_pb2_grpc.LoopServiceStub(channel)
        if args.runs > 1:  # LoRA runs, each its own version sequence under its adapter's name
            env = arithmetic_environment(args.group_size, 8, 1.0)
            reply = await stub.SubmitEnvironment(loop_pb2.SubmitEnvironmentRequest(environment=env), timeout=30)
            runs = await start_lora_runs(stub, reply.environment, args.runs, args.lora_rank, args.seed)
        else:
            _, run = await start_arithmetic_run(stub, args.group_size, 8, 1.0, args.seed)
            runs = [run]
    models = tuple(adapter_model_name("policy", r.run_id) for r in runs) if args.runs > 1 else ("policy",)
    kills: list[dict] = []
    timings: list[asyncio.Task[None]] = []  # each learner kill's time to its next step, filled in
    clustered = args.nats_nodes > 1
    kinds = tuple(args.kinds.split(",")) if args.kinds else (CLUSTER_KINDS if clustered else KINDS)
    schedule = (kill_schedule(args.kills, rng, kinds, (META_LEADER, TRAJECTORIES_LEADER)) if clustered
                else kill_schedule(args.kills, rng, kinds))
    for name in schedule:
        await asyncio.sleep(rng.uniform(args.min_gap_s, args.max_gap_s))
        version = await learner_version(cluster, models)
        if name.startswith("nats:"):
            kills.append(await kill_node(cluster, name, version, args, started))
            print(json.dumps(kills[-1]), file=sys.stderr)
            continue
        if name.startswith("learner"):
            await interrupt(timings)
        kills.append(await kill_process(cluster, name, version, rng.uniform(0.0, args.down_s), started, models))
        if name.startswith("learner"):
            timings.append(asyncio.create_task(time_to_next_step(cluster, models, kills[-1], args.timeout_s)))
        print(json.dumps(kills[-1]), file=sys.stderr)
    # The loop must go on after the last kill, not only have got far before it.
    target = max(args.steps, (kills[-1]["at_version"] if kills else 0) + args.steps_after_kills)
    reached = await until(lambda: _reached(cluster, target, models), args.timeout_s, poll_s=2.0)
    await asyncio.gather(*timings)
    async with grpc.aio.insecure_channel(gateway) as channel:
        for run in runs:
            await loop_pb2_grpc.LoopServiceStub(channel).StopRun(loop_pb2.StopRunRequest(run_id=run.run_id),
                                                                 timeout=30)
    settled, report, per_model = await audit_after(cluster, runs, models, args)
    first = per_model[models[0]]
    node_kills = [k for k in kills if "picked" in k]
    return {
        "kills": len(kills), "kill_log": kills, "nats_nodes": args.nats_nodes,
        "steps_while_node_down": [k["steps_while_node_down"] for k in node_kills],
        "steps_while_node_down_total": sum(k["steps_while_node_down"] for k in node_kills),
        "meta_leader_kills": sum(k["process"] == k["meta_leader"] for k in node_kills),
        "trajectories_leader_kills": sum(k["process"] == k["trajectories_leader"] for k in node_kills),
        **{k: v for k, v in report.as_dict().items() if k not in ("steps",)},
        "steps": report.steps, "registry_version": first["registry_version"],
        "publisher_newest_version": first["publisher_newest_version"],
        "versions_agree": all(m["versions_agree"] for m in per_model.values()),
        "runs": list(per_model.values()) if args.runs > 1 else [],
        "time_to_next_step": next_step_figures(kills),
        "reached_target_steps": reached, "target_steps": target, "settled_before_audit": settled,
        "wall_seconds": round(time.monotonic() - started, 1),
    }


async def _reached(cluster: LocalCluster, steps: int, models: tuple[str, ...]) -> bool:
    cluster.supervise()  # anything that died by itself comes back too
    return await learner_version(cluster, models) >= steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="learner steps the run must reach")
    parser.add_argument("--steps-after-kills", type=int, default=10,
                        help="steps the learner must take after the version it was at when last killed")
    parser.add_argument("--min-gap-s", type=float, default=4.0, help="least time between kills")
    parser.add_argument("--max-gap-s", type=float, default=15.0, help="most time between kills")
    parser.add_argument("--down-s", type=float, default=3.0, help="most time a killed process stays down")
    parser.add_argument("--kinds", default="",
                        help="comma-separated process names to kill (e.g. learner-0 for learner kills only); "
                             "default: every kind")
    parser.add_argument("--nats-nodes", type=int, default=1, choices=(1, 3, 5),
                        help="NATS servers: 1, or a JetStream cluster whose nodes are killed too")
    parser.add_argument("--node-down-s", type=float, default=20.0,
                        help="how long a killed NATS node stays down (a cluster): the learner must step meanwhile")
    parser.add_argument("--catch-up-timeout-s", type=float, default=120.0,
                        help="after a node's restart, most time to wait for the cluster to be whole again")
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--ack-wait-s", type=float, default=10.0,
                        help="ack wait of every consumer: how soon a killed holder's messages come back")
    parser.add_argument("--timeout-s", type=float, default=900, help="after the kills, to reach --steps")
    parser.add_argument("--settle-s", type=float, default=5,
                        help="after stopping the run, how long LEDGER must stay unchanged before the audit")
    parser.add_argument("--model-path", type=model_argument, default=None, help="default: the bootstrap model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1,
                        help="runs trained at once: more than one are LoRA runs (learner and rollout in the "
                             "many-runs mode), each audited on its own")
    parser.add_argument("--lora-rank", type=int, default=16, help="with --runs > 1: each run's adapter rank")
    parser.add_argument("--out", type=Path, default=Path("runs/perf/chaos"))
    args = parser.parse_args()
    model_path = args.model_path
    if model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        model_path = bootstrap(BootstrapConfig())
    # The cluster's directory (streams, logs) stays under --out for a look afterwards.
    root = args.out / "cluster"
    env = {
        "POLICYLOOP_MODEL_PATH": str(model_path),
        "POLICYLOOP_GROUPS_PER_STEP": str(args.groups_per_step),
        "POLICYLOOP_MAX_LAG": str(args.max_lag),
        "POLICYLOOP_CHECKPOINT__EVERY": str(args.checkpoint_every),
        "POLICYLOOP_WEIGHTS_DIR": str(root / "rollout-weights"),
        **{f"POLICYLOOP_BUS__{kind.upper()}_ACK_WAIT_S": str(args.ack_wait_s)
           for kind in ("rollout", "reward", "learner", "sandbox")},
        **({"POLICYLOOP_LORA_RUNS": "true", "POLICYLOOP_FULL_MODEL": "false"} if args.runs > 1 else {}),
    }
    cluster = LocalCluster(root, extra_env=env, fresh=True, nats_nodes=args.nats_nodes)
    # SIGTERM stops the cluster too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cluster.start()
    try:
        result = asyncio.run(drive(cluster, args))
    finally:
        cluster.stop()
    result["ok"] = (result["lost"] == 0 and result["trained_twice"] == 0 and result["versions_monotonic"]
                    and all(r["lost"] == 0 and r["trained_twice"] == 0 and r["versions_monotonic"]
                            for r in result["runs"])
                    and result["reached_target_steps"] and result["versions_agree"]
                    and result["trained_not_generated"] == 0
                    # In a cluster the loop trained while each killed node was down, and the
                    # node caught up after its restart.
                    and all(steps > 0 for steps in result["steps_while_node_down"])
                    and all(k.get("cluster_whole_after_restart_s", 0) is not None for k in result["kill_log"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
