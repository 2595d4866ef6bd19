"""Weight sync: delta codec speed and size, and end-to-end publish latency, full vs delta.

A synthetic transformer-shaped model (default ≥ 100M parameters) keeps fp32 master weights that
AdamW steps at lr 1e-6 on random gradients, as an RL learner does; what is served and synced is
their bf16 cast. For each version:

- codec: `encode_gbps` / `decode_gbps` are raw (bf16) bytes per second over all cores, `ratio`
  is raw bytes / delta bytes, `changed_fraction` the share of bf16 elements whose bits changed,
  `exact` that every replica's bytes hash to the learner's after applying (medians over versions).
- publish: learner step done → every client verified on the new version. The learner builds the
  version (bf16 cast + hashes), encodes it (a delta, or for `full` the raw weights), pushes it to a
  real WeightService over loopback gRPC; the publisher verifies and stores it durably (fsync),
  then announces it; each client fetches and applies it. Links are emulated by a byte-rate limit
  on the learner's push and on the publisher's egress (shared by its clients, one NIC). Cases
  are named `<full|delta>_<unthrottled|10gbps|1gbps>_<1|4>c`; values are median seconds.
  `crossover_gbps` is the link speed below which deltas win, from a fit t = a + b/link of the
  10 and 1 Gbit/s points with 4 clients (null when deltas win at every speed);
  `crossover_gbps_codec_bound` is where they would cross with a transport running at link speed
  (bytes saved × 8 / (encode + decode seconds)).
- `--soak N` chains N versions (smaller model by default) and checks exactness at the end.

    .venv/bin/python perf/weights_bench.py                      # default: ≥100M params
    .venv/bin/python perf/weights_bench.py --params 20e6 --publish-versions 2
    .venv/bin/python perf/weights_bench.py --soak 1000 --soak-params 10e6

Prints JSON; writes it and a PNG of the publish latencies to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from policyloop.weights import codec  # noqa: E402
from policyloop.weights.client import WeightClient  # noqa: E402
from policyloop.weights.library import WeightLibrary  # noqa: E402
from policyloop.weights.link import LinkLimit  # noqa: E402
from policyloop.weights.push import VersionPusher  # noqa: E402
from policyloop.weights.server import WeightServicer, start_weight_server  # noqa: E402
from policyloop.weights.store import StoredVersion, VersionStore  # noqa: E402
from policyloop.weights.sync import sync_weights  # noqa: E402
from policyloop.weights.torch_io import weight_set  # noqa: E402

LINKS = {"unthrottled": 0.0, "10gbps": 10.0, "1gbps": 1.0}


class SyntheticLearner:
    """Transformer-shaped fp32 master weights stepped by AdamW on random gradients."""

    def __init__(self, params: float, *, hidden: int, vocab: int, lr: float, init_std: float, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        mlp = hidden * 8 // 3
        layer = 0
        while sum(math.prod(s) for s in shapes.values()) < params:
            prefix = f"model.layers.{layer}"
            for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)),
                                ("self_attn.k_proj.weight", (hidden, hidden)),
                                ("self_attn.v_proj.weight", (hidden, hidden)),
                                ("self_attn.o_proj.weight", (hidden, hidden)),
                                ("mlp.gate_proj.weight", (mlp, hidden)), ("mlp.up_proj.weight", (mlp, hidden)),
                                ("mlp.down_proj.weight", (hidden, mlp)),
                                ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))):
                shapes[f"{prefix}.{name}"] = shape
            layer += 1
        shapes["model.norm.weight"] = (hidden,)
        self.params = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                tensor = torch.ones(shape)
            else:
                tensor = torch.randn(shape, generator=generator) * init_std
            self.params[name] = torch.nn.Parameter(tensor)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.01, foreach=True)
        self.generator = generator
        self.version = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def served(self) -> codec.WeightSet:
        with torch.no_grad():
            return weight_set(self.version, {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()})


def codec_figures(learner: SyntheticLearner, versions: int) -> dict:
    learner.step()
    previous = learner.served()
    replica = previous.copy()
    rows = []
    for _ in range(versions):
        learner.step()
        current = learner.served()
        started = time.perf_counter()
        encoded = codec.encode(current, previous)
        encode_s = time.perf_counter() - started
        started = time.perf_counter()
        replica = codec.apply(replica, encoded.payload)
        decode_s = time.perf_counter() - started
        keyframe_started = time.perf_counter()
        keyframe = codec.encode(current)
        keyframe_s = time.perf_counter() - keyframe_started
        rows.append({"raw": encoded.stats.raw_bytes, "delta": encoded.stats.payload_bytes,
                     "changed": encoded.stats.changed_fraction, "encode_s": encode_s, "decode_s": decode_s,
                     "keyframe_bytes": keyframe.stats.payload_bytes, "keyframe_encode_s": keyframe_s,
                     "exact": replica.manifest_hash == current.manifest_hash})
        previous = current
    raw = rows[0]["raw"]
    return {
        "params": learner.numel, "raw_bytes": raw,
        "delta_bytes": int(statistics.median(r["delta"] for r in rows)),
        "ratio": round(statistics.median(r["raw"] / r["delta"] for r in rows), 2),
        "changed_fraction": round(statistics.median(r["changed"] for r in rows), 5),
        "cores": os.cpu_count(),
        "encode_gbps": round(statistics.median(r["raw"] / r["encode_s"] for r in rows) / 1e9, 3),
        "decode_gbps": round(statistics.median(r["raw"] / r["decode_s"] for r in rows) / 1e9, 3),
        "keyframe_ratio": round(statistics.median(r["raw"] / r["keyframe_bytes"] for r in rows), 3),
        "keyframe_encode_gbps": round(statistics.median(r["raw"] / r["keyframe_encode_s"] for r in rows) / 1e9, 3),
        "exact": all(r["exact"] for r in rows),
        "codec_versions": versions,
        # With a transport that runs at link speed, deltas win below the speed at which the
        # bytes they save take as long to send as encoding and decoding them takes.
        "crossover_gbps_codec_bound": round(statistics.median(
            (r["raw"] - r["delta"]) * 8 / (r["encode_s"] + r["decode_s"]) for r in rows) / 1e9, 2),
    }


async def publish_case(learner: SyntheticLearner, mode: str, link_gbps: float, clients: int, versions: int,
                       root: Path) -> tuple[list[float], bool]:
    """Median-able latencies of `versions` publishes, and whether every client ended exact."""
    announced: dict[int, asyncio.Event] = {}

    async def on_stored(stored: StoredVersion) -> None:
        announced.setdefault(stored.version, asyncio.Event()).set()

    library = WeightLibrary(VersionStore(root, retention=4), snapshot_every=1_000_000)
    servicer = WeightServicer(library, on_stored=on_stored, egress=LinkLimit(link_gbps))
    server, port = await start_weight_server(servicer, host="127.0.0.1", port=0)
    target = f"127.0.0.1:{port}"
    learner_client = WeightClient(target, deadline_s=600, link=LinkLimit(link_gbps))
    replicas = [WeightClient(target, deadline_s=600) for _ in range(clients)]
    pusher = VersionPusher(learner_client, "bench")
    held: list[codec.WeightSet | None] = [None] * clients
    latencies = []
    exact = True
    try:
        async def publish(weights: codec.WeightSet) -> None:
            await pusher.push(weights, weights.version, full=mode == "full")

        async def follow(i: int, version: int) -> None:
            await announced.setdefault(version, asyncio.Event()).wait()
            have = held[i] if mode == "delta" else None  # full: every version whole
            held[i], _ = await sync_weights(replicas[i], "bench", have, version)

        for n in range(versions + 1):  # the first version primes the replicas (a keyframe)
            learner.step()
            started = time.perf_counter()
            weights = await asyncio.to_thread(learner.served)
            await asyncio.gather(publish(weights), *(follow(i, weights.version) for i in range(clients)))
            elapsed = time.perf_counter() - started
            exact = exact and all(h is not None and h.manifest_hash == weights.manifest_hash for h in held)
            if n:
                latencies.append(elapsed)
    finally:
        for client in (learner_client, *replicas):
            await client.close()
        await server.stop(None)
    return latencies, exact


def fit(t_fast: float, t_slow: float, fast: float = 10.0, slow: float = 1.0) -> tuple[float, float]:
    """a, b of t = a + b / link through two points."""
    b = (t_slow - t_fast) / (1 / slow - 1 / fast)
    return t_fast - b / fast, b


def crossover(publish: dict[str, float], clients: int) -> float | None:
    a_full, b_full = fit(publish[f"full_10gbps_{clients}c"], publish[f"full_1gbps_{clients}c"])
    a_delta, b_delta = fit(publish[f"delta_10gbps_{clients}c"], publish[f"delta_1gbps_{clients}c"])
    if a_delta <= a_full or b_delta >= b_full:
        return None if b_delta < b_full else 0.0
    return round((b_full - b_delta) / (a_delta - a_full), 2)


async def publish_figures(learner: SyntheticLearner, versions: int, clients_list: list[int], tmp: Path) -> dict:
    publish: dict[str, float] = {}
    exact = True
    for mode in ("delta", "full"):
        for link_name, gbps in LINKS.items():
            for clients in clients_list:
                case = f"{mode}_{link_name}_{clients}c"
                latencies, ok = await publish_case(learner, mode, gbps, clients, versions, tmp / case)
                publish[case] = round(statistics.median(latencies), 4)
                exact = exact and ok
                print(json.dumps({"case": case, "seconds": [round(x, 4) for x in latencies]}), file=sys.stderr)
    out: dict = {"publish": publish, "publish_exact": exact, "publish_versions": versions}
    for clients in clients_list:
        key = "crossover_gbps" if clients == max(clients_list) else f"crossover_gbps_{clients}c"
        out[key] = crossover(publish, clients)
        if out[key] is None:
            out[f"{key}_note"] = "deltas win at every link speed (smaller fixed cost and smaller payload)"
    return out


def soak(learner: SyntheticLearner, versions: int) -> dict:
    learner.step()
    previous = learner.served()
    replica = previous.copy()
    started = time.perf_counter()
    delta_bytes = []
    for _ in range(versions):
        learner.step()
        current = learner.served()
        encoded = codec.encode(current, previous)
        replica = codec.apply(replica, encoded.payload)
        delta_bytes.append(encoded.stats.payload_bytes)
        previous = current
    final = learner.served()
    exact = replica.manifest_hash == final.manifest_hash and all(
        bytes(replica.tensors[n].data) == bytes(final.tensors[n].data) for n in final.tensors)
    return {"soak_versions": versions, "soak_params": learner.numel, "soak_exact": exact,
            "soak_final_version": replica.version, "soak_seconds": round(time.perf_counter() - started, 1),
            "soak_delta_bytes_median": int(statistics.median(delta_bytes))}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    publish = result["publish"]
    cases = sorted({k.split("_", 1)[1] for k in publish}, key=lambda c: (c.split("_")[1], -LINKS[c.split("_")[0]]
                                                                           if LINKS[c.split("_")[0]] else -1e9))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.4
    xs = range(len(cases))
    ax.bar([x - width / 2 for x in xs], [publish[f"full_{c}"] for c in cases], width, label="full weights")
    ax.bar([x + width / 2 for x in xs], [publish[f"delta_{c}"] for c in cases], width, label="XOR delta")
    ax.set_xticks(list(xs), cases, rotation=20)
    ax.set_ylabel("seconds, learner step → every client verified (median)")
    ax.set_title(f"Publish latency, {result['params'] / 1e6:.0f}M params bf16, ratio {result['ratio']}, "
                 f"{result['changed_fraction'] * 100:.1f}% changed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    result: dict = {"lr": args.lr, "init_std": args.init_std}
    if args.soak:
        soak_learner = SyntheticLearner(args.soak_params or args.params, hidden=args.hidden, vocab=args.vocab,
                                        lr=args.lr, init_std=args.init_std, seed=args.seed)
        result.update(soak(soak_learner, args.soak))
        if args.soak_only:
            return result
    learner = SyntheticLearner(args.params, hidden=args.hidden, vocab=args.vocab, lr=args.lr,
                               init_std=args.init_std, seed=args.seed)
    result.update(codec_figures(learner, args.versions))
    if args.publish_versions:
        with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
            result.update(await publish_figures(learner, args.publish_versions, args.clients, Path(tmp)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6, help="at least this many parameters")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--init-std", type=float, default=0.02, help="std of the matrices (norms start at 1)")
    parser.add_argument("--versions", type=int, default=5, help="versions for the codec figures")
    parser.add_argument("--publish-versions", type=int, default=3, help="versions per publish case (0: skip)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--soak", type=int, default=0, help="chain this many versions and check exactness")
    parser.add_argument("--soak-params", type=float, default=0, help="model size for the soak (0: --params)")
    parser.add_argument("--soak-only", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for the steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp-dir", default=None, help="where the publisher stores versions (default: $TMPDIR)")
    parser.add_argument("--out", type=Path, default=Path("runs/perf/weights_bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = asyncio.run(main_async(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    if "publish" in result:
        plot(result, args.out / "publish_latency.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
