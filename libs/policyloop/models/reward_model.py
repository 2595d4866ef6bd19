"""The bootstrap reward model: a small Qwen2 sequence classifier that scores an arithmetic answer.

`REWARD_MODEL_BOOTSTRAP` builds a `Qwen2ForSequenceClassification` (one label, float32, the
character tokenizer of models/tokenizer.py) that reads `reward_model_text(prompt, completion)`,
exactly the prompt followed by the completion ("12+34=" + "46" -> "12+34=46", no BOS, no eos),
and gives one score from the last non-pad token: high when the completion is the right answer in
the verifier's strict format, low otherwise. `sigmoid(score)` reads as the probability that the
completion is correct, so 0 is a meaningful threshold.

Training pairs come from the TRAIN split of the same task (and so the same split) as the
arithmetic bootstrap policy: chosen is the right answer, rejected a wrong or malformed
completion of the kinds in `REJECTED_KINDS` (near misses, digit slips, random numbers, broken
formats) and, for a share of the pairs, one of the policy's own wrong samples at temperature 1,
which puts the model on the distribution it will score in RL. The loss is Bradley-Terry
(-logsigmoid(s_chosen - s_rejected)) plus a pointwise BCE (chosen 1, rejected 0) that anchors
the scale. The transformer starts from the policy's weights, which already read the problem and
mostly get the leading digit of the sum right (in a 600-step trial: 0.86 held-out pairwise
accuracy, against 0.76 from scratch); the score head starts at zero.

What it learns in its budget (600 steps, about a minute on 2 cores), on held-out problems: the
format and the size of the answer (malformed, a digit dropped or added, off by 100: pairwise
accuracy >= 0.998), swapped digits and random numbers (~0.95), the tens digit in part (off by
10: ~0.79), the units digit not at all (off by 1: ~0.5). The units digit is modular arithmetic,
which a transformer this small picks up slowly (after 1000 steps still at chance), and the
policy itself gets it right in only ~14% of its samples; so on the policy's samples, whose
mistakes are mostly there, the score separates right from wrong only weakly (AUC ~0.58), less
than the policy's own log-likelihood does (~0.70).

So the build needs the arithmetic policy: it is found in, or built into, the same cache root as
the reward model (bootstrap.bootstrap, cached). bootstrap.json records what the model gets right
on HELD-OUT problems: pairwise and classification accuracy per rejected kind, and how well the
score separates the policy's right and wrong samples (AUC).

Padding: the classifier pools the rightmost non-pad token, and positions are counted from the
first token, so batches are padded on the right (the saved tokenizer says so); a single text
needs no padding at all.

Everything else is bootstrap.py's: the cache directory `<cache_root>/<name>-<config hash>/`, the
staging directory renamed into place, bootstrap.json written last, the seeds, the threads.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from pydantic import Field, model_validator

from policyloop.envs.arithmetic import ArithmeticConfig, Problem, format_ok, heldout_problems, train_problems
from policyloop.models.bootstrap import (
    NAME_PATTERN,
    BootstrapConfig,
    BootstrapError,
    BootstrapRecipe,
    bootstrap,
    generate,
    seeded_generator,
    step_seed,
    train_and_save,
)
from policyloop.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB, build_tokenizer, save_tokenizer
from policyloop.scorers.reward_model import reward_model_text  # what the scorer sends, trained on

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

log = logging.getLogger(__name__)

# Part of the cache key: bump it when a code change (the pairs, the loss) makes old cached reward models wrong.
REWARD_BUILD_FORMAT = 1

OFF_BY_ONE, OFF_BY_TEN, OFF_BY_HUNDRED = "off_by_one", "off_by_ten", "off_by_hundred"
DIGIT_CHANGED, DIGIT_DROPPED, DIGIT_ADDED = "digit_changed", "digit_dropped", "digit_added"
DIGITS_SWAPPED = "digits_swapped"
RANDOM_NUMBER, MALFORMED, POLICY_SAMPLE = "random_number", "malformed", "policy_sample"
REJECTED_KINDS: tuple[str, ...] = (OFF_BY_ONE, OFF_BY_TEN, OFF_BY_HUNDRED, DIGIT_CHANGED, DIGIT_DROPPED, DIGIT_ADDED,
                                   DIGITS_SWAPPED, RANDOM_NUMBER, MALFORMED)
# Characters outside the vocabulary (they tokenize to <unk>) and inside it but not digits.
FOREIGN_CHARACTERS = "xa?.,"
STRAY_CHARACTERS = "+-= "
# How often each kind is drawn for training: the near misses, which need the sum worked out, most.
KIND_WEIGHTS: tuple[float, ...] = (3, 2, 1, 3, 1, 1, 2, 2, 1)


class RewardModelConfig(BootstrapRecipe):
    """Everything that determines the bootstrap reward model; its hash names the cache directory.

    Of the recipe's fields, the accuracy window means something else here: there is no window
    (the build runs `max_steps`), `target_accuracy` is the held-out pairwise accuracy below which
    the build fails rather than leave a reward model that cannot tell right from wrong, and
    `max_accuracy` and `max_new_tokens` play no part (the policy's own limit bounds its samples).
    The shape must be the policy's when the transformer starts from it."""

    build_format: ClassVar[int] = REWARD_BUILD_FORMAT

    name: str = Field("arith-qwen2-reward", pattern=NAME_PATTERN, description="Prefix of the cache directory name.")
    seed: int = Field(0, description="Seeds the training pairs, the policy's samples and the evaluation problems.")

    digits: int = Field(2, ge=1, description="Operand digits of the arithmetic task (the policy's).")
    ops: tuple[str, ...] = Field(("+",), description='Operators of the task, a subset of ("+", "-") (the policy\'s).')
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of problems held out from training: the "
                                    "policy's, so its held-out problems are held out for both.")

    batch_size: int = Field(32, ge=1, description="Train problems per training step.")
    rejected_per_problem: int = Field(3, ge=1, description="Rejected completions per problem, each paired with "
                                      "its right answer (scored once).")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW peak learning rate (after linear warm-up).")
    warmup_steps: int = Field(20, ge=0, description="Linear learning-rate warm-up steps.")
    max_steps: int = Field(600, ge=1, description="Training steps; the build runs them all.")
    eval_every: int = Field(100, ge=1, description="Steps between entries of the training-loss history.")
    eval_problems: int = Field(512, ge=1, description="Held-out problems of the pairwise and classification "
                               "measures in bootstrap.json (one rejected completion of each kind per problem).")
    target_accuracy: float = Field(0.75, ge=0, le=1, description="The build fails when held-out pairwise accuracy "
                                   "(all kinds) ends below this.")
    bce_weight: float = Field(1.0, ge=0, description="Weight of the pointwise BCE term beside the pairwise loss.")
    policy: BootstrapConfig = Field(default_factory=BootstrapConfig, description="The policy whose weights start "
                                    "the transformer, whose wrong samples are rejected completions and whose "
                                    "samples the AUC is measured on.")
    init_from_policy: bool = Field(True, description="Start the transformer from the policy's weights (else from "
                                   "scratch): it already reads the digits.")
    policy_fraction: float = Field(0.25, ge=0, lt=1, description="Share of a step's problems drawn from the policy's "
                                   "pool instead, one of their rejected completions the policy's wrong sample at "
                                   "temperature 1.")
    policy_pool_problems: int = Field(2048, ge=1, description="Train problems the policy samples once for that "
                                      "pool (its wrong samples are the pool).")
    policy_eval_problems: int = Field(256, ge=0, description="Held-out problems the policy samples at temperature 1 "
                                      "for the AUC in bootstrap.json (0: not measured).")
    policy_eval_samples: int = Field(8, ge=1, description="Samples per problem of that measure (a GRPO group).")

    @property
    def task(self) -> ArithmeticConfig:
        return ArithmeticConfig(digits=self.digits, ops=self.ops, heldout_fraction=self.heldout_fraction)

    @property
    def uses_policy(self) -> bool:
        return self.init_from_policy or self.policy_fraction > 0 or self.policy_eval_problems > 0

    @model_validator(mode="after")
    def _fits_the_policy(self) -> RewardModelConfig:
        if self.uses_policy and self.policy.task != self.task:
            raise ValueError(f"the reward model's task {self.task} must be its policy's {self.policy.task}")
        shape = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_position_embeddings")
        if self.init_from_policy and any(getattr(self, f) != getattr(self.policy, f) for f in shape):
            raise ValueError(f"init_from_policy: the shape ({', '.join(shape)}) must be the policy's")
        return self

    def build(self, directory: Path) -> dict[str, Any]:
        return build(self, directory)


