"""Where a learner step's wall time goes on the demo's loop, and where a version's time goes on
a rollout replica: the local cluster with the demo's settings (model, task, groups per step,
group size, lr, loss, max_lag) runs the arithmetic environment; after `--warmup-steps` steps the
learner's and the replicas' phase counters are read, and again `--seconds` later. Reported:

- `learner.per_step_ms`: the mean time of each phase of a step (policyloop_learner_phase_seconds:
  waiting for a batch, pack, forward, backward, optimizer, the trainer's thread hand-off, export,
  hash, LEDGER record, colocated broadcast, encode, push (with the publisher's verify and store),
  version registry and release, progress, checkpoint), which add up to `step_ms`;
- `learner.per_step_overlapped_ms` (and their sum, `overlapped_ms`): a version's publication phases
  where they ran alongside the next step (the learner's overlap_publication); `publish_wait` in
  `per_step_ms` is the part of them a step waited for;
- `learner.steps`, `steps_per_s` and `busy_fraction` (not waiting for a batch) over the window;
- `rollout.per_version_ms`: the mean time of each phase of taking a version on the replicas
  (fetch, decode_verify, write, then stage and activate, or pause, load and continue) and `versions`;
- `cpu.core_ms_per_step`: the CPU time (user + system, from /proc) each process of the cluster
  spent per learner step over the window — each service, its engine ('<name> children'),
  nats-server, redis-server — and their sum, `cpu.core_s_per_step`: what a step costs the machine,
  a figure less at the mercy of a noisy neighbour than steps/s.

    .venv/bin/python perf/step_profile.py                    # 120 s after 10 warm-up steps
    .venv/bin/python perf/step_profile.py --seconds 60 --repeats 3
    .venv/bin/python perf/step_profile.py --learner-device cuda   # the learner on the GPU

Prints JSON (with medians over `--repeats` fresh clusters) and writes it and step_profile.png
(stacked bars: a step's phases; a version's phases) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from policyloop.cluster.local import LocalCluster, service_of  # noqa: E402
from policyloop.cluster.scrape import MetricsEndpoint, Scrape, scrape_services  # noqa: E402
from policyloop.demo.loop import DemoConfig, arithmetic_run, loop_cluster, require_healthy  # noqa: E402
from policyloop.learner.figures import ON_STEP, OVERLAPPED, PUBLISH_PHASES, STEP_PHASES  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.state import HeartbeatRegistry, connect_redis  # noqa: E402

VERSION_PHASES = ("fetch", "decode_verify", "write", "stage", "activate", "pause", "load", "continue")


def phase_totals(scrape: Scrape, name: str, **match: str) -> dict[str, float]:
    return {phase: value for (phase,), value in scrape.by(name, "phase", **match).items()}


def per_step(before: Scrape, after: Scrape, steps: float, **match: str) -> dict[str, float]:
    """Mean ms per step of each learner phase (in a step's order) between two scrapes."""
    name = "policyloop_learner_phase_seconds_total"
    was = phase_totals(before, name, **match)
    spent = {phase: now - was.get(phase, 0.0) for phase, now in phase_totals(after, name, **match).items()}
    return {phase: round(1000 * spent[phase] / steps, 2) for phase in STEP_PHASES if steps and phase in spent}


def profile(before: Scrape, after: Scrape, seconds: float) -> dict:
    """The per-step and per-version figures between two scrapes of the cluster: a step's own
    phases (which add up to its wall time) and, apart, a version's publication where it ran
    alongside the next step (overlap_publication)."""
    steps = after.total("policyloop_learner_step_seconds_count") - before.total("policyloop_learner_step_seconds_count")
    on_step = per_step(before, after, steps, path=ON_STEP)
    overlapped = per_step(before, after, steps, path=OVERLAPPED)
    versions = (after.total("policyloop_weight_sync_seconds_count", phase="fetch")
                - before.total("policyloop_weight_sync_seconds_count", phase="fetch"))
    loaded = {phase: after_s - phase_totals(before, "policyloop_rollout_version_phase_seconds_total").get(phase, 0.0)
              for phase, after_s in phase_totals(after, "policyloop_rollout_version_phase_seconds_total").items()}
    per_version = {phase: round(1000 * loaded[phase] / versions, 2) for phase in VERSION_PHASES
                   if versions and phase in loaded}
    waiting = on_step.get("wait_for_batch", 0.0) * steps / 1000
    return {
        "seconds": round(seconds, 1),
        "learner": {"steps": int(steps), "steps_per_s": round(steps / seconds, 3),
                    "busy_fraction": round(1 - waiting / seconds, 3) if seconds else 0.0,
                    "step_ms": round(sum(on_step.values()), 1), "per_step_ms": on_step,
                    "overlapped_ms": round(sum(overlapped.values()), 1), "per_step_overlapped_ms": overlapped},
        "rollout": {"versions": int(versions), "version_ms": round(sum(per_version.values()), 1),
                    "per_version_ms": per_version},
    }


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process so far (/proc/<pid>/stat); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_by_parent() -> dict[int, list[int]]:
    """Every process's direct children, from one pass over /proc (a service's engine process)."""
    found: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        found.setdefault(parent, []).append(int(stat.parent.name))
    return found


def cluster_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds so far of every process of the cluster, by name; a service's children (its
    engine) under '<name> children'. Linux only (/proc)."""
    used: dict[str, float] = {}
    children = children_by_parent()
    for managed in cluster.infrastructure + cluster.processes:
        if managed.proc is None:
            continue
        own = cpu_seconds(managed.proc.pid)
        if own is not None:
            used[managed.name] = own
        spawned = [t for t in (cpu_seconds(c) for c in children.get(managed.proc.pid, [])) if t is not None]
        if spawned:
            used[f"{managed.name} children"] = sum(spawned)
    return used


def cpu_per_step(before: dict[str, float], after: dict[str, float], steps: float) -> dict[str, float]:
    """Core-milliseconds per learner step of each process between two readings, largest first
    (one core busy for the whole window = 1000 ms per second of it)."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after if name in before}
    return {name: round(1000 * s / steps, 1) for name, s in sorted(spent.items(), key=lambda kv: -kv[1])
            if steps and s > 0}


