"""What only a GPU shows, in one short run: the learner's step, the embedded engine's generation
and a version's export → delta encode → apply on the device, with a realistically shaped model
(`--shape qwen2-0.5b`: Qwen2-0.5B's config, randomly initialised, float32 like the learner's
master weights) or a tiny one (`--shape tiny`: what CI smoke-tests on the CPU). Prints JSON:
the device, the shape, and median seconds of each part.

    .venv/bin/python perf/gpu_check.py                          # qwen2-0.5b on CUDA when present
    .venv/bin/python perf/gpu_check.py --shape tiny --device cpu

The parts:
- `learner_step_s`: one GRPO step (PolicyTrainer) of --groups groups of --group-size samples,
  --prompt-tokens + --response-tokens each, after a warm-up step;
- `engine_tokens_per_s`: --engine-requests concurrent greedy requests of --new-tokens through the
  embedded engine's HTTP API on the device (the SGLang client), and their wall time;
- `export_s`, `encode_s`, `apply_s`, `delta_bytes`: the trainer's weights gathered to the CPU,
  encoded as an exact XOR delta against the version before (the codec the publisher serves), and
  applied by a replica's decoder (hash-verified), then loaded into the engine
  (`update_weights_from_tensor`, `engine_load_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen2-0.5B's config (vocabulary, widths, depth, grouped-query attention, tied embeddings).
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def build_model(shape: str, directory: Path) -> int:
    """A random Qwen2 of the shape with the project's tokenizer files; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from policyloop.models.tokenizer import save_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                         architectures=["Qwen2ForCausalLM"])
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    save_tokenizer(directory)  # the ids are what is sent; the files make it a whole model directory
    return sum(p.numel() for p in model.parameters())


def groups(step: int, count: int, size: int, prompt_tokens: int, response_tokens: int, vocab: int) -> list[list]:
    from policyloop.contracts.v1 import bus_pb2

    rng = random.Random(step)
    out = []
    for g in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        out.append([bus_pb2.Trajectory(
            trajectory_id=f"s{step}g{g}/{i}", task_id=f"s{step}g{g}", group_id=f"s{step}g{g}", sample_index=i,
            group_size=size, prompt_token_ids=prompt,
            response_token_ids=[rng.randrange(3, vocab) for _ in range(response_tokens)],
            behaviour_logprobs=[-5.0] * response_tokens, loss_mask=[True] * response_tokens,
            reward=float(rng.random()), scored=True, finish_reason=bus_pb2.FINISH_REASON_STOP)
            for i in range(size)])
    return out


async def engine_figures(model_dir: Path, device: str, requests: int, new_tokens: int, prompt_tokens: int,
                         vocab: int, safetensors_bytes: bytes) -> dict[str, float]:
    from policyloop.engines.embedded import start_engine
    from policyloop.engines.protocol import GenerateRequest, SamplingParams
    from policyloop.engines.sglang_client import SGLangClient

    engine = await start_engine(model_dir, max_batch=requests, threads=1, device=device)
    rng = random.Random(1)
    try:
        async with SGLangClient(engine.base_url, timeout_s=600, retries=0) as client:
            def request(i: int) -> GenerateRequest:
                return GenerateRequest(input_ids=[rng.randrange(3, vocab) for _ in range(prompt_tokens)], rid=f"r{i}",
                                       sampling_params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                                                      ignore_eos=True))
            await asyncio.gather(*(client.generate(request(i)) for i in range(min(4, requests))))  # warm-up
            started = time.perf_counter()
            results = await asyncio.gather(*(client.generate(request(i)) for i in range(requests)))
            wall = time.perf_counter() - started
            tokens = sum(r.completion_tokens for r in results)
            started = time.perf_counter()
            await client.update_weights_from_tensor(safetensors_bytes, weight_version="1")
            load = time.perf_counter() - started
    finally:
        await engine.stop()
    return {"engine_generate_s": round(wall, 4), "engine_tokens": tokens,
            "engine_tokens_per_s": round(tokens / wall, 1), "engine_load_s": round(load, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps (after one warm-up)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--engine-requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    from policyloop.common.device import resolve_device
    from policyloop.rl.trainer import PolicyTrainer, TrainerConfig
    from policyloop.telemetry.logging import configure_logging
    from policyloop.weights.codec import apply, encode
    from policyloop.weights.torch_io import safetensors_bytes, weight_set

    configure_logging(service="perf", run_id="perf", instance="perf", level="WARNING")  # stdout is the JSON
    device = resolve_device(args.device)
    vocab = SHAPES[args.shape]["vocab_size"]
    with tempfile.TemporaryDirectory() as root:
        model_dir = Path(root) / "model"
        parameters = build_model(args.shape, model_dir)
        trainer = PolicyTrainer(model_dir, TrainerConfig(device=device, lr=1e-6))
        try:
            held = weight_set(0, trainer.export_tensors())  # a replica's copy of version 0
            trainer.step(groups(0, args.groups, args.group_size, args.prompt_tokens, args.response_tokens, vocab))
            steps = []
            for step in range(1, args.steps + 1):
                started = time.perf_counter()
                trainer.step(groups(step, args.groups, args.group_size, args.prompt_tokens, args.response_tokens,
                                    vocab))
                steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            exported = trainer.export_tensors()
            export_s = time.perf_counter() - started
        finally:
            trainer.close()
        started = time.perf_counter()
        target = weight_set(1, exported)
        encoded = encode(target, held)
        encode_s = time.perf_counter() - started
        started = time.perf_counter()
        applied = apply(held, encoded.payload)
        apply_s = time.perf_counter() - started
        if applied.manifest_hash != target.manifest_hash:
            raise SystemExit("the applied delta does not reproduce the trainer's weights")
        engine = asyncio.run(engine_figures(model_dir, device, args.engine_requests, args.new_tokens,
                                            args.prompt_tokens, vocab, safetensors_bytes(applied)))
    print(json.dumps({
        "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "shape": args.shape, "parameters": parameters,
        "learner": {"groups": args.groups, "group_size": args.group_size, "prompt_tokens": args.prompt_tokens,
                    "response_tokens": args.response_tokens, "step_s_median": round(statistics.median(steps), 4),
                    "step_s": [round(s, 4) for s in steps]},
        "weights": {"raw_bytes": target.raw_bytes, "delta_bytes": len(encoded.payload),
                    "export_s": round(export_s, 4), "encode_s": round(encode_s, 4), "apply_s": round(apply_s, 4),
                    "exact": True},
        "engine": {"requests": args.engine_requests, "new_tokens": args.new_tokens, **engine},
    }, indent=2))


if __name__ == "__main__":
    main()