REWARD_MODEL_BOOTSTRAP = RewardModelConfig()


PolicyPool = dict[Problem, list[str]]
"""The policy's wrong completions of train problems, by problem."""


@dataclass(frozen=True)
class Pair:
    problem: Problem
    rejected: str
    kind: str

    @property
    def chosen_text(self) -> str:
        return reward_model_text(self.problem.prompt, self.problem.answer)

    @property
    def rejected_text(self) -> str:
        return reward_model_text(self.problem.prompt, self.rejected)


# -- rejected completions -----------------------------------------------------------------------


def answer_range(task: ArithmeticConfig) -> tuple[int, int]:
    """The smallest and largest answer of the task's problems."""
    low, high = task.operand_range[0], task.operand_range[-1]
    results = [x for op in task.ops for x in ((2 * low, 2 * high) if op == "+" else (low - high, high - low))]
    return min(results), max(results)


def _split_sign(answer: str) -> tuple[str, str]:
    return ("-", answer[1:]) if answer.startswith("-") else ("", answer)


def _off_by(answer: str, steps: int, rng: random.Random) -> str:
    return str(int(answer) + rng.choice((-1, 1)) * steps)


def _digit_changed(answer: str, rng: random.Random) -> str:
    sign, digits = _split_sign(answer)
    i = rng.randrange(len(digits))
    new = rng.choice([d for d in "0123456789" if d != digits[i]])
    return sign + digits[:i] + new + digits[i + 1:]


