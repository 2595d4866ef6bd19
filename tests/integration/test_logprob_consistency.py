"""The engine's behaviour logprobs and the learner's recomputed logprobs agree for the same
weights and tokens (fp32): the condition for importance ratios of 1 on-policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from policyloop.engines.embedded import EmbeddedEngine
from policyloop.engines.protocol import GenerateRequest, SamplingParams
from policyloop.engines.sglang_client import SGLangClient
from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig


async def test_engine_and_learner_logprobs_agree(tiny_model_dir: Path) -> None:
    prompts = [[4 + (i % 10), 5, 14, 6 + (i % 7), 16][: 2 + i % 4] for i in range(12)]
    async with EmbeddedEngine(tiny_model_dir, port=0, max_batch=16) as engine:
        async with SGLangClient(engine.base_url) as client:
            results = await asyncio.gather(*(
                client.generate(GenerateRequest(
                    input_ids=p, return_logprob=True,
                    sampling_params=SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=100 + i),
                ))
                for i, p in enumerate(prompts)
            ))
    responses = [r.output_ids for r in results]
    assert sum(len(r) for r in responses) > 50
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(), version=0)  # FSDP2-wrapped, as in the learner
    try:
        batch = pack(prompts, responses)
        with torch.no_grad():
            learner = token_logprobs(trainer.model, batch)
    finally:
        trainer.close()
    diffs = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        start = len(prompt) - 1
        recomputed = learner[i, start : start + len(result.output_ids)]
        diffs.append((recomputed - torch.tensor(result.output_logprobs)).abs())
    all_diffs = torch.cat(diffs)
    assert float(all_diffs.mean()) < 1e-3, float(all_diffs.mean())
    assert float(all_diffs.max()) < 1e-2
