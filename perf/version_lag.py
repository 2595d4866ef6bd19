"""Version lag under control: the local cluster on the arithmetic environment for a fixed number
of learner steps, for each max_lag × rollout replicas, and what it cost or saved.

For each configuration a fresh local cluster (nats-server, redis-server, the six services) is
started with `max_lag` set for every service and `replicas` rollout replicas, the arithmetic
environment is submitted through the gateway, and the run goes until the learner has taken
`--steps` steps. Reported per configuration:

- `lag_histogram`, `lag_max`: versions between each trained sample's oldest token and the
  version that trained it (the learner's histogram);
- `dropped_fraction`: samples the learner did not train, by reason, over samples it saw;
- `generated_tokens_per_s` (all replicas) and `learner_tokens_per_s` (trained tokens), over the
  wall time from the learner's first trajectory to its last step;
- `learner_idle_fraction`: 1 − (time stepping and publishing) / that wall time;
- `wall_seconds` (start of the run to the last step) and `accuracy_after` (greedy, held-out).

    .venv/bin/python perf/version_lag.py                 # max_lag 0 1 2 4 × replicas 1 2
    .venv/bin/python perf/version_lag.py --quick         # max_lag 0 1, one replica, fewer steps

Prints JSON (a list, one entry per configuration) and writes it and version_lag.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from policyloop.cluster.local import LocalCluster  # noqa: E402
from policyloop.contracts.v1 import loop_pb2, loop_pb2_grpc, status_pb2  # noqa: E402
from policyloop.demo.loop import evaluate, start_arithmetic_run, wait_healthy  # noqa: E402
from policyloop.engines.sglang_client import SGLangClient  # noqa: E402
from policyloop.envs import arithmetic  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.state import HeartbeatRegistry, connect_redis  # noqa: E402


def summarise(learner: status_pb2.LearnerStatus, rollouts: list[status_pb2.RolloutStatus],
              run_started_unix: float) -> dict:
    """One configuration's figures from the learner's and the replicas' statuses."""
    histogram = dict(learner.lag_histogram)
    dropped = {f.name: v for f, v in learner.dropped.ListFields()}
    trained = sum(histogram.values())
    seen = trained + sum(dropped.values())
    first, last = learner.first_trajectory_at, learner.last_step_at
    window = max(1e-9, last - first)
    generated = sum(r.generated_tokens for r in rollouts)
    return {
        "lag_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "lag_max": max(histogram) if histogram else 0,
        "dropped_fraction": {reason: round(count / max(1, seen), 4) for reason, count in dropped.items()},
        "dropped_fraction_total": round(sum(dropped.values()) / max(1, seen), 4),
        "generated_tokens_per_s": round(generated / window, 1),
        "learner_tokens_per_s": round(learner.trained_tokens / window, 1),
        "learner_idle_fraction": round(max(0.0, 1.0 - learner.busy_s / window), 4),
        "wall_seconds": round(last - run_started_unix, 1),
        "steps": learner.step,
    }