def _digit_dropped(answer: str, rng: random.Random) -> str:
    sign, digits = _split_sign(answer)
    i = rng.randrange(len(digits))
    return sign + digits[:i] + digits[i + 1:]


def _digit_added(answer: str, rng: random.Random) -> str:
    sign, digits = _split_sign(answer)
    i = rng.randrange(len(digits) + 1)
    return sign + digits[:i] + rng.choice("0123456789") + digits[i:]


def _digits_swapped(answer: str, rng: random.Random) -> str:
    """Two different digits trade places; an answer without two different digits gets one changed."""
    sign, digits = _split_sign(answer)
    places = [(i, j) for i in range(len(digits)) for j in range(i + 1, len(digits)) if digits[i] != digits[j]]
    if not places:
        return _digit_changed(answer, rng)
    i, j = rng.choice(places)
    swapped = list(digits)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    return sign + "".join(swapped)


def _random_number(answer: str, task: ArithmeticConfig, rng: random.Random) -> str:
    low, high = answer_range(task)
    while (number := str(rng.randint(low, high))) == answer:
        pass
    return number


def _malformed(answer: str, rng: random.Random) -> str:
    """The right number (or a piece of it) in a form the verifier refuses."""
    i = rng.randrange(len(answer) + 1)
    forms: list[Callable[[], str]] = [
        lambda: "",
        lambda: answer + rng.choice(STRAY_CHARACTERS),
        lambda: rng.choice(STRAY_CHARACTERS) + answer,
        lambda: answer[:i] + rng.choice(FOREIGN_CHARACTERS) + answer[i:],
        lambda: answer[:max(i, 1) - 1] + rng.choice(FOREIGN_CHARACTERS) + answer[max(i, 1):],
        lambda: "0" + answer,
        lambda: answer + answer,
        lambda: answer + rng.choice("+-") + str(rng.randrange(10)),
    ]
    return rng.choice(forms)()


def rejected_completion(problem: Problem, kind: str, task: ArithmeticConfig, rng: random.Random) -> str:
    """A completion of `kind` for `problem` that the verifier scores as not correct."""
    answer = problem.answer
    makers: dict[str, Callable[[], str]] = {
        OFF_BY_ONE: lambda: _off_by(answer, 1, rng),
        OFF_BY_TEN: lambda: _off_by(answer, 10, rng),
        OFF_BY_HUNDRED: lambda: _off_by(answer, 100, rng),
        DIGIT_CHANGED: lambda: _digit_changed(answer, rng),
        DIGIT_DROPPED: lambda: _digit_dropped(answer, rng),
        DIGIT_ADDED: lambda: _digit_added(answer, rng),
        DIGITS_SWAPPED: lambda: _digits_swapped(answer, rng),
        RANDOM_NUMBER: lambda: _random_number(answer, task, rng),
        MALFORMED: lambda: _malformed(answer, rng),
    }
    completion = makers[kind]()
    return completion if completion != answer else _digit_changed(answer, rng)


