"""The bootstrap reward model (built before the tests, never here): a standard Hugging Face
sequence classifier with the character tokenizer that ranks right answers of held-out problems
above wrong ones, records how well it does, and is what `policyloop bootstrap --reward-model` finds."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.envs.arithmetic import Problem, heldout_problems, is_heldout, score
from policyloop.models.bootstrap import BootstrapConfig, bootstrap_dir, read_record
from policyloop.models.reward_model import (
    MALFORMED,
    REJECTED_KINDS,
    REWARD_MODEL_BOOTSTRAP,
    rejected_completion,
    reward_model_text,
    training_pairs,
)
from policyloop.models.tokenizer import PAD_ID, load_tokenizer
from tests.conftest import prebuilt_model

CONFIG = REWARD_MODEL_BOOTSTRAP
# Kinds that need no arithmetic beyond the answer's size and format: the model gets them all but right.
PLAIN_KINDS = ("off_by_hundred", "digit_dropped", "digit_added", MALFORMED)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def reward_dir(request: pytest.FixtureRequest) -> Path:
    return prebuilt_model(request.config, "reward_model")


def _scores(directory: Path, texts: list[str]) -> list[float]:
    """Scores through the standard loaders only (as a server would load the directory)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory)
    tokenizer = load_tokenizer(directory)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**batch).logits[:, 0].tolist()


def test_text_is_the_prompt_then_the_completion() -> None:
    assert reward_model_text("12+34=", "46") == "12+34=46"
    assert reward_model_text("12+34=", "") == "12+34="


def test_loads_as_a_one_score_classifier_with_the_character_tokenizer(reward_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    assert model.config.architectures == ["Qwen2ForSequenceClassification"]
    assert model.config.num_labels == 1 and model.config.pad_token_id == PAD_ID
    assert str(model.dtype) == "torch.float32"
    tokenizer = load_tokenizer(reward_dir)
    assert tokenizer.padding_side == "right"  # the classifier pools the last non-pad token
    assert len(tokenizer("12+34=46").input_ids) == 8  # one id a character, no BOS or eos
    assert tokenizer.unk_token_id in tokenizer("12+34=4x").input_ids


def test_padding_does_not_change_a_score(reward_dir: Path) -> None:
    texts = ["12+34=46", "12+34=1046", "12+34="]
    batched = _scores(reward_dir, texts)
    alone = [_scores(reward_dir, [text])[0] for text in texts]
    assert batched == pytest.approx(alone, abs=1e-4)


def test_right_answers_outrank_wrong_ones_on_fresh_heldout_problems(reward_dir: Path) -> None:
    """Problems and wrong answers the build never drew (another seed); the build measured 0.88
    pairwise, 0.84 balanced classification, >= 0.998 on the plain kinds."""
    problems = heldout_problems(CONFIG.task, 200, seed=12345)
    rng = random.Random(12345)
    rejected = [(problem, kind, rejected_completion(problem, kind, CONFIG.task, rng))
                for problem in problems for kind in REJECTED_KINDS]
    chosen_scores = dict(zip(problems, _scores(reward_dir, [reward_model_text(p.prompt, p.answer) for p in problems]),
                             strict=True))
    rejected_scores = _scores(reward_dir, [reward_model_text(p.prompt, text) for p, _, text in rejected])
    wins = {kind: [] for kind in REJECTED_KINDS}
    for (problem, kind, _), value in zip(rejected, rejected_scores, strict=True):
        wins[kind].append(chosen_scores[problem] > value)
    pairwise = sum(sum(w) for w in wins.values()) / len(rejected)
    assert pairwise >= 0.8, {kind: sum(w) / len(w) for kind, w in wins.items()}
    for kind in PLAIN_KINDS:
        assert sum(wins[kind]) / len(wins[kind]) >= 0.95, kind
    # sigmoid(score) > 0.5, that is score > 0, reads as "correct"
    accepted = sum(s > 0 for s in chosen_scores.values()) / len(problems)
    refused = sum(s < 0 for s in rejected_scores) / len(rejected)
    assert (accepted + refused) / 2 >= 0.75, (accepted, refused)


def test_rejected_completions_are_wrong_and_training_stays_off_the_heldout_split() -> None:
    rng = random.Random(0)
    for problem in [Problem(a, "+", b) for a in (10, 55, 99) for b in (10, 47, 99)]:
        for kind in REJECTED_KINDS:
            for _ in range(20):
                text = rejected_completion(problem, kind, CONFIG.task, rng)
                assert score(text, True, problem.answer).reward < 1, (problem, kind, text)
    assert CONFIG.task == BootstrapConfig().task  # one split: held out from the policy is held out here
    pairs = [pair for step in range(20) for pair in training_pairs(CONFIG, step, {})]
    assert len(pairs) == 20 * CONFIG.batch_size * CONFIG.rejected_per_problem
    assert not any(is_heldout(pair.problem, CONFIG.heldout_fraction) for pair in pairs)
    assert training_pairs(CONFIG, 7, {}) == training_pairs(CONFIG, 7, {})  # batches depend on the step only


def test_record_states_the_heldout_figures(reward_dir: Path) -> None:
    record = read_record(reward_dir)
    assert record["config"] == CONFIG.model_dump(mode="json") and record["config_hash"] == CONFIG.digest()
    assert record["steps"] == CONFIG.max_steps and record["final_loss"] > 0
    assert record["heldout_problems"] == CONFIG.eval_problems
    assert set(record["pairwise_accuracy_by_kind"]) == set(REJECTED_KINDS)
    assert 0.8 <= record["pairwise_accuracy"] <= 1 and 0.75 <= record["classification_accuracy"] <= 1
    policy = record["policy_samples"]
    assert policy["samples"] == CONFIG.policy_eval_problems * CONFIG.policy_eval_samples
    assert 0 <= policy["auc"] <= 1 and record["policy_pool"] > 0


def test_cli_finds_it_cached(reward_dir: Path) -> None:
    assert reward_dir == bootstrap_dir(CONFIG, reward_dir.parent)
    result = subprocess.run([sys.executable, "-m", "policyloop", "bootstrap", "--reward-model",
                             "--out", str(reward_dir.parent)],
                            capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    record = read_record(reward_dir)
    assert printed["path"] == str(reward_dir.resolve()) and printed["cached"] is True
    assert printed["pairwise_accuracy"] == record["pairwise_accuracy"]
    assert printed["policy_auc"] == record["policy_samples"]["auc"]
    assert printed["steps"] == CONFIG.max_steps


def test_cli_refuses_two_models() -> None:
    result = subprocess.run([sys.executable, "-m", "policyloop", "bootstrap", "--reward-model", "--chat"],
                            capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert result.returncode == 2
    assert "give one" in result.stdout + result.stderr
