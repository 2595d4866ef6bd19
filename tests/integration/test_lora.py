"""LoRA runs on one frozen base (policyloop.rl.lora) on a real tiny Qwen2 model: a step is the one
peft itself gives, two runs never touch each other's adapter or optimizer state, and the base
never changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from policyloop.rl.logprobs import pack, token_logprobs
from policyloop.rl.lora import AdapterTrainer, LoraSpec, UnknownRun
from policyloop.rl.losses import loss_settings
from policyloop.rl.trainer import LrSchedule, TrainerConfig, grpo_loss
from tests.integration.test_trainer import group

PROMPT, GOOD, BAD = [4, 5, 14, 6, 7, 16], [8, 1], [9, 1]


def batch_of(step: int, behaviour_shift: float = 0.0) -> list[list]:
    behaviour = [[-1.0 - behaviour_shift] * 2, [-1.2 + behaviour_shift] * 2]
    return [group(f"t{step}", PROMPT, [GOOD, BAD], [1.0, 0.0], behaviour)] * 2


def margin(model: torch.nn.Module) -> float:
    """log p(GOOD) - log p(BAD) after PROMPT."""
    values = []
    for response in (GOOD, BAD):
        batch = pack([PROMPT], [response])
        with torch.no_grad():
            values.append(float((token_logprobs(model, batch) * batch.response_mask).sum()))
    return values[0] - values[1]


def config(**loss: object) -> TrainerConfig:
    return TrainerConfig(lr=1e-2, weight_decay=0.01, device="cpu", loss=loss_settings(**loss))


def test_a_spec_is_checked_field_by_field(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValidationError, match="dropout"):
        LoraSpec(dropout=1.0)
    with pytest.raises(ValidationError, match="target_modules"):
        LoraSpec(target_modules=("q_proj", "q_proj"))
    with pytest.raises(ValidationError, match="target_modules"):
        LoraSpec(target_modules=("layers.0.q_proj",))
    trainer = AdapterTrainer(tiny_model_dir, config())
    with pytest.raises(ValueError, match="target_modules: the model has no linear modules named \\['qkv'\\]"):
        trainer.add_run("a", LoraSpec(target_modules=("q_proj", "qkv")))
    trainer.add_run("a", LoraSpec(rank=4))
    with pytest.raises(ValueError, match="has an adapter already"):
        trainer.add_run("a", LoraSpec(rank=4))
    with pytest.raises(UnknownRun):
        trainer.step("b", batch_of(0))


def test_a_lora_step_is_the_step_peft_gives(tiny_model_dir: Path) -> None:
    """Two steps of a run against the same two steps done by hand on a peft model built directly
    (same initial adapter, AdamW over its trainable parameters, clipping and schedule)."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    cfg = config()
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    trainer = AdapterTrainer(tiny_model_dir, cfg)
    trainer.add_run("a", spec)

    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                               spec.peft_config(), adapter_name="ref")
    set_peft_model_state_dict(reference, trainer.export_adapter("a"), adapter_name="ref")  # the same random A
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, LrSchedule(cfg))
    for step in range(2):
        report = trainer.step("a", batch_of(step))
        loss = grpo_loss(reference, batch_of(step), cfg.loss, pad_id=trainer.pad_id, device=torch.device("cpu"),
                         share_prompts=cfg.share_prompts)  # the same forward: Adam makes rounding visible
        loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        assert report.step == step + 1 and report.loss == pytest.approx(loss.statistics["loss"], abs=1e-7)

    ours, theirs = trainer.export_adapter("a"), get_peft_model_state_dict(reference, adapter_name="ref")
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-7)
    assert any(float(t.abs().sum()) > 0 for n, t in ours.items() if "lora_B" in n)  # it moved off the base
    assert trainer.run("a").version == 2


def test_two_runs_never_touch_each_others_adapter_or_optimizer_and_the_base_stays(tiny_model_dir: Path) -> None:
    trainer = AdapterTrainer(tiny_model_dir, config())
    base = list(trainer.base.parameters())  # before any adapter: the base weights alone
    base_before = [p.detach().clone() for p in base]
    trainer.add_run("a", LoraSpec(rank=4, target_modules=("q_proj", "v_proj")))
    trainer.add_run("b", LoraSpec(rank=8, alpha=16.0))
    b_before = {n: p.detach().clone() for n, p in trainer.adapter_parameters("b").items()}
    start = margin(trainer.model)

    for step in range(3):
        trainer.step("a", batch_of(step))
    a_after = {n: p.detach().clone() for n, p in trainer.adapter_parameters("a").items()}
    assert margin(trainer.model) > start  # a learned (its adapter is the active one)
    for name, tensor in trainer.adapter_parameters("b").items():
        assert torch.equal(tensor, b_before[name]), name
    assert not trainer.run("b").optimizer.state  # b's AdamW never stepped
    assert all(int(s["step"]) == 3 for s in trainer.run("a").optimizer.state.values())

    trainer.step("b", batch_of(0))
    for name, tensor in trainer.adapter_parameters("a").items():
        assert torch.equal(tensor, a_after[name]), name
    assert all(int(s["step"]) == 3 for s in trainer.run("a").optimizer.state.values())
    assert (trainer.run("a").version, trainer.run("b").version) == (3, 1)

    # No optimizer holds a base weight, and no step changed one.
    held = {id(p) for run in trainer.runs.values() for g in run.optimizer.param_groups for p in g["params"]}
    assert not held & {id(p) for p in base}
    assert all(torch.equal(p, before) for p, before in zip(base, base_before, strict=True))


