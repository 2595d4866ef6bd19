"""Weight fan-out to N replicas, direct or relayed through the tree, with real parts on loopback.

A publisher process (the real WeightServicer, WeightLibrary and store, with the fan-out tree in
relayed mode) and `--workers` processes of simulated replicas: each replica is a real gRPC client
and a real gRPC relay server of its own (RelayServicer) that fetches each version — from the
publisher (direct) or from its parent (relayed: weights.tree, with fallbacks) —, verifies it (the
payload's size and xxh3-128 against its header, the header against what the publisher stored) and
holds it for its children. A simulated replica keeps no weights: relays of one process share one
copy of each verified payload and leaves drop it, so memory stays bounded. Every replica's egress
is a link of `--link-mbps` (an in-process token bucket, shared by whatever it sends), the
publisher's too.

Versions are deltas made by the real codec from synthetic bf16 weights with `--change` of their
bytes changed (sized so the delta is about `--delta-mb`). The replicas start holding version 1;
each later version is announced to all at once (one monotonic clock: the same host).

Per (N, mode) it prints: p50/p99 time from announcement to verified version, the publisher's
egress per version, bytes served per replica (mean, max), CPU seconds per replica per version, the
tree's depth, fallbacks; and the bandwidth bound beside the times: the earliest the last replica
can hold the version in the tree as placed, each sender's link carrying one copy per child (the
delta ÷ link each) and a replica sending only what it received whole and verified (store and
forward). Direct, that is N × delta ÷ link (the publisher's link carries every copy); for a full
relayed tree, depth × fan-out × delta ÷ link.

    .venv/bin/python perf/fanout.py --replicas 10 100 1000 --delta-mb 1 --link-mbps 25 --fanout 4 \\
        [--modes direct relayed] [--versions 3] [--workers 2] [--plot docs/img/fanout.png]

On one host the replicas share its cores: keep the links slow enough that the bytes, not the
CPU, set the pace (`cpu_s_per_replica_per_version` × N ÷ cores well under the bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "policy"


# --------------------------------------------------------------------------- the weights


def synthetic_versions(delta_mb: float, change: float, versions: int) -> list:  # list[WeightSet]
    """Version 1 and `versions` successors, each with `change` of its bytes moved, sized so a
    delta is about `delta_mb` (calibrated on a small sample)."""
    import numpy as np

    from policyloop.weights import codec
    from policyloop.weights.codec import TensorBytes, WeightSet

    def build(raw_bytes: int, version: int) -> WeightSet:
        rng = np.random.default_rng(0)
        per = 4 << 20  # 4 MiB tensors, bf16
        tensors, left, i = {}, raw_bytes, 0
        while left > 0:
            size = min(per, left) // 2 * 2
            tensors[f"layer.{i}.weight"] = TensorBytes("BF16", (size // 2,), rng.integers(0, 256, size, dtype=np.uint8))
            left -= per
            i += 1
        return WeightSet.build(version, tensors)

    def moved(weights: WeightSet, version: int, seed: int) -> WeightSet:
        rng = np.random.default_rng(seed)
        changed = weights.copy()
        for tensor in changed.tensors.values():
            hits = rng.random(tensor.data.size) < change
            tensor.data[hits] ^= rng.integers(1, 256, int(hits.sum()), dtype=np.uint8)
        return WeightSet.build(version, changed.tensors)

    sample = build(8 << 20, 1)
    ratio = len(codec.encode(moved(sample, 2, 1), sample).payload) / (8 << 20)
    first = build(int(delta_mb * 1e6 / ratio), 1)
    out = [first]
    for n in range(2, versions + 2):
        out.append(moved(out[-1], n, n))
    return out


# --------------------------------------------------------------------------- the publisher


def publisher_process(conn, store: str, fanout: int, relayed: bool, link_mbps: float) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(_publisher(conn, store, fanout, relayed, link_mbps))


async def _publisher(conn, store: str, fanout: int, relayed: bool, link_mbps: float) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import REGISTRY

    from policyloop.weights.fanout import FanoutTree
    from policyloop.weights.library import WeightLibrary
    from policyloop.weights.link import LinkLimit
    from policyloop.weights.server import WeightServicer, start_weight_server
    from policyloop.weights.store import VersionStore

    async def stored(_version: object) -> None:
        return None

    library = WeightLibrary(VersionStore(Path(store), retention=16), snapshot_every=64)
    servicer = WeightServicer(library, on_stored=stored, egress=LinkLimit(link_mbps / 1000),
                              tree=(lambda: FanoutTree(fanout, lease_s=3600)) if relayed else None)
    server, port = await start_weight_server(servicer, host="127.0.0.1", port=0)
    conn.send(port)
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "stop":
            break
        tree = servicer.trees.get(MODEL)
        conn.send({"bytes_served": REGISTRY.get_sample_value("policyloop_weights_bytes_served_total",
                                                             {"server": "publisher"}) or 0.0,
                   "depth": tree.depth if tree else 1, "members": len(tree.members) if tree else 0,
                   "cpu_s": _cpu_s()})
    await server.stop(None)
    await library.drain()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- simulated replicas


@dataclass
class Expected:
    version: int
    payload_xxh3_128: str
    manifest_hash: str
    announced: float  # time.monotonic() of the announcement (one clock across the host's processes)


def worker_process(conn, ids: list[str], publisher: str, relayed: bool, link_mbps: float,  # type: ignore[no-untyped-def]
                   parent_deadline_s: float) -> None:
    asyncio.run(_worker(conn, ids, publisher, relayed, link_mbps, parent_deadline_s))


async def _worker(conn, ids: list[str], publisher: str, relayed: bool, link_mbps: float,  # type: ignore[no-untyped-def]
                  parent_deadline_s: float) -> None:
    from policyloop.weights.client import FetchedVersion, FetchError, WeightClient
    from policyloop.weights.link import LinkLimit
    from policyloop.weights.relay import RelayHoldings, RelayServicer, start_relay_server
    from policyloop.weights.tree import TreeSync

    shared: dict[str, bytes] = {}  # payload digest -> one verified copy for every relay of this process

    class Replica:
        def __init__(self, replica: str) -> None:
            self.replica = replica
            self.holdings = RelayHoldings()
            self.held = 1

        async def start(self) -> None:
            servicer = RelayServicer(self.holdings, wait_s=parent_deadline_s, egress=LinkLimit(link_mbps / 1000))
            self.server, port = await start_relay_server(servicer, host="127.0.0.1", port=0)
            self.publisher = WeightClient(publisher, deadline_s=600)
            self.tree = TreeSync(self.publisher, model=MODEL, replica=self.replica,
                                 relay_endpoint=f"127.0.0.1:{port}", parent_deadline_s=parent_deadline_s)
            if relayed:
                await self.tree.placement()

        async def sync(self, expected: Expected) -> dict:
            async def attempt(client: WeightClient) -> FetchedVersion:
                fetched = await client.fetch(MODEL, have_version=self.held, want_version=expected.version)
                header = fetched.header  # its payload was checked against it by fetch()
                if (header.version, header.payload_xxh3_128, header.manifest_hash) != (
                        expected.version, expected.payload_xxh3_128, expected.manifest_hash):
                    raise FetchError(f"got version {header.version} ({header.payload_xxh3_128}), the publisher "
                                     f"stored {expected.version} ({expected.payload_xxh3_128})")
                return fetched

            if relayed:
                fetched, source = await self.tree.fetch(attempt)
            else:
                fetched, source = await attempt(self.publisher), ""
            done = time.monotonic()
            payload = shared.setdefault(fetched.header.payload_xxh3_128, fetched.payload)
            if relayed and self.tree.request.relay_endpoint:
                await self.holdings.hold(FetchedVersion(fetched.header, payload), None)
            self.held = expected.version
            parent = self.tree.current.parent if relayed and self.tree.current else ""
            return {"replica": self.replica, "seconds": done - expected.announced, "source": source, "parent": parent}

    replicas = [Replica(r) for r in ids]
    for replica in replicas:
        await replica.start()
    conn.send("ready")
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "stop":
            break
        cpu = _cpu_s()
        results = await asyncio.gather(*(r.sync(command) for r in replicas))
        shared.clear()  # the relays still hold this process's one copy until the next version
        conn.send({"results": results, "cpu_s": _cpu_s() - cpu,
                   "served": [r.holdings.bytes_served for r in replicas],
                   "fallbacks": sum(r.tree.fallbacks for r in replicas)})
    for replica in replicas:
        await replica.server.stop(None)
        await replica.tree.close()
        await replica.publisher.close()


# --------------------------------------------------------------------------- one configuration


async def run_one(n: int, relayed: bool, versions: list, args: argparse.Namespace) -> dict:
    from policyloop.weights.client import WeightClient
    from policyloop.weights.push import VersionPusher

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="policyloop-fanout-") as store:
        pub_conn, pub_child = ctx.Pipe()
        pub = ctx.Process(target=publisher_process, args=(pub_child, store, args.fanout, relayed, args.link_mbps),
                          daemon=True)
        pub.start()
        endpoint = f"127.0.0.1:{pub_conn.recv()}"
        client = WeightClient(endpoint, deadline_s=600)
        pusher = VersionPusher(client, MODEL)
        await pusher.push(versions[0], step=1)
        ids = [f"r{i}" for i in range(n)]
        workers = []
        for w in range(args.workers):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=worker_process, args=(child, ids[w::args.workers], endpoint, relayed,
                                                            args.link_mbps, args.parent_deadline_s), daemon=True)
            proc.start()
            workers.append((conn, proc))
            conn.recv()  # joined in order, worker after worker
        loop = asyncio.get_running_loop()
        per_version: list[dict] = []
        try:
            for weights in versions[1:]:
                await pusher.push(weights, step=weights.version)
                stored = [v for v in await client.list_versions(MODEL) if v.version == weights.version][0]
                pub_conn.send("figures")
                before = await loop.run_in_executor(None, pub_conn.recv)
                expected = Expected(weights.version, stored.payload_xxh3_128, stored.manifest_hash, time.monotonic())
                for conn, _ in workers:
                    conn.send(expected)
                replies = [await loop.run_in_executor(None, conn.recv) for conn, _ in workers]
                pub_conn.send("figures")
                after = await loop.run_in_executor(None, pub_conn.recv)
                results = [r for reply in replies for r in reply["results"]]
                times = [r["seconds"] for r in results]
                served = [s for reply in replies for s in reply["served"]]
                egress = after["bytes_served"] - before["bytes_served"]
                per_version.append({"delta_bytes": stored.bytes, "egress": egress,
                                    "cpu_s": sum(reply["cpu_s"] for reply in replies), "depth": after["depth"],
                                    "fallbacks": sum(reply["fallbacks"] for reply in replies),
                                    "served": served, "p50": statistics.median(times),
                                    "p99": statistics.quantiles(times, n=100, method="inclusive")[98],
                                    "max": max(times),
                                    "bound": bandwidth_bound({r["replica"]: r["parent"] for r in results},
                                                             stored.bytes, args.link_mbps * 1e6 / 8)})
        finally:
            for conn, proc in workers:
                conn.send("stop")
                proc.join(60)
            pub_conn.send("stop")
            pub.join(60)
            await client.close()
    delta = statistics.median(v["delta_bytes"] for v in per_version)
    depth = max(v["depth"] for v in per_version)
    bound = statistics.median(v["bound"] for v in per_version)
    cumulative = per_version[-1]["served"]
    return {
        "replicas": n, "mode": "relayed" if relayed else "direct", "fanout": args.fanout if relayed else None,
        "depth": depth, "delta_bytes": int(delta), "link_mbps": args.link_mbps, "versions": len(per_version),
        "p50_s": round(statistics.median(v["p50"] for v in per_version), 3),
        "p99_s": round(statistics.median(v["p99"] for v in per_version), 3),
        "max_s": round(statistics.median(v["max"] for v in per_version), 3),
        "bound_s": round(bound, 3),
        "p99_over_bound": round(statistics.median(v["p99"] for v in per_version) / bound, 2),
        "publisher_egress_bytes_per_version": int(statistics.median(v["egress"] for v in per_version)),
        "bytes_served_per_replica": {"mean": int(statistics.mean(cumulative) / len(per_version)),
                                     "max": int(max(cumulative) / len(per_version))},
        "cpu_s_per_replica_per_version": round(statistics.median(v["cpu_s"] for v in per_version) / n, 5),
        "fallbacks": sum(v["fallbacks"] for v in per_version),
    }


def bandwidth_bound(parents: dict[str, str], delta_bytes: int, link_bytes_per_s: float) -> float:
    """The earliest the last replica can hold the version, given the tree as placed: a replica
    sends only what it received whole and verified (store and forward), one copy per child, all
    through its one link (`delta ÷ link` each: a hop). A sender best serves first the child whose
    subtree needs longest after it; so a subtree needs max over its children, taken in that order,
    of (their place in it × hop + what the child's own subtree needs). Direct: N × hop."""
    children: dict[str, list[str]] = {}
    for replica, parent in parents.items():
        children.setdefault(parent, []).append(replica)
    hop = delta_bytes / link_bytes_per_s

    order, todo = [], [""]  # parents before children; worked through backwards (no recursion: a chain)
    while todo:
        replica = todo.pop()
        order.append(replica)
        todo.extend(children.get(replica, []))
    needs: dict[str, float] = {}
    for replica in reversed(order):
        below = sorted((needs[child] for child in children.get(replica, [])), reverse=True)
        needs[replica] = max((i * hop + t for i, t in enumerate(below, start=1)), default=0.0)
    return needs[""]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("direct", "o"), ("relayed", "s")):
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        ns = [r["replicas"] for r in rows]
        left.plot(ns, [r["p99_s"] for r in rows], marker=marker, label=f"{mode}: p99")
        left.plot(ns, [r["bound_s"] for r in rows], marker=marker, linestyle=":", label=f"{mode}: bandwidth bound")
        right.plot(ns, [r["publisher_egress_bytes_per_version"] / 1e6 for r in rows], marker=marker, label=mode)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("replicas")
        ax.legend(fontsize=8)
    left.set_ylabel("seconds to a verified version")
    right.set_ylabel("publisher egress per version (MB)")
    fig.suptitle(f"Weight fan-out: {results[0]['delta_bytes'] / 1e6:.1f} MB deltas, {results[0]['link_mbps']:g} Mbit/s "
                 f"links", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--modes", nargs="+", choices=("direct", "relayed"), default=["direct", "relayed"])
    parser.add_argument("--delta-mb", type=float, default=1.0)
    parser.add_argument("--change", type=float, default=0.02, help="fraction of the weights' bytes each version moves")
    parser.add_argument("--link-mbps", type=float, default=25.0, help="every link's speed, the publisher's too")
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="processes the simulated replicas are spread over")
    parser.add_argument("--parent-deadline-s", type=float, default=600.0)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    versions = synthetic_versions(args.delta_mb, args.change, args.versions)
    results = []
    for n in args.replicas:
        for mode in args.modes:
            results.append(asyncio.run(run_one(n, mode == "relayed", versions, args)))
            print(json.dumps(results[-1]), file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
    print(json.dumps({"results": results}, indent=2))


if __name__ == "__main__":
    main()