async def beats_after_the_last_step(registry: HeartbeatRegistry, timeout_s: float = 30.0) -> list:
    """Every service's heartbeat, once each one was sent after the learner's last step: a replica's
    beat from before it (they come every couple of seconds) would miss what it generated since."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats = await registry.alive()
        last_step_ms = max((b.learner.last_step_at * 1000 for b in beats if b.service == "learner"), default=0)
        if all(b.beat_unix_ms >= last_step_ms for b in beats) or time.monotonic() > deadline:
            return beats
        await asyncio.sleep(0.5)


async def drive(cluster: LocalCluster, args: argparse.Namespace, model_path: Path) -> dict:
    from policyloop.models.tokenizer import load_tokenizer

    status = await wait_healthy(cluster, 180)
    if not status.all_healthy:
        raise RuntimeError(f"the cluster is not healthy: missing {status.missing}")
    redis_client = await connect_redis(cluster.redis_url)
    registry = HeartbeatRegistry(redis_client, cluster.namespace)
    try:
        gateway = cluster.process("gateway-0").ports["grpc"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway}") as channel:
            stub = loop_pb2_grpc.LoopServiceStub(channel)
            run_started = time.time()
            _, run = await start_arithmetic_run(stub, args.group_size, 8, 1.0, args.seed)
            deadline = time.monotonic() + args.timeout_s
            while True:
                await asyncio.sleep(1.0)
                beats = await registry.alive()
                step = next((b.learner.step for b in beats if b.service == "learner"), 0)
                if step >= args.steps or time.monotonic() > deadline:
                    break
            await stub.StopRun(loop_pb2.StopRunRequest(run_id=run.run_id), timeout=30)
        beats = await beats_after_the_last_step(registry)
        learner = next(b.learner for b in beats if b.service == "learner")
        rollouts = [b.rollout for b in beats if b.service == "rollout"]
        figures = summarise(learner, rollouts, run_started)
        # Held-out accuracy of what the first replica serves at the end.
        tokenizer = load_tokenizer(model_path)
        heldout = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), args.eval_problems, seed=args.seed)
        async with SGLangClient(rollouts[0].engine_url, timeout_s=120) as engine:
            measured = await evaluate(engine, tokenizer, heldout)
        figures["accuracy_after"], figures["accuracy_version"] = measured.accuracy, measured.version
        return figures
    finally:
        await redis_client.aclose()


def run_configuration(max_lag: int, replicas: int, args: argparse.Namespace, model_path: Path, root: Path) -> dict:
    env = {
        "POLICYLOOP_MODEL_PATH": str(model_path),
        "POLICYLOOP_MAX_LAG": str(max_lag),
        "POLICYLOOP_GROUPS_PER_STEP": str(args.groups_per_step),
        "POLICYLOOP_OPTIMIZER__LR": str(args.lr),
        "POLICYLOOP_WEIGHTS_DIR": str(root / "rollout-weights"),
    }
    cluster = LocalCluster(root, extra_env=env, replicas={"rollout": replicas}, fresh=True)
    cluster.start()
    try:
        figures = asyncio.run(drive(cluster, args, model_path))
    except BaseException:
        # The cluster's directory is temporary: what its processes said goes out with the error.
        print(log_tails(root / "logs"), file=sys.stderr)
        raise
    finally:
        cluster.stop()
    return {"max_lag": max_lag, "replicas": replicas} | figures


def log_tails(logs: Path, lines: int = 15) -> str:
    """The last lines of every process's log in `logs`."""
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                     for log in sorted(logs.glob("*.log")))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"lag≤{r['max_lag']}\n{r['replicas']} repl." for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(labels, [r["learner_idle_fraction"] for r in results], color="tab:orange")
    axes[0].set_title("learner idle fraction")
    axes[1].bar(labels, [r["learner_tokens_per_s"] for r in results], color="tab:blue")
    axes[1].set_title("trained tokens / s")
    lags = sorted({int(k) for r in results for k in r["lag_histogram"]})
    bottom = [0.0] * len(results)
    for lag in lags:
        shares = [r["lag_histogram"].get(str(lag), 0) / max(1, sum(r["lag_histogram"].values())) for r in results]
        axes[2].bar(labels, shares, bottom=bottom, label=f"lag {lag}")
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    axes[2].set_title("trained samples by lag")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-lags", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30, help="learner steps per configuration")
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-problems", type=int, default=100)
    parser.add_argument("--timeout-s", type=float, default=600, help="per configuration")
    parser.add_argument("--quick", action="store_true", help="max_lag 0 and 1, one replica, 12 steps")
    parser.add_argument("--model-path", type=model_argument, default=None, help="default: the bootstrap model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/perf/version_lag"))
    args = parser.parse_args()
    if args.quick:
        args.max_lags, args.replicas, args.steps = [0, 1], [1], 12
    model_path = args.model_path
    if model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        model_path = bootstrap(BootstrapConfig())
    results = []
    with tempfile.TemporaryDirectory(prefix="version-lag-") as tmp:
        for replicas in args.replicas:
            for max_lag in args.max_lags:
                started = time.monotonic()
                root = Path(tmp) / f"{max_lag}-{replicas}"
                entry = run_configuration(max_lag, replicas, args, Path(model_path), root)
                entry["harness_seconds"] = round(time.monotonic() - started, 1)
                print(json.dumps(entry), file=sys.stderr)
                results.append(entry)
    checks = Counter()
    for r in results:
        checks["lag_within_bound"] += r["lag_max"] <= r["max_lag"]
        checks["dropped_within_2pct"] += r["dropped_fraction_total"] <= 0.02
    summary = {"configurations": results, "all_lag_within_bound": checks["lag_within_bound"] == len(results),
               "all_dropped_within_2pct": checks["dropped_within_2pct"] == len(results)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(summary, indent=2))
    plot(results, args.out / "version_lag.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
