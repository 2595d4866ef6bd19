"""The one-process GRPO loop that perf/vs_single_process.py measures the cluster against: its
decoding is the model's (left padding changes nothing), its update is the learner's, and its
curve arithmetic is right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from policyloop.contracts.v1 import bus_pb2
from policyloop.models.tokenizer import EOS_ID, PAD_ID
from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.rl.settings import OptimizerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from single_process import (  # noqa: E402
    CurvePoint,
    SingleProcessConfig,
    SingleProcessGRPO,
    generate,
    load_weights,
    time_to_accuracy,
    train_for,
)

from policyloop.rl.trainer import PolicyTrainer, TrainerConfig


def test_greedy_decoding_of_a_left_padded_batch_is_each_prompt_decoded_alone(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[4, 5, 14, 6, 7, 16], [9, 14, 8, 16], [5, 5, 5, 14, 6, 6, 6, 16]]
    batched = generate(model, prompts, max_new_tokens=6, temperature=0.0, eos_id=EOS_ID, pad_id=PAD_ID)
    for prompt, tokens, stopped in zip(prompts, batched.tokens, batched.stopped, strict=True):
        alone: list[int] = []
        with torch.no_grad():
            while len(alone) < 6 and (not alone or alone[-1] != EOS_ID):
                logits = model(input_ids=torch.tensor([prompt + alone])).logits
                alone.append(int(logits[0, -1].argmax()))
        assert tokens == alone
        assert stopped == (alone[-1] == EOS_ID)


def test_sampling_follows_its_seeds(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[4, 5, 14, 6, 7, 16]] * 16

    def draw(seed: int) -> list[list[int]]:
        return generate(model, prompts, max_new_tokens=5, temperature=1.0, eos_id=EOS_ID, pad_id=PAD_ID,
                        seeds=[seed * 100 + i for i in range(len(prompts))]).tokens

    first = draw(1)
    assert draw(1) == first
    assert draw(2) != first
    assert len({tuple(t) for t in first}) > 1        # a group's samples differ
    for tokens in first:
        assert EOS_ID not in tokens[:-1] and 1 <= len(tokens) <= 5


async def test_a_seeded_sample_is_the_one_the_embedded_engine_draws(tiny_model_dir: Path) -> None:
    """The loop decodes as the engine does: the same seed gives the same tokens."""
    from transformers import AutoModelForCausalLM

    from policyloop.engines.embedded import start_engine
    from policyloop.engines.protocol import GenerateRequest, SamplingParams
    from policyloop.engines.sglang_client import SGLangClient

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[4, 5, 14, 6, 7, 16], [9, 14, 8, 16], [5, 5, 14, 6, 6, 16]]
    seeds = [11, 12, 13]
    ours = generate(model, prompts, max_new_tokens=6, temperature=1.0, eos_id=EOS_ID, pad_id=PAD_ID, seeds=seeds)
    engine = await start_engine(tiny_model_dir, max_batch=8, threads=1, weight_version="0")
    try:
        async with SGLangClient(engine.base_url, timeout_s=30) as client:
            answers = await client.generate_batch([GenerateRequest(
                input_ids=prompt, rid=f"r{i}", return_logprob=False,
                sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=seed,
                                               stop_token_ids=(EOS_ID,)))
                for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))])
    finally:
        await engine.stop()
    assert [a.output_ids for a in answers] == ours.tokens
    assert [a.finish_reason == "stop" for a in answers] == ours.stopped


@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_update_is_the_learners_step(tiny_model_dir: Path, share_prompts: bool) -> None:
    """On the same groups, one update of the single process moves the weights exactly as the
    learner's trainer does (same objective, optimizer, clipping; on-policy behaviour), with the
    same forward on both sides (Adam's first step turns float rounding into visible differences)."""
    loop = SingleProcessGRPO(SingleProcessConfig(model_path=tiny_model_dir, group_size=2, share_prompts=share_prompts,
                                                 optimizer=OptimizerSettings(lr=3e-3), threads=1))
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(lr=3e-3, share_prompts=share_prompts), version=0)
    try:
        prompts = [[4, 5, 14, 6, 7, 16]] * 2 + [[9, 14, 8, 16]] * 2
        responses = [[8, 1], [9, 10, 1], [12, 1], [13, 13]]
        rewards = [1.0, 0.1, 0.0, 1.1]
        batch = pack(prompts, responses)
        with torch.no_grad():
            behaviour = token_logprobs(loop.model, batch, share_prompts=share_prompts)
        groups = [[bus_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // 2}", sample_index=i % 2, group_size=2,
            prompt_token_ids=prompts[i], response_token_ids=responses[i], loss_mask=[True] * len(responses[i]),
            behaviour_logprobs=behaviour[i, len(prompts[i]) - 1: len(prompts[i]) - 1 + len(responses[i])].tolist(),
            reward=rewards[i], scored=True, finish_reason=bus_pb2.FINISH_REASON_STOP) for i in (g, g + 1)]
            for g in (0, 2)]
        loop.update(prompts, responses, rewards)
        trainer.step(groups)
        exported = trainer.export_tensors()
        mine = loop.model.state_dict()
        for name, tensor in exported.items():
            torch.testing.assert_close(mine[name], tensor, atol=2e-6, rtol=1e-5)
        base = safetensors.torch.load_file(str(tiny_model_dir / "model.safetensors"))
        assert any(not torch.equal(mine[name], tensor) for name, tensor in base.items())  # it did move
    finally:
        trainer.close()


def test_training_for_a_time_keeps_a_snapshot_at_each_mark(tiny_model_dir: Path) -> None:
    loop = SingleProcessGRPO(SingleProcessConfig(model_path=tiny_model_dir, groups_per_step=2, group_size=2,
                                                 threads=1))
    snapshots, elapsed = train_for(loop, 0.6, marks=[0.2, 0.4, 5.0])
    assert [s.seconds for s in snapshots] == [0.0, 0.2, 0.4]
    assert elapsed >= 0.6 and loop.steps >= 1
    assert snapshots[0].steps == 0 and snapshots[-1].steps <= loop.steps
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    load_weights(fresh, loop.snapshot())
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, loop.model.state_dict()[name])
    with pytest.raises(KeyError, match="no tensors named"):
        load_weights(fresh, {"not.a.weight": torch.zeros(1)})


def test_time_to_accuracy_interpolates_between_evaluations() -> None:
    curve = [CurvePoint(0, 0, 0.2), CurvePoint(60, 100, 0.5), CurvePoint(120, 200, 0.7), CurvePoint(180, 300, 0.8)]
    assert time_to_accuracy(curve, 0.6) == pytest.approx(90.0)
    assert time_to_accuracy(curve, 0.75) == pytest.approx(150.0)
    assert time_to_accuracy(curve, 0.2) == 0.0
    assert time_to_accuracy(curve, 0.9) is None
    assert time_to_accuracy(list(reversed(curve)), 0.6) == pytest.approx(90.0)