def training_pairs(config: RewardModelConfig, step: int, policy_pool: PolicyPool) -> list[Pair]:
    """Step `step`'s pairs (they depend only on the seed and the step), `rejected_per_problem` for
    each of `batch_size` train problems, side by side: rejected completions of different kinds and,
    for a `policy_fraction` share of the problems (drawn from the pool), one the policy wrote."""
    seed = step_seed(config.seed, step)
    rng = random.Random(seed)
    pool_problems = list(policy_pool)
    pairs = []
    for problem in train_problems(config.task, config.batch_size, seed=seed):
        group = []
        if pool_problems and rng.random() < config.policy_fraction:
            problem = rng.choice(pool_problems)
            group.append(Pair(problem, rng.choice(policy_pool[problem]), POLICY_SAMPLE))
        kinds = rng.choices(REJECTED_KINDS, weights=KIND_WEIGHTS, k=config.rejected_per_problem - len(group))
        group += [Pair(problem, rejected_completion(problem, kind, config.task, rng), kind) for kind in kinds]
        pairs += group
    return pairs


def heldout_pairs(config: RewardModelConfig) -> list[Pair]:
    """One rejected completion of every kind for each of `eval_problems` held-out problems."""
    rng = random.Random(config.seed + 1)
    return [Pair(problem, rejected_completion(problem, kind, config.task, rng), kind)
            for problem in heldout_problems(config.task, config.eval_problems, seed=config.seed)
            for kind in REJECTED_KINDS]


# -- the model ----------------------------------------------------------------------------------


def make_model(config: RewardModelConfig, policy: Qwen2ForCausalLM | None) -> Qwen2ForSequenceClassification:
    """A float32 Qwen2 classifier of the config's shape with one score; its transformer is the
    policy's when given, and its score head starts at zero (every text scores 0 at first)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    model_config = Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,  # no language-model head to tie
        num_labels=1,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        dtype="float32",
    )
    model = Qwen2ForSequenceClassification(model_config)
    if policy is not None:
        model.model.load_state_dict(policy.model.state_dict())
    with torch.no_grad():
        model.score.weight.zero_()
    return model


def save_reward_tokenizer(directory: Path) -> None:
    """The character tokenizer's files, padding on the right: the classifier pools the last
    non-pad token and counts positions from the first, as it was trained."""
    save_tokenizer(directory)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "padding_side": "right"}, indent=2) + "\n")


def encode(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the texts, right-padded."""
    import torch

    tokenizer = build_tokenizer()
    rows = [tokenizer.encode(text).ids for text in texts]
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows])
    attention_mask = (torch.arange(width) < torch.tensor([[len(row)] for row in rows])).long()
    return input_ids, attention_mask


def scores(model: Qwen2ForSequenceClassification, texts: Sequence[str], batch: int = 1024) -> list[float]:
    """The model's score of each text (eval mode, no gradients)."""
    import torch

    model.eval()
    out: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch):
            input_ids, attention_mask = encode(texts[start:start + batch])
            out += model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].tolist()
    return out


def pair_loss(model: Qwen2ForSequenceClassification, pairs: Sequence[Pair], per_problem: int,
              bce_weight: float) -> torch.Tensor:
    """Bradley-Terry on the pairs (`per_problem` consecutive pairs share a problem, whose answer
    is scored once) plus `bce_weight` times the BCE of chosen (1) and rejected (0), the two
    classes weighed alike."""
    import torch.nn.functional as F

    chosen_pairs = pairs[::per_problem]
    input_ids, attention_mask = encode([p.chosen_text for p in chosen_pairs] + [p.rejected_text for p in pairs])
    scored = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    chosen, rejected = scored[:len(chosen_pairs)], scored[len(chosen_pairs):]
    pairwise = -F.logsigmoid(chosen.repeat_interleave(per_problem) - rejected).mean()
    pointwise = (F.softplus(-chosen).mean() + F.softplus(rejected).mean()) / 2  # BCE with labels 1 and 0
    return pairwise + bce_weight * pointwise


