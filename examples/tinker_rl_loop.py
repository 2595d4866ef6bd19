"""GRPO on two-digit addition, written with the official Tinker SDK (`pip install tinker`).

Point it at a policyloop cluster with TINKER_BASE_URL and TINKER_API_KEY; it imports nothing
of policyloop. Each step: save the weights for a sampler, sample a group per prompt, score,
centre the rewards within each group, importance-sampling forward_backward, Adam step."""

from __future__ import annotations

import argparse
import random
import time

import tinker
import xxhash
from tinker import types


def heldout(prompt: str) -> bool:  # the arithmetic environment's held-out split: 20% of problems by hash
    return xxhash.xxh64_intdigest(prompt.encode()) / 2**64 < 0.2


def problems(count: int, want_heldout: bool, seed: int) -> list[tuple[str, str]]:
    rng, chosen = random.Random(seed), {}
    while len(chosen) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if heldout(f"{a}+{b}=") == want_heldout:
            chosen[f"{a}+{b}="] = str(a + b)
    return list(chosen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", required=True, help="a model get_server_capabilities lists")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--eval-problems", type=int, default=200)
    args = parser.parse_args()

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
    tokenizer = training.get_tokenizer()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    heldout_set = problems(args.eval_problems, True, seed=1)

    def accuracy(sampler: tinker.SamplingClient) -> float:
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        futures = [sampler.sample(types.ModelInput.from_ints(encode(p)), 1, greedy) for p, _ in heldout_set]
        right = 0
        for future, (_, answer) in zip(futures, heldout_set, strict=True):
            seq = future.result().sequences[0]
            right += seq.stop_reason == "stop" and tokenizer.decode(seq.tokens, skip_special_tokens=True) == answer
        return right / len(heldout_set)

    before = accuracy(training.save_weights_and_get_sampling_client().result())
    print(f"held-out accuracy before: {before:.1%}", flush=True)
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    started = time.monotonic()
    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        batch = problems(args.groups, False, seed=1000 + step)
        prompts = [encode(p) for p, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(ids), args.group_size, params) for ids in prompts]
        data, rewards = [], []
        for future, ids, (_, answer) in zip(futures, prompts, batch, strict=True):
            group = future.result().sequences
            scores = [float(s.stop_reason == "stop" and tokenizer.decode(s.tokens, skip_special_tokens=True) == answer)
                      for s in group]
            mean = sum(scores) / len(scores)
            rewards += scores
            for seq, score in zip(group, scores, strict=True):
                if score == mean:
                    continue  # no signal in this sample
                n = len(ids) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(ids + seq.tokens[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:] + seq.tokens,
                                    "logprobs": [0.0] * n + list(seq.logprobs),
                                    "advantages": [0.0] * n + [score - mean] * len(seq.tokens)}))
        if data:
            training.forward_backward(data, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        print(f"step {step + 1}: mean reward {sum(rewards) / len(rewards):.3f} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    after = accuracy(training.save_weights_and_get_sampling_client().result())
    print(f"held-out accuracy after {args.steps} steps: {after:.1%} (before: {before:.1%})", flush=True)


if __name__ == "__main__":
    main()
