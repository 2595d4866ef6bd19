"""The learner's trainer on a real (tiny, random) Qwen2 model on CPU: unsharded on one rank, FSDP2 over
two under torchrun (which must make the single-rank update)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from policyloop.contracts.v1 import bus_pb2
from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.rl.losses import PolicyLoss, loss_settings
from policyloop.rl.trainer import PolicyTrainer, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from policyloop.models.bootstrap import BootstrapConfig, make_model
    from policyloop.models.tokenizer import save_tokenizer

    directory = tmp_path_factory.mktemp("tiny-policy")
    torch.manual_seed(0)
    make_model(BootstrapConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                               intermediate_size=64)).save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def group(task: str, prompt: list[int], responses: list[list[int]], rewards: list[float],
          behaviour: list[list[float]]) -> list[bus_pb2.Trajectory]:
    return [
        bus_pb2.Trajectory(
            trajectory_id=f"{task}/{i}", task_id=task, group_id=task, sample_index=i, group_size=len(responses),
            prompt_token_ids=prompt, response_token_ids=r, behaviour_logprobs=b, loss_mask=[True] * len(r),
            reward=reward, scored=True, finish_reason=bus_pb2.FINISH_REASON_STOP,
            version_spans=[bus_pb2.VersionSpan(version=0, start=0, end=len(r))],
        )
        for i, (r, reward, b) in enumerate(zip(responses, rewards, behaviour, strict=True))
    ]


def test_grpo_steps_raise_the_rewarded_response_and_export_exact_weights(model_dir: Path) -> None:
    trainer = PolicyTrainer(model_dir, TrainerConfig(lr=3e-3), version=0)
    try:
        prompt, good, bad = [4, 5, 14, 6, 7, 16], [8, 1], [9, 1]

        def logprob_of(response: list[int]) -> float:
            batch = pack([prompt], [response])
            with torch.no_grad():
                lp = token_logprobs(trainer.model, batch)
            return float((lp * batch.response_mask).sum())

        before = logprob_of(good)
        for step in range(5):
            behaviour = [[logprob_of(good) / 2] * 2, [logprob_of(bad) / 2] * 2]  # on-policy enough
            report = trainer.step([group(f"t{step}", prompt, [good, bad], [1.0, 0.0], behaviour)] * 2)
            assert report.step == step + 1 and report.samples == 4 and report.trained_tokens == 8
        assert trainer.version == 5
        assert logprob_of(good) > before + 0.5
        payload = trainer.export_safetensors()
        tensors = safetensors.torch.load(payload)
        with safetensors.safe_open(str(model_dir / "model.safetensors"), framework="pt") as base:
            assert sorted(tensors) == sorted(base.keys())
        # The exported bytes are the trainer's weights: a fresh model loaded from them agrees.
        from transformers import AutoModelForCausalLM

        fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        fresh.load_state_dict(tensors, strict=False)
        batch = pack([prompt], [good])
        with torch.no_grad():
            assert torch.allclose(token_logprobs(fresh, batch), token_logprobs(trainer.model, batch), atol=1e-6)
    finally:
        trainer.close()


def test_one_rank_trains_the_model_unsharded(model_dir: Path) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    trainer = PolicyTrainer(model_dir, TrainerConfig(), version=0)
    try:
        assert trainer.world_size == 1
        assert not any(isinstance(m, FSDPModule) for m in trainer.model.modules())
        assert not any(isinstance(p, DTensor) for p in trainer.model.parameters())
        # What is exported and checkpointed is the same whatever the sharding: plain full tensors.
        assert all(type(t) is torch.Tensor for t in trainer.export_tensors().values())
    finally:
        trainer.close()


def test_groups_of_a_step_must_share_a_size(model_dir: Path) -> None:
    trainer = PolicyTrainer(model_dir, TrainerConfig(), version=0)
    try:
        one = group("a", [4, 14, 5, 16], [[8, 1]], [1.0], [[-1.0, -1.0]])
        two = group("b", [4, 14, 5, 16], [[8, 1], [9, 1]], [1.0, 0.0], [[-1.0, -1.0]] * 2)
        with pytest.raises(ValueError, match="same size"):
            trainer.step([one, two])
    finally:
        trainer.close()


@pytest.mark.parametrize("advantages", ["group", "gae"])
def test_two_ranks_under_torchrun_make_the_single_rank_update(model_dir: Path, tmp_path: Path,
                                                              advantages: str) -> None:
    import subprocess
    import sys

    from policyloop.cluster.local import free_port

    two_ranks = tmp_path / "two.safetensors"
    env_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               f"--master_port={free_port()}", "-m", "tests.distributed_steps", str(model_dir), str(two_ranks),
               advantages]
    result = subprocess.run(env_cmd, capture_output=True, text=True, timeout=240,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one_rank = tmp_path / "one.safetensors"
    single = subprocess.run([sys.executable, "-m", "tests.distributed_steps", str(model_dir), str(one_rank),
                             advantages], capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = safetensors.torch.load_file(str(two_ranks)), safetensors.torch.load_file(str(one_rank))
    base = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name
    assert any(not torch.equal(a[n], base[n]) for n in a)  # the steps did change the weights
    norms_two = [float(x) for x in two_ranks.with_suffix(".norms").read_text().split()]
    norms_one = [float(x) for x in one_rank.with_suffix(".norms").read_text().split()]
    assert norms_two == pytest.approx(norms_one, rel=1e-4)


def test_two_torchrun_nodes_make_the_single_rank_update(model_dir: Path, tmp_path: Path) -> None:
    """The learner across machines: two torchrun agents (two "nodes", one rank each) that find
    each other by c10d rendezvous on loopback, as pods do through a headless Service, train the
    same steps as one rank (gloo), to the same weights and gradient norms."""
    import os
    import subprocess
    import sys

    from policyloop.cluster.local import free_port

    two_nodes = tmp_path / "two-nodes.safetensors"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint={endpoint}", "--rdzv-id=policyloop-test", "-m", "tests.distributed_steps", str(model_dir),
         str(two_nodes)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    one_rank = tmp_path / "one.safetensors"
    single = subprocess.run([sys.executable, "-m", "tests.distributed_steps", str(model_dir), str(one_rank)],
                            capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = safetensors.torch.load_file(str(two_nodes)), safetensors.torch.load_file(str(one_rank))
    assert sorted(a) == sorted(b) and all(torch.allclose(a[name], b[name], atol=1e-5) for name in a)
    norms_two = [float(x) for x in two_nodes.with_suffix(".norms").read_text().split()]
    norms_one = [float(x) for x in one_rank.with_suffix(".norms").read_text().split()]
    assert norms_two == pytest.approx(norms_one, rel=1e-4)


@pytest.mark.parametrize("loss", [
    loss_settings(),                                                              # DAPO-style PPO-clip
    loss_settings(normalization="sequence", clip_high=0.28),                      # GRPO + clip-higher
    loss_settings(normalization="constant", advantages="group_no_std"),          # Dr.GRPO
    loss_settings(kind="gspo", advantages="leave_one_out"),
    loss_settings(kind="cispo", off_policy="tis", tis_cap=2.0),
    loss_settings(off_policy="decoupled", kl_coef=0.1, kl_estimator="k3"),
    loss_settings(advantages="gae", gamma=1.0, lam=0.95),                        # PPO with a critic
])
def test_every_loss_variant_trains_towards_the_rewarded_response(model_dir: Path, loss: PolicyLoss) -> None:
    trainer = PolicyTrainer(model_dir, TrainerConfig(lr=3e-3, loss=loss), version=0)
    try:
        prompt, good, bad = [4, 5, 14, 6, 7, 16], [8, 1], [9, 1]

        def token_logprobs_of(response: list[int]) -> list[float]:
            batch = pack([prompt], [response])
            with torch.no_grad():
                lp = token_logprobs(trainer.model, batch)
            return [float(v) for v in lp[batch.response_mask.bool()]]

        def logprob_of(response: list[int]) -> float:
            return sum(token_logprobs_of(response))

        before = logprob_of(good) - logprob_of(bad)
        # Off-policy variants get behaviour a little off the learner's policy (an older version).
        shift = 0.05 if loss.off_policy != "none" else 0.0
        for step in range(4):
            behaviour = [[v - shift for v in token_logprobs_of(good)], [v + shift for v in token_logprobs_of(bad)]]
            report = trainer.step([group(f"t{step}", prompt, [good, bad], [1.0, 0.0], behaviour)] * 2)
        assert logprob_of(good) - logprob_of(bad) > before
        assert report.statistics["entropy"] > 0 and report.trained_tokens == 8
        if loss.off_policy != "none":
            assert report.statistics["is_weight_mean"] != 1.0  # the correction is at work
        if loss.kl_coef:
            assert report.statistics["kl_reference"] > 0  # moved away from the base weights
        if loss.advantages == "gae":  # the critic learned the returns too: its values moved off 0
            assert report.statistics["values_mean"] != 0 and report.statistics["critic_grad_norm"] > 0
            assert sorted(report.token_values) == ["t3/0", "t3/1"] and len(report.token_values["t3/0"]) == 2
    finally:
        trainer.close()


def critic_tensors(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    assert trainer.critic is not None
    return {k: v.detach().clone() for k, v in trainer.critic.model.state_dict().items()}


@pytest.mark.parametrize("advantages", ["group", "gae"])
def test_a_checkpointed_trainer_resumes_exactly(model_dir: Path, tmp_path: Path, advantages: str) -> None:
    """Steps 1–2, checkpoint, step 3 — against a fresh trainer that loads the checkpoint and
    takes step 3: the same version, the same trained ids and bit-identical weights (the
    optimizer's moments and the LR schedule's position — mid-warmup here — came back too; with
    GAE, the critic and its optimizer as well: step 3's advantages are its values')."""
    from policyloop.rl.checkpoint import latest_checkpoint

    prompt, good, bad = [4, 5, 14, 6, 7, 16], [8, 1], [9, 1]
    batches = [[group(f"t{step}", prompt, [good, bad], [1.0, 0.0], [[-2.0, -2.0], [-2.5, -2.5]])] * 2
               for step in range(3)]
    config = TrainerConfig(lr=3e-3, warmup_steps=4, schedule="cosine", decay_steps=8,
                           loss=loss_settings(advantages=advantages), critic={"lr": 3e-3})
    first = PolicyTrainer(model_dir, config, version=0)
    try:
        for batch in batches[:2]:
            first.step(batch)
        saved = first.save(tmp_path / "ckpt", trained_ids=[["t0/0"], ["t1/0"]], extra={"ledger_seq": 7})
        draws = (torch.rand(3), random.random())  # what the RNGs give next after the checkpoint
        # A crash while writing the next checkpoint leaves this one the latest.
        (tmp_path / "ckpt" / ".version-000000003.tmp").mkdir()
        assert latest_checkpoint(tmp_path / "ckpt") == saved
        first.step(batches[2])
        expected = first.export_tensors()
        expected_critic = critic_tensors(first) if advantages == "gae" else {}
    finally:
        first.close()
    second = PolicyTrainer(model_dir, config, version=0)
    try:
        torch.manual_seed(123)
        random.seed(123)
        state = second.restore(saved)
        assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]  # RNGs came back
        assert state.trained_ids == [["t0/0"], ["t1/0"]] and state.extra == {"ledger_seq": 7}
        assert second.version == 2 and second.steps == 2 and second.scheduler.last_epoch == 2
        assert second.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 3 / 4)  # warmup step 3 of 4
        second.step(batches[2])
        assert second.version == 3
        resumed = second.export_tensors()
        assert all(torch.equal(expected[k].view(torch.uint8), resumed[k].view(torch.uint8)) for k in expected)
        if advantages == "gae":
            resumed_critic = critic_tensors(second)
            assert all(torch.equal(expected_critic[k], resumed_critic[k]) for k in expected_critic)
    finally:
        second.close()
    fresh = PolicyTrainer(model_dir, config, version=0)
    try:
        fresh.step(batches[2])  # without the checkpoint the same step gives other weights
        assert not all(torch.equal(expected[k], t) for k, t in fresh.export_tensors().items())
        if advantages == "gae":  # and another critic
            assert not all(torch.equal(expected_critic[k], t) for k, t in critic_tensors(fresh).items())
    finally:
        fresh.close()


def test_tool_tokens_of_a_multi_turn_episode_are_not_trained_on(model_dir: Path) -> None:
    """Tool tokens stay in the context of the model's later tokens but carry no loss: what their
    behaviour logprobs say changes nothing, and only the model's tokens are counted."""
    prompt = [22, 5, 14, 6, 16]  # <tools>1+2=
    call, shown, answer = [18, 5, 14, 6, 19], [20, 7, 21], [7, 1]  # <python>1+2</python> <output>3</output> 3 eos
    response = call + shown + answer
    mask = [True] * len(call) + [False] * len(shown) + [True] * len(answer)

    def episodes(tool_logprob: float, masked: bool) -> list[bus_pb2.Trajectory]:
        samples = group("t", prompt, [response, answer + [1]], [1.0, 0.0],
                        [[-1.0] * len(call) + [tool_logprob] * len(shown) + [-1.0] * len(answer), [-1.0] * 3])
        samples[0].ClearField("loss_mask")
        samples[0].loss_mask.extend(mask if masked else [True] * len(response))
        return samples

    def trained(tool_logprob: float, masked: bool = True) -> tuple[int, dict[str, torch.Tensor]]:
        trainer = PolicyTrainer(model_dir, TrainerConfig(lr=3e-3), version=0)
        try:
            report = trainer.step([episodes(tool_logprob, masked)] * 2)
            return report.trained_tokens, safetensors.torch.load(trainer.export_safetensors())
        finally:
            trainer.close()

    tokens, weights = trained(0.0)
    assert tokens == 2 * (len(call) + len(answer) + 3)
    _, other = trained(-30.0)
    assert all(torch.equal(weights[name], other[name]) for name in weights)
    # The same tokens trained on would have moved the weights differently.
    tokens_unmasked, unmasked = trained(-30.0, masked=False)
    assert tokens_unmasked == tokens + 2 * len(shown)
    assert any(not torch.equal(weights[name], unmasked[name]) for name in weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_trainer_on_cuda_trains_and_exports_cpu_tensors(model_dir: Path) -> None:
    """On a GPU the batch, behaviour logprobs, advantages and the KL reference follow the policy
    to its device; the exported weights come back on the CPU, as the publisher takes them."""
    trainer = PolicyTrainer(model_dir, TrainerConfig(lr=3e-3, device="cuda", loss=loss_settings(kl_coef=0.1)),
                            version=0)
    try:
        assert trainer.device.type == "cuda" and next(trainer.model.parameters()).device.type == "cuda"
        prompt, good, bad = [4, 5, 14, 6, 7, 16], [8, 1], [9, 1]

        def logprob_of(response: list[int]) -> float:
            batch = pack([prompt], [response]).to(trainer.device)
            with torch.no_grad():
                lp = token_logprobs(trainer.model, batch)
            return float((lp * batch.response_mask).sum())

        before = logprob_of(good) - logprob_of(bad)
        for step in range(4):
            behaviour = [[logprob_of(good) / 2] * 2, [logprob_of(bad) / 2] * 2]
            report = trainer.step([group(f"t{step}", prompt, [good, bad], [1.0, 0.0], behaviour)] * 2)
        assert logprob_of(good) - logprob_of(bad) > before and report.statistics["kl_reference"] > 0
        tensors = trainer.export_tensors()
        assert tensors and all(t.device.type == "cpu" for t in tensors.values())
    finally:
        trainer.close()