def train_model(model: Qwen2ForSequenceClassification, config: RewardModelConfig,
                policy_pool: PolicyPool) -> tuple[float, list[dict[str, float]]]:
    """`max_steps` AdamW steps with a linear warm-up: (the last step's loss, the loss history)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)))
    history: list[dict[str, float]] = []
    loss = float("nan")
    model.train()
    for step in range(config.max_steps):
        pairs = training_pairs(config, step, policy_pool)
        value = pair_loss(model, pairs, config.rejected_per_problem, config.bce_weight)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        schedule.step()
        loss = float(value.detach())
        if (step + 1) % config.eval_every == 0 or step + 1 == config.max_steps:
            history.append({"step": step + 1, "loss": round(loss, 4)})
            log.info("%s: step %d, loss %.4f", config.name, step + 1, loss)
    return loss, history


# -- the policy's samples -----------------------------------------------------------------------


def load_policy(config: RewardModelConfig, cache_root: Path) -> Qwen2ForCausalLM:
    """The arithmetic policy, built into `cache_root` first unless cached there."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    directory = bootstrap(config.policy, cache_root)
    progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar on stderr for one 3 MB file is noise
    try:
        return cast("Qwen2ForCausalLM", AutoModelForCausalLM.from_pretrained(directory, dtype="float32"))
    finally:
        if progress_bar:
            hf_logging.enable_progress_bar()


def policy_samples(policy: Qwen2ForCausalLM, problems: Sequence[Problem], max_new_tokens: int,
                   seed: int) -> list[tuple[str, bool]]:
    """(completion text, correct) of one temperature-1 sample per problem, correct as the verifier says."""
    sampled = generate(policy, [p.prompt for p in problems], max_new_tokens, temperature=1.0,
                       generator=seeded_generator(seed))
    return [(c.text, format_ok(c.text, c.finished_by_stop) and c.text == p.answer)
            for c, p in zip(sampled, problems, strict=True)]


def policy_pool(config: RewardModelConfig, policy: Qwen2ForCausalLM) -> PolicyPool:
    """The policy's wrong samples on `policy_pool_problems` train problems (drawn with replacement,
    so a problem may have several)."""
    problems = train_problems(config.task, config.policy_pool_problems, seed=step_seed(config.seed, -1))
    pool: PolicyPool = {}
    for problem, (text, correct) in zip(problems, policy_samples(policy, problems, config.policy.max_new_tokens,
                                                                 config.seed), strict=True):
        if not correct:
            pool.setdefault(problem, []).append(text)
    return pool


