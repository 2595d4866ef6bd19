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
(payload bytes / raw bytes), the batch's mean prompt and response lengths, and `to_engine_ms`:
the two ways a replica hands a verified version to its engine — `directory_write` and
`directory_read` (the Hugging Face directory /update_weights_from_disk loads), `request_send` and
`request_read` (the /update_weights_from_tensor body: the safetensors file as base64 in JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from single_process import SingleProcessConfig, SingleProcessGRPO, generate  # noqa: E402

from policyloop.contracts.v1 import bus_pb2  # noqa: E402
from policyloop.models.bootstrap import BootstrapConfig, bootstrap  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig  # noqa: E402
from policyloop.weights import codec  # noqa: E402
from policyloop.weights.codec import WeightSet  # noqa: E402
from policyloop.weights.torch_io import safetensors_bytes, weight_set, write_version_dir  # noqa: E402


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


def to_engine_s(weights: WeightSet, model_path: Path, root: Path) -> dict[str, float]:
    """Seconds of each way to hand `weights` to an engine, as the replica and the engine do it."""
    from safetensors import safe_open

    from policyloop.engines.embedded.model import sent_tensors
    from policyloop.engines.protocol import SAFETENSORS_FORMAT, UpdateWeightsFromTensorRequest

    def timed(run: Callable[[], object]) -> tuple[float, object]:
        started = time.perf_counter()
        out = run()
        return time.perf_counter() - started, out

    def read_directory(directory: Path) -> dict[str, object]:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118

    def send() -> str:
        request = UpdateWeightsFromTensorRequest(serialized_named_tensors=[safetensors_bytes(weights)],
                                                 load_format=SAFETENSORS_FORMAT, weight_version=str(weights.version))
        return json.dumps(request.to_json())

    def read(body: str) -> object:
        return sent_tensors(UpdateWeightsFromTensorRequest.from_json(json.loads(body)).serialized_named_tensors)

    write_s, directory = timed(lambda: write_version_dir(root, model_path, weights))
    read_s, _ = timed(lambda: read_directory(directory))
    send_s, body = timed(send)
    parse_s, _ = timed(lambda: read(body))
    return {"directory_write": write_s, "directory_read": read_s, "request_send": send_s, "request_read": parse_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=model_argument, default=None, help="Default: the demo's bootstrap model.")
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
    steps, phases, encodes, applies, ratios, handing = [], [], [], [], [], []
    versions_dir = Path(tempfile.mkdtemp(prefix="learner-alone-"))
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
                handing.append(to_engine_s(new, model_path, versions_dir))
    finally:
        trainer.close()
        shutil.rmtree(versions_dir, ignore_errors=True)
    samples = [t for group in batches[0] for t in group]
    print(json.dumps({
        "config": {"model_path": str(model_path), "steps": args.steps, "groups_per_step": args.groups_per_step,
                   "group_size": args.group_size, "threads": args.threads, "share_prompts": not args.plain},
        "step_ms": round(1000 * statistics.median(steps), 1),
        "phases_ms": {name: round(1000 * statistics.median(p[name] for p in phases), 1) for name in phases[0]},
        "encode_ms": round(1000 * statistics.median(encodes), 2),
        "apply_ms": round(1000 * statistics.median(applies), 2),
        "delta_ratio": round(statistics.median(ratios), 3),
        "to_engine_ms": {way: round(1000 * statistics.median(h[way] for h in handing), 2) for way in handing[0]},
        "mean_prompt_tokens": round(statistics.mean(len(t.prompt_token_ids) for t in samples), 2),
        "mean_response_tokens": round(statistics.mean(len(t.response_token_ids) for t in samples), 2),
        "longest_response_tokens": max(len(t.response_token_ids) for t in samples),
    }, indent=2))


if __name__ == "__main__":
    main()
