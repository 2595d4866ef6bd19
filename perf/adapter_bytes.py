"""Bytes per version: a LoRA run's adapter against the full model, as the publisher gets them.

The same batches train the full model (the learner's PolicyTrainer, fp32 weights, AdamW) and a
LoRA adapter over the same base (rl.lora.AdapterTrainer); after every step each side's version is
encoded as the learner pushes it (policyloop.weights.codec: an exact XOR delta from the previous
version, the first a keyframe). Reported per side: raw bytes of a version, the keyframe's bytes,
the median delta's bytes and encode seconds, and the full/adapter ratio of the deltas.

    .venv/bin/python perf/adapter_bytes.py                   # a ~75M-parameter Qwen2, rank 16
    .venv/bin/python perf/adapter_bytes.py --size demo --steps 5

Prints JSON; writes it and adapter_bytes.png to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from policyloop.contracts.v1 import bus_pb2  # noqa: E402
from policyloop.models.bootstrap import BootstrapConfig, bootstrap, make_model  # noqa: E402
from policyloop.models.resolve import model_argument  # noqa: E402
from policyloop.models.tokenizer import save_tokenizer  # noqa: E402
from policyloop.rl.lora import DEFAULT_TARGET_MODULES, AdapterTrainer, LoraSpec  # noqa: E402
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig  # noqa: E402
from policyloop.weights import codec  # noqa: E402
from policyloop.weights.torch_io import weight_set  # noqa: E402

# A Qwen2 of about 75M parameters with the bootstrap tokenizer (its embeddings are small).
SIZES = {"demo": None,
         "75m": BootstrapConfig(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                                max_position_embeddings=128)}


def model_directory(size: str, root: Path) -> Path:
    config = SIZES[size]
    if config is None:
        return bootstrap()
    directory = root / f"model-{size}"
    torch.manual_seed(0)
    make_model(config).save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def batches(steps: int, groups: int, group_size: int, vocab: int, seed: int) -> list[list[list[bus_pb2.Trajectory]]]:
    """Random prompts and responses with random rewards: what the weights see, not what they learn."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        step_groups = []
        for g in range(groups):
            prompt = [rng.randrange(3, vocab) for _ in range(8)]
            members = []
            for i in range(group_size):
                response = [rng.randrange(3, vocab) for _ in range(8)]
                members.append(bus_pb2.Trajectory(
                    trajectory_id=f"s{step}g{g}/{i}", task_id=f"s{step}g{g}", group_id=f"s{step}g{g}",
                    sample_index=i, group_size=group_size, prompt_token_ids=prompt, response_token_ids=response,
                    behaviour_logprobs=[-2.0] * len(response), loss_mask=[True] * len(response),
                    reward=rng.random(), scored=True, finish_reason=bus_pb2.FINISH_REASON_LENGTH,
                    version_spans=[bus_pb2.VersionSpan(version=step, start=0, end=len(response))]))
            step_groups.append(members)
        out.append(step_groups)
    return out


def versions(step, export, steps: list) -> dict:  # type: ignore[no-untyped-def]
    """Steps one side through `steps` and encodes each version as the learner pushes it."""
    previous, deltas, encode_s, keyframe, raw = None, [], [], 0, 0
    for number, groups in enumerate(steps, start=1):
        step(groups)
        weights = weight_set(number, export())
        started = time.perf_counter()
        encoded = codec.encode(weights, previous)
        seconds = time.perf_counter() - started
        raw = weights.raw_bytes
        if previous is None:
            keyframe = encoded.stats.payload_bytes
        else:
            deltas.append(encoded.stats.payload_bytes)
            encode_s.append(seconds)
        previous = weights
    return {"raw_bytes": raw, "keyframe_bytes": keyframe,
            "delta_bytes_median": int(statistics.median(deltas)) if deltas else None,
            "delta_bytes": deltas, "encode_s_median": round(statistics.median(encode_s), 4) if encode_s else None}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["raw version", "keyframe", "delta (median)"]
    keys = ["raw_bytes", "keyframe_bytes", "delta_bytes_median"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, side in enumerate(("full", "adapter")):
        values = [(result[side][k] or 0) / 1e6 for k in keys]
        ax.bar([x + (i - 0.5) * width for x in range(3)], values, width, label=side)
    ax.set_xticks(range(3), labels)
    ax.set_yscale("log")
    ax.set_ylabel("MB per version")
    ax.set_title(f"{result['config']['params'] / 1e6:.1f}M-parameter model, LoRA rank {result['config']['rank']}: "
                 f"delta {result['full_over_adapter_delta']}x smaller", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="75m")
    parser.add_argument("--model-path", type=model_argument, default=None, help="a model directory instead of --size")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5, help="both sides' AdamW learning rate")
    parser.add_argument("--out", type=Path, default=Path("perf/out/adapter_bytes"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_path or model_directory(args.size, Path(tmp))
        config = TrainerConfig(lr=args.lr, device="cpu", threads=torch.get_num_threads())
        full = PolicyTrainer(model_dir, config)
        params = sum(p.numel() for p in full.model.parameters())
        vocab = int(full.model.config.vocab_size)
        steps = batches(args.steps, args.groups, args.group_size, vocab, seed=0)
        try:
            full_figures = versions(full.step, full.export_tensors, steps)
        finally:
            full.close()
        lora = AdapterTrainer(model_dir, config)
        spec = LoraSpec(rank=args.rank, alpha=args.alpha, target_modules=DEFAULT_TARGET_MODULES)
        lora.add_run("bench", spec)
        adapter_figures = versions(lambda groups: lora.step("bench", groups), lambda: lora.export_adapter("bench"),
                                   steps)
    full_delta, adapter_delta = full_figures["delta_bytes_median"], adapter_figures["delta_bytes_median"]
    result = {
        "config": {"size": args.size if args.model_path is None else str(args.model_path), "params": params,
                   "rank": args.rank, "alpha": args.alpha, "target_modules": list(spec.target_modules),
                   "steps": args.steps, "lr": args.lr, "samples_per_step": args.groups * args.group_size},
        "full": full_figures, "adapter": adapter_figures,
        "adapter_params": adapter_figures["raw_bytes"] // 4,
        "full_over_adapter_raw": round(full_figures["raw_bytes"] / adapter_figures["raw_bytes"], 1),
        "full_over_adapter_delta": round(full_delta / adapter_delta, 1) if full_delta and adapter_delta else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapter_bytes.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "adapter_bytes.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
