"""The learner's own work on the demo's batch, outside the cluster: one PolicyTrainer step (pack,
forward, backward, optimizer) and one version's delta (encode, apply) on the demo's model, with
the batches the demo samples (the one-process loop draws them: 32 groups of 8, at most 8 new
tokens). Run it on an idle machine, beside a running cluster, or pinned with `taskset`, to see
what the learner's step costs by itself and what sharing the cores costs it.

    .venv/bin/python perf/learner_alone.py
    taskset -c 0 .venv/bin/python perf/learner_alone.py --steps 12
    .venv/bin/python perf/learner_alone.py --plain     # every prompt + response row in one forward

Prints JSON (medians over the steps after `--warmup`): `step_ms` and `phases_ms` of a trainer
step, `encode_ms` and `apply_ms` of the delta from one version to the next, `delta_ratio`
(payload bytes / raw bytes) and the batch's mean prompt and response lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policyloop.contracts.v1 import bus_pb2  # noqa: E402
from policyloop.models.bootstrap import BootstrapConfig, bootstrap  # noqa: E402
from policyloop.rl.single_process import SingleProcessConfig, SingleProcessGRPO, generate  # noqa: E402
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig  # noqa: E402
from policyloop.weights import codec  # noqa: E402
from policyloop.weights.torch_io import weight_set  # noqa: E402


def demo_batches(model_path: Path, count: int, groups: int, group_size: int) -> list[list[list[bus_pb2.Trajectory]]]:
    """`count` batches sampled as the demo samples them, scored with the arithmetic verifier."""
    loop = SingleProcessGRPO(SingleProcessConfig(model_path=model_path, groups_per_step=groups,
                                                 group_size=group_size, threads=1))
    batches = []
    for b in range(count):
        chosen = [loop.rng.choice(loop.problems) for _ in range(groups)]
        prompts = [loop.tokenizer(p.prompt, add_special_tokens=False).input_ids
                   for p in chosen for _ in range(group_size)]
        out = generate(loop.model, prompts, max_new_tokens=loop.config.max_new_tokens, temperature=1.0,
                       eos_id=loop.eos_id, pad_id=loop.pad_id, seeds=list(range(len(prompts))))
        batch = []
        for g in range(groups):
            members = []
            for i in range(g * group_size, (g + 1) * group_size):
                tokens = out.tokens[i]
                members.append(bus_pb2.Trajectory(
                    trajectory_id=f"b{b}/{i}", group_id=f"b{b}/{g}", sample_index=i - g * group_size,
                    group_size=group_size, prompt_token_ids=prompts[i], response_token_ids=tokens,
                    loss_mask=[True] * len(tokens), behaviour_logprobs=[-1.0] * len(tokens),
                    reward=float(i % 2), scored=True))
            batch.append(members)
        batches.append(batch)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None, help="Default: the demo's bootstrap model.")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="The learner's torch threads (the cluster's: 1).")
    parser.add_argument("--plain", action="store_true",
                        help="The plain forward over every row (share_prompts off: each group's prompt every time).")
    args = parser.parse_args()
    model_path = args.model_path or bootstrap(BootstrapConfig())
    batches = demo_batches(model_path, 4, args.groups_per_step, args.group_size)
    trainer = PolicyTrainer(model_path, TrainerConfig(threads=args.threads, device="cpu",
                                                          share_prompts=not args.plain))
    steps, phases, encodes, applies, ratios = [], [], [], [], []
    try:
        held = weight_set(trainer.version, trainer.export_tensors())
        for i in range(args.warmup + args.steps):
            started = time.perf_counter()
            report = trainer.step(batches[i % len(batches)])
            step_s = time.perf_counter() - started
            new = weight_set(trainer.version, trainer.export_tensors())
            started = time.perf_counter()
            delta = codec.encode(new, held)
            encode_s = time.perf_counter() - started
            base = held.copy()
            started = time.perf_counter()
            codec.apply(base, delta.payload)
            apply_s = time.perf_counter() - started
            held = new
            if i >= args.warmup:
                steps.append(step_s)
                phases.append(report.phases)
                encodes.append(encode_s)
                applies.append(apply_s)
                ratios.append(delta.stats.payload_bytes / delta.stats.raw_bytes)
    finally:
        trainer.close()
    samples = [t for group in batches[0] for t in group]
    print(json.dumps({
        "config": {"model_path": str(model_path), "steps": args.steps, "groups_per_step": args.groups_per_step,
                   "group_size": args.group_size, "threads": args.threads, "share_prompts": not args.plain},
        "step_ms": round(1000 * statistics.median(steps), 1),
        "phases_ms": {name: round(1000 * statistics.median(p[name] for p in phases), 1) for name in phases[0]},
        "encode_ms": round(1000 * statistics.median(encodes), 2),
        "apply_ms": round(1000 * statistics.median(applies), 2),
        "delta_ratio": round(statistics.median(ratios), 3),
        "mean_prompt_tokens": round(statistics.mean(len(t.prompt_token_ids) for t in samples), 2),
        "mean_response_tokens": round(statistics.mean(len(t.response_token_ids) for t in samples), 2),
        "longest_response_tokens": max(len(t.response_token_ids) for t in samples),
    }, indent=2))


if __name__ == "__main__":
    main()