# -- measures -----------------------------------------------------------------------------------


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(a positive outscores a negative), ties counting half; None without both."""
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def heldout_report(model: Qwen2ForSequenceClassification, config: RewardModelConfig) -> dict[str, Any]:
    """Pairwise accuracy (s_chosen > s_rejected) overall and by kind, and balanced classification
    accuracy at sigmoid(score) = 0.5, on held-out problems."""
    pairs = heldout_pairs(config)
    problems = list(dict.fromkeys(p.problem for p in pairs))
    chosen = dict(zip(problems, scores(model, [reward_model_text(p.prompt, p.answer) for p in problems]), strict=True))
    rejected = scores(model, [p.rejected_text for p in pairs])
    wins: dict[str, list[bool]] = {kind: [] for kind in REJECTED_KINDS}
    below: dict[str, list[bool]] = {kind: [] for kind in REJECTED_KINDS}
    for pair, score in zip(pairs, rejected, strict=True):
        wins[pair.kind].append(chosen[pair.problem] > score)
        below[pair.kind].append(score < 0)
    true_positive = sum(s > 0 for s in chosen.values()) / len(chosen)
    true_negative = sum(s < 0 for s in rejected) / len(rejected)
    return {
        "heldout_problems": len(problems),
        "pairwise_accuracy": round(sum(sum(w) for w in wins.values()) / len(pairs), 4),
        "classification_accuracy": round((true_positive + true_negative) / 2, 4),
        "chosen_accepted": round(true_positive, 4),
        "rejected_refused": round(true_negative, 4),
        "pairwise_accuracy_by_kind": {kind: round(sum(w) / len(w), 4) for kind, w in wins.items()},
        "rejected_refused_by_kind": {kind: round(sum(b) / len(b), 4) for kind, b in below.items()},
    }


def policy_report(model: Qwen2ForSequenceClassification, config: RewardModelConfig,
                  policy: Qwen2ForCausalLM) -> dict[str, Any]:
    """How the score separates the policy's right and wrong temperature-1 samples on held-out
    problems (`policy_eval_samples` per problem): the number that matters for RL on that policy.
    `auc` pools every sample; `group_auc` is the mean AUC within a problem's samples, over the
    problems with both right and wrong ones: what a group-relative advantage sees."""
    problems = heldout_problems(config.task, config.policy_eval_problems, seed=config.seed + 2)
    repeated = [p for p in problems for _ in range(config.policy_eval_samples)]
    samples = policy_samples(policy, repeated, config.policy.max_new_tokens, config.seed + 3)
    scored = scores(model, [reward_model_text(p.prompt, text) for p, (text, _) in zip(repeated, samples, strict=True)])
    correct = [ok for _, ok in samples]
    right = [s for s, ok in zip(scored, correct, strict=True) if ok]
    wrong = [s for s, ok in zip(scored, correct, strict=True) if not ok]
    area, r = auc(right, wrong), pearson(scored, [float(ok) for ok in correct])
    accepted = [ok for s, ok in zip(scored, correct, strict=True) if s > 0]
    k = config.policy_eval_samples
    groups = [auc([s for s, ok in zip(scored[i:i + k], correct[i:i + k], strict=True) if ok],
                  [s for s, ok in zip(scored[i:i + k], correct[i:i + k], strict=True) if not ok])
              for i in range(0, len(samples), k)]
    mixed = [g for g in groups if g is not None]
    return {
        "problems": len(problems),
        "samples": len(samples),
        "sampled_accuracy_t1": round(sum(correct) / len(samples), 4),
        "auc": None if area is None else round(area, 4),
        "group_auc": round(sum(mixed) / len(mixed), 4) if mixed else None,
        "mixed_groups": len(mixed),
        "point_biserial": None if r is None else round(r, 4),
        "precision_at_0": round(sum(accepted) / len(accepted), 4) if accepted else None,
        "recall_at_0": round(sum(accepted) / len(right), 4) if right else None,
    }


# -- the build ----------------------------------------------------------------------------------


def build(config: RewardModelConfig, directory: Path) -> dict[str, Any]:
    """Trains the reward model and writes the full model directory; returns the bootstrap.json record.
    The policy comes from the cache root `directory` is staged in (bootstrap() stages beside the
    final directory)."""
    policy = load_policy(config, directory.parent) if config.uses_policy else None

    def train(model: Qwen2ForSequenceClassification) -> dict[str, Any]:
        pool = policy_pool(config, policy) if policy is not None and config.policy_fraction > 0 else {}
        loss, history = train_model(model, config, pool)
        report = heldout_report(model, config)
        if report["pairwise_accuracy"] < config.target_accuracy:
            raise BootstrapError(f"held-out pairwise accuracy {report['pairwise_accuracy']} is below "
                                 f"{config.target_accuracy} after {config.max_steps} steps: {report}")
        record: dict[str, Any] = {"steps": config.max_steps, "final_loss": round(loss, 4), **report,
                                  "policy_pool": sum(map(len, pool.values())), "history": history}
        if policy is not None and config.policy_eval_problems > 0:
            record["policy_samples"] = policy_report(model, config, policy)
        return record

    start = policy if config.init_from_policy else None
    # train_and_save is typed for the causal models; it only needs a model it can save.
    make = cast("Callable[[], Qwen2ForCausalLM]", lambda: make_model(config, start))
    return train_and_save(config, directory, make, cast("Callable[[Qwen2ForCausalLM], dict[str, Any]]", train),
                          save_reward_tokenizer)


SUMMARY_KEYS = ("parameters", "steps", "seconds", "final_loss", "heldout_problems", "pairwise_accuracy",
                "classification_accuracy", "pairwise_accuracy_by_kind")


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What `policyloop bootstrap --reward-model` prints of a bootstrap.json record: size, cost, the
    held-out accuracies and the AUC on the policy's samples."""
    return {**{key: record.get(key) for key in SUMMARY_KEYS},
            "policy_auc": (record.get("policy_samples") or {}).get("auc")}
