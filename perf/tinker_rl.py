"""examples/tinker_rl_loop.py against a whole local cluster (`policyloop up --tinker`:
every service as its own process: the tinker front, the one learner training its models too, and
tinker-sampler-0 sampling for it), with the
bootstrap model. Prints JSON: held-out accuracy before and after, steps, wall time, steps/s.

    .venv/bin/python perf/tinker_rl.py --steps 200 --groups 16 --group-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from policyloop.cluster.local import LocalCluster
from policyloop.demo.loop import wait_healthy
from policyloop.models.bootstrap import BootstrapConfig, bootstrap

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tinker_rl_loop.py"
API_KEY = "tml-perf"


def run_example(base_url: str, base_model: str, args: argparse.Namespace) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLICYLOOP_", "TINKER_"))}
    env.update(TINKER_BASE_URL=base_url, TINKER_API_KEY=API_KEY, TINKER_TELEMETRY="0")
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(EXAMPLE), "--base-model", base_model, "--steps", str(args.steps),
                          "--groups", str(args.groups), "--group-size", str(args.group_size), "--lr", str(args.lr),
                          "--eval-problems", str(args.eval_problems)],
                         env=env, capture_output=True, text=True, check=True).stdout
    seconds = time.monotonic() - started
    before = float(re.search(r"accuracy before: ([0-9.]+)%", out).group(1)) / 100  # type: ignore[union-attr]
    after = float(re.search(r"accuracy after \d+ steps: ([0-9.]+)%", out).group(1)) / 100  # type: ignore[union-attr]
    last = re.findall(r"step \d+: mean reward [0-9.]+ \((\d+) s\)", out)
    training_s = float(last[-1]) if last else seconds
    return {"accuracy_before": before, "accuracy_after": after, "steps": args.steps, "wall_s": round(seconds, 1),
            "training_s": training_s, "steps_per_s": round(args.steps / max(training_s, 1e-9), 2)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-problems", type=int, default=300)
    args = parser.parse_args()
    model = bootstrap(BootstrapConfig())
    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root), fresh=True, prometheus=False, tinker=True,
                               extra_env={"POLICYLOOP_MODEL_PATH": str(model), "POLICYLOOP_API_KEY": API_KEY})
        cluster.start()
        try:
            status = await wait_healthy(cluster, 300)
            if not status.all_healthy:
                raise SystemExit(f"the cluster did not become healthy: {status}")
            port = cluster.process("tinker-0").ports["api"]
            result = await asyncio.to_thread(run_example, f"http://127.0.0.1:{port}", model.name, args)
        finally:
            cluster.stop()
    print(json.dumps({"cluster": "policyloop up --tinker", "groups": args.groups,
                      "group_size": args.group_size, "lr": args.lr, "eval_problems": args.eval_problems, **result},
                     indent=1))


if __name__ == "__main__":
    asyncio.run(main())
