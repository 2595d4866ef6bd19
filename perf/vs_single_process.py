"""The distributed loop against a one-process GRPO loop on the same machine: the demo's task and
settings (model, groups per step, group size, lr, loss, sampling), the same training time.

- single process: `perf/single_process.py` — sample a group per problem, score, one optimizer
  step, repeat (plain torch, both cores, no services), with the learner's own optimisations: each
  distinct prompt computed once (`--single-plain-forward`: the plain forward over every prompt +
  response row of a one-file script instead). The yardstick is the best one-process loop;
- cluster: the local cluster with the demo's loop settings (`loop_env`), run started through
  the gateway; time 0 is the StartRun reply.

At every `--mark-every` seconds of training each side's weights are kept (the single process
copies its state dict; the cluster's newest version is fetched from the publisher and decoded,
exactly as a replica does); after training, every kept version is evaluated the same way
(greedy held-out accuracy on `--eval-problems` problems, the demo's) off the clock. Printed
(JSON) and written with a plot (accuracy against training time, both sides) to --out:

- `single` and `cluster`: the curve (seconds, steps, accuracy), steps/s;
- `time_to_60_ratio`, `time_to_75_ratio`: the cluster's time to 60% / 75% over the single
  process's (null where one side never got there; `time_to_N_ratio_above` bounds it where only
  the cluster did not); `steps_per_s_ratio`: the single process's steps/s over the cluster's.
  With `--repeats`, each is the median over the repeats that have it (`runs_counted`).

    .venv/bin/python perf/vs_single_process.py                       # 300 s each side
    .venv/bin/python perf/vs_single_process.py --seconds 420 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from single_process import (  # noqa: E402
    CurvePoint,
    SingleProcessConfig,
    SingleProcessGRPO,
    Snapshot,
    greedy_accuracy,
    load_weights,
    time_to_accuracy,
    train_for,
)

from policyloop.cluster.local import LocalCluster  # noqa: E402
from policyloop.demo.loop import DemoConfig, arithmetic_run, loop_cluster, require_healthy  # noqa: E402
from policyloop.envs import arithmetic  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.rl.settings import OptimizerSettings  # noqa: E402
from policyloop.weights.client import WeightClient  # noqa: E402
from policyloop.weights.sync import sync_weights  # noqa: E402
from policyloop.weights.torch_io import to_tensor  # noqa: E402

TARGETS = (0.60, 0.75)


def evaluate(model_path: Path, snapshots: list[Snapshot], eval_problems: int, seed: int) -> list[CurvePoint]:
    from transformers import AutoModelForCausalLM

    from policyloop.models.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    problems = arithmetic.heldout_problems(arithmetic.ArithmeticConfig(), eval_problems, seed=seed)
    curve = []
    for snapshot in snapshots:
        load_weights(model, snapshot.weights)
        accuracy = greedy_accuracy(model, tokenizer, problems)
        curve.append(CurvePoint(snapshot.seconds, snapshot.steps, round(accuracy, 4)))
    return curve


def run_single(config: DemoConfig, seconds: float, marks: list[float], share_prompts: bool = True
               ) -> tuple[list[Snapshot], float, int]:
    loop = SingleProcessGRPO(SingleProcessConfig(
        model_path=config.model_path, groups_per_step=config.groups_per_step, group_size=config.group_size,
        max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        optimizer=OptimizerSettings(lr=config.lr), loss=config.loss, seed=config.seed, share_prompts=share_prompts))
    snapshots, elapsed = train_for(loop, seconds, marks)
    return snapshots, elapsed, loop.steps


async def drive_cluster(cluster: LocalCluster, config: DemoConfig, seconds: float, marks: list[float]
                        ) -> tuple[list[Snapshot], float, int]:
    await require_healthy(cluster, 180)
    publisher = cluster.process("publisher-0").ports["grpc"]
    weights = WeightClient(f"127.0.0.1:{publisher}")
    held = None
    snapshots: list[Snapshot] = []

    async def keep(at: float) -> None:
        nonlocal held
        versions = await weights.list_versions("policy")
        if versions:
            held, _ = await sync_weights(weights, "policy", held, 0)
        if held is None:  # nothing published yet: the base model serves
            snapshots.append(Snapshot(at, 0, safetensors.torch.load_file(config.model_path / "model.safetensors")))
        else:
            tensors = {name: to_tensor(t).clone() for name, t in held.tensors.items()}
            snapshots.append(Snapshot(at, held.version, tensors))

    try:
        async with arithmetic_run(cluster, config):
            started = time.monotonic()
            await keep(0.0)
            for mark in marks:
                if mark > seconds:
                    break
                await asyncio.sleep(max(0.0, started + mark - time.monotonic()))
                await keep(mark)
            await asyncio.sleep(max(0.0, started + seconds - time.monotonic()))
            elapsed = time.monotonic() - started
        steps = snapshots[-1].steps if snapshots else 0
        return snapshots, elapsed, steps
    finally:
        await weights.close()


def run_cluster(config: DemoConfig, seconds: float, marks: list[float], root: Path
                ) -> tuple[list[Snapshot], float, int]:
    with loop_cluster(config, root) as cluster:
        return asyncio.run(drive_cluster(cluster, config, seconds, marks))


def side(curve: list[CurvePoint], elapsed: float, steps: int) -> dict:
    return {"curve": [asdict(p) for p in curve], "steps": steps, "seconds": round(elapsed, 1),
            "steps_per_s": round(steps / elapsed, 3) if elapsed else 0.0,
            **{f"time_to_{round(100 * t)}_s": _round(time_to_accuracy(curve, t)) for t in TARGETS}}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def compare(single: dict, cluster: dict) -> dict:
    """The ratios of a run; where the single process reached a target and the cluster did not,
    `time_to_N_ratio` is null and `time_to_N_ratio_above` the bound its training time gives."""
    out: dict = {"steps_per_s_ratio": ratio(single["steps_per_s"], cluster["steps_per_s"])}
    for target in TARGETS:
        key = f"time_to_{round(100 * target)}"
        out[f"{key}_ratio"] = ratio(cluster[f"{key}_s"], single[f"{key}_s"])
        if cluster[f"{key}_s"] is None and single[f"{key}_s"] is not None:
            out[f"{key}_ratio_above"] = ratio(cluster["seconds"], single[f"{key}_s"])
    return out


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, run in enumerate(result["runs"]):
        for name, color in (("single", "tab:green"), ("cluster", "tab:blue")):
            curve = run[name]["curve"]
            label = f"{'one process' if name == 'single' else 'policyloop cluster'} " \
                    f"({run[name]['steps_per_s']} steps/s)" if i == 0 else None
            ax.plot([p["seconds"] / 60 for p in curve], [100 * p["accuracy"] for p in curve], color=color,
                    alpha=1.0 if i == 0 else 0.45, marker="o", markersize=3, label=label)
    for target in TARGETS:
        ax.axhline(100 * target, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("held-out accuracy, greedy (%)")
    m = result["median"]
    runs, counted = len(result["runs"]), m.get("runs_counted", {}).get("time_to_75_ratio", len(result["runs"]))
    of_runs = f" ({counted} of {runs} runs reached 75% on both sides)" if counted < runs else ""
    ax.set_title(f"time to 75%: cluster/one process {m['time_to_75_ratio']}{of_runs};\n"
                 f"steps/s: one process/cluster {m['steps_per_s_ratio']}", fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="training time of each side")
    parser.add_argument("--mark-every", type=float, default=15.0, help="seconds between kept versions")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eval-problems", type=int, default=600)
    parser.add_argument("--model-path", type=model_argument, default=None, help="default: the bootstrap model")
    parser.add_argument("--groups-per-step", type=int, default=DemoConfig.groups_per_step)
    parser.add_argument("--group-size", type=int, default=DemoConfig.group_size)
    parser.add_argument("--single-plain-forward", action="store_true",
                        help="the single process runs the plain forward over every prompt + response row of a "
                             "one-file script (default: each distinct prompt once, as the learner does)")
    parser.add_argument("--only", choices=("single", "cluster"), default=None, help="run one side only")
    parser.add_argument("--out", type=Path, default=Path("perf/out/vs_single_process"))
    args = parser.parse_args()
    if args.model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        args.model_path = bootstrap(BootstrapConfig())
    config = DemoConfig(model_path=args.model_path, eval_problems=args.eval_problems,
                        groups_per_step=args.groups_per_step, group_size=args.group_size)
    marks = [args.mark_every * i for i in range(1, int(args.seconds // args.mark_every) + 1)]
    runs = []
    for _ in range(args.repeats):
        run: dict = {}
        if args.only != "cluster":
            snapshots, elapsed, steps = run_single(config, args.seconds, marks, not args.single_plain_forward)
            run["single"] = side(evaluate(args.model_path, snapshots, args.eval_problems, config.seed), elapsed, steps)
        if args.only != "single":
            with tempfile.TemporaryDirectory(prefix="vs-single-") as tmp:
                snapshots, elapsed, steps = run_cluster(config, args.seconds, marks, Path(tmp))
            run["cluster"] = side(evaluate(args.model_path, snapshots, args.eval_problems, config.seed), elapsed, steps)
        if "single" in run and "cluster" in run:
            run.update(compare(run["single"], run["cluster"]))
        runs.append(run)
    keys = ("time_to_60_ratio", "time_to_75_ratio", "steps_per_s_ratio")
    result = {
        "config": {"seconds": args.seconds, "mark_every": args.mark_every, "repeats": args.repeats,
                   "eval_problems": args.eval_problems, "single_shares_prompts": not args.single_plain_forward,
                   "groups_per_step": config.groups_per_step,
                   "group_size": config.group_size, "lr": config.lr, "max_lag": config.max_lag,
                   "model_path": str(args.model_path)},
        "median": {
            **{k: median_or_none([r.get(k) for r in runs]) for k in keys},
            **{f"{name}_steps_per_s": median_or_none([r[name]["steps_per_s"] for r in runs if name in r])
               for name in ("single", "cluster")},
            # A median leaves out the runs where a side never reached the target: how many it counts.
            "runs_counted": {k: sum(r.get(k) is not None for r in runs) for k in keys},
        },
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_single_process.json").write_text(json.dumps(result, indent=2))
    if all("single" in r and "cluster" in r for r in runs):
        plot(result, args.out / "vs_single_process.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