async def learner_step(registry: HeartbeatRegistry) -> int:
    return next((b.learner.step for b in await registry.alive() if b.service == "learner"), 0)


async def drive(cluster: LocalCluster, config: DemoConfig, args: argparse.Namespace) -> dict:
    await require_healthy(cluster, 180)
    endpoints = [MetricsEndpoint(p.name, service_of(p.name), f"http://127.0.0.1:{p.ports['http']}/metrics")
                 for p in cluster.processes if "http" in p.ports]
    redis_client = await connect_redis(cluster.redis_url)
    registry = HeartbeatRegistry(redis_client, cluster.namespace)
    try:
        async with arithmetic_run(cluster, config):
            deadline = time.monotonic() + args.timeout_s
            while await learner_step(registry) < args.warmup_steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {args.warmup_steps} steps in {args.timeout_s} s")
                await asyncio.sleep(0.5)
            before, started, cpu_before = await scrape_services(endpoints), time.monotonic(), cluster_cpu(cluster)
            await asyncio.sleep(args.seconds)
            after, cpu_after = await scrape_services(endpoints), cluster_cpu(cluster)
            figures = profile(before, after, time.monotonic() - started)
            per_step = cpu_per_step(cpu_before, cpu_after, figures["learner"]["steps"])
            figures["cpu"] = {"core_ms_per_step": per_step, "core_s_per_step": round(sum(per_step.values()) / 1000, 3)}
        return figures
    finally:
        await redis_client.aclose()


def run_once(config: DemoConfig, args: argparse.Namespace, root: Path) -> dict:
    with loop_cluster(config, root) as cluster:
        return asyncio.run(drive(cluster, config, args))