def test_a_removed_run_frees_its_adapter_and_the_others_train_on(tiny_model_dir: Path) -> None:
    trainer = AdapterTrainer(tiny_model_dir, config())
    trainer.add_run("a", LoraSpec(rank=4))
    trainer.add_run("b", LoraSpec(rank=4))
    adapter_b = trainer.run("b").adapter
    trainer.remove_run("b")
    assert not [n for n, _ in trainer.model.named_parameters() if f".{adapter_b}." in n]
    with pytest.raises(UnknownRun):
        trainer.export_adapter("b")
    assert trainer.step("a", batch_of(0)).step == 1
    trainer.add_run("b", LoraSpec(rank=4))  # a new adapter under a new name, starting at the base
    assert trainer.run("b").adapter != adapter_b and trainer.run("b").version == 0


def test_the_kl_reference_of_a_run_is_the_base(tiny_model_dir: Path) -> None:
    trainer = AdapterTrainer(tiny_model_dir, config(kl_coef=0.1))
    trainer.add_run("a", LoraSpec(rank=4))
    first = trainer.step("a", batch_of(0))
    assert first.statistics["kl_reference"] == pytest.approx(0.0, abs=1e-9)  # B = 0: the run starts at the base
    for step in range(1, 4):
        report = trainer.step("a", batch_of(step))
    assert report.statistics["kl_reference"] > 0


def test_runs_resume_from_their_own_checkpoints_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    from policyloop.rl.lora import latest_run_checkpoint, run_directory

    first = AdapterTrainer(tiny_model_dir, config())
    first.add_run("team/a", LoraSpec(rank=4, target_modules=("q_proj", "v_proj")))
    first.add_run("b", LoraSpec(rank=8))
    for step in range(2):
        first.step("team/a", batch_of(step))
    first.step("b", batch_of(0))
    first.save(tmp_path, "team/a", trained_ids=[["t0/0"], ["t1/0"]], extra={"ledger_seq": 7})
    first.save(tmp_path, "b")
    first.step("team/a", batch_of(2))  # what the resumed trainer must reproduce

    second = AdapterTrainer(tiny_model_dir, config())
    assert latest_run_checkpoint(tmp_path, "c") is None
    state = second.restore(latest_run_checkpoint(tmp_path, "team/a"))
    assert (state.run_id, state.version, state.steps) == ("team/a", 2, 2)
    assert state.trained_ids == [["t0/0"], ["t1/0"]] and state.extra == {"ledger_seq": 7}
    second.restore(latest_run_checkpoint(tmp_path, "b"))
    assert second.run("b").version == 1
    for name, tensor in first.export_adapter("b").items():
        assert torch.equal(second.export_adapter("b")[name], tensor), name
    second.step("team/a", batch_of(2))
    for name, tensor in first.export_adapter("team/a").items():
        assert torch.equal(second.export_adapter("team/a")[name], tensor), name  # optimizer and schedule too

    # Each run keeps its own `keep` newest; a run id is a safe directory name.
    for _ in range(2):
        first.step("team/a", batch_of(3))
        first.save(tmp_path, "team/a", keep=2)
    assert [d.name for d in sorted((tmp_path / run_directory("team/a")).glob("version-*"))] == \
        ["version-000000004", "version-000000005"]
    assert "/" not in run_directory("team/a") and run_directory("team/a") != run_directory("team_a")

    third = AdapterTrainer(tiny_model_dir, config())
    third.add_run("b", LoraSpec(rank=4))
    with pytest.raises(ValueError, match="LoRA spec"):
        third.restore(latest_run_checkpoint(tmp_path, "b"))


def test_a_lora_run_trains_demonstrations_by_cross_entropy(tiny_model_dir: Path) -> None:
    from policyloop.contracts.v1 import loop_pb2
    from policyloop.gateway.feeding import demonstration

    trainer = AdapterTrainer(tiny_model_dir, config())
    trainer.add_run("a", LoraSpec(rank=4))
    demos = [[demonstration("a", "demos@v1", loop_pb2.TaskSpec(prompt_token_ids=PROMPT, demonstration_token_ids=GOOD),
                            i)] for i in range(2)]
    losses = [trainer.step("a", demos).loss for _ in range(5)]  # each step's loss: before its update
    assert losses[-1] < losses[0] - 0.5 and trainer.run("a").version == 5