def medians(runs: list[dict]) -> dict:
    def median_of(path: tuple[str, ...]) -> float:
        values = []
        for run in runs:
            value = run
            for key in path:
                value = value.get(key, {}) if isinstance(value, dict) else {}
            if isinstance(value, (int, float)):
                values.append(value)
        return round(statistics.median(values), 3) if values else 0.0

    return {
        "learner": {"steps_per_s": median_of(("learner", "steps_per_s")),
                    "busy_fraction": median_of(("learner", "busy_fraction")),
                    "step_ms": median_of(("learner", "step_ms")),
                    "per_step_ms": {p: median_of(("learner", "per_step_ms", p)) for p in STEP_PHASES},
                    "overlapped_ms": median_of(("learner", "overlapped_ms")),
                    "per_step_overlapped_ms": {p: median_of(("learner", "per_step_overlapped_ms", p))
                                               for p in PUBLISH_PHASES}},
        "rollout": {"version_ms": median_of(("rollout", "version_ms")),
                    "per_version_ms": {p: median_of(("rollout", "per_version_ms", p)) for p in VERSION_PHASES}},
        "cpu": {"core_s_per_step": median_of(("cpu", "core_s_per_step")),
                "core_ms_per_step": {name: median_of(("cpu", "core_ms_per_step", name))
                                     for name in runs[0].get("cpu", {}).get("core_ms_per_step", {})}},
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("a learner step (ms)", summary["median"]["learner"]["per_step_ms"]),
              ("a version on a replica (ms)", summary["median"]["rollout"]["per_version_ms"])]
    if summary["median"]["learner"]["overlapped_ms"]:
        panels.insert(1, ("publication alongside the next step (ms)",
                          summary["median"]["learner"]["per_step_overlapped_ms"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 5))
    for ax, (title, phases) in zip(axes, panels, strict=True):
        bottom = 0.0
        colors = plt.get_cmap("tab20").colors
        for i, (phase, ms) in enumerate(p for p in phases.items() if p[1] > 0):
            ax.bar([0], [ms], bottom=bottom, color=colors[i % len(colors)], label=f"{phase} {ms:.0f}")
            bottom += ms
        ax.set_title(f"{title}: {bottom:.0f}")
        ax.set_xticks([])
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"policyloop step profile: {summary['median']['learner']['steps_per_s']} steps/s (median of "
                 f"{len(summary['runs'])})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    parser.add_argument("--seconds", type=float, default=120.0, help="Length of the measured window.")
    parser.add_argument("--warmup-steps", type=int, default=10, help="Steps before the window opens.")
    parser.add_argument("--repeats", type=int, default=1, help="Fresh clusters measured (medians are reported).")
    parser.add_argument("--groups-per-step", type=int, default=defaults.groups_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--model-path", type=model_argument, default=None, help="Default: the demo's bootstrap model.")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="Most seconds to reach the warm-up steps.")
    parser.add_argument("--learner-device", choices=("auto", "cpu", "cuda"), default=None,
                        help="Where the learner trains (its POLICYLOOP_DEVICE). Default: POLICYLOOP_DEVICE as set, "
                             "else auto.")
    parser.add_argument("--out", type=Path, default=Path("runs/perf"))
    args = parser.parse_args()
    if args.learner_device is not None:
        os.environ["POLICYLOOP_DEVICE"] = args.learner_device  # the services inherit this environment
    config = DemoConfig(groups_per_step=args.groups_per_step, group_size=args.group_size, model_path=args.model_path)
    if config.model_path is None:
        from policyloop.models.bootstrap import BootstrapConfig, bootstrap

        config.model_path = bootstrap(BootstrapConfig())
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="step-profile-") as root:
            runs.append(run_once(config, args, Path(root)))
    summary = {"config": {"seconds": args.seconds, "warmup_steps": args.warmup_steps, "repeats": args.repeats,
                          "groups_per_step": config.groups_per_step, "group_size": config.group_size,
                          "max_lag": config.max_lag, "model_path": str(config.model_path),
                          "learner_device": os.environ.get("POLICYLOOP_DEVICE", "auto")},
               "median": medians(runs), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "step_profile.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
