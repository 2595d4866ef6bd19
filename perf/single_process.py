"""The yardstick of the distributed loop: the demo's RL task as one process with plain torch.

Sample a group per problem from the current weights, score each completion with the arithmetic
verifier the reward service runs, take one optimizer step with the learner's objective, repeat —
no services, no bus, no weight sync. The model, tokenizer, loss (`rl.objective`, its
advantages and normalisation), optimizer and schedule are the learner's; decoding is the
embedded engine's (its left padding and `sample_rows`: temperature, full vocabulary, the stop
token ends a row and is trained);
the behaviour log-probabilities are the step's own forward pass (the loop is on-policy).

`perf/vs_single_process.py` runs it beside the cluster for the same training time. It lives in
perf/, outside the library's layers: a baseline that nothing in the library imports.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from policyloop.engines.embedded.sampling import request_generator, sample_rows
from policyloop.engines.protocol import SamplingParams
from policyloop.envs import arithmetic
from policyloop.rl.logprobs import left_padded, pack, token_logprobs_and_entropy
from policyloop.rl.losses import KINDS, LossSettings
from policyloop.rl.objective import BatchCounts, compute_advantages, objective
from policyloop.rl.settings import OptimizerSettings
from policyloop.telemetry.phases import PhaseClock


@dataclass(frozen=True)
class SingleProcessConfig:
    model_path: Path
    groups_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    loss: LossSettings = field(default_factory=KINDS["ppo"])
    seed: int = 0
    threads: int = 2                     # the whole machine: nothing else runs
    # The learner's forward (each distinct prompt once, rl.logprobs), to compare like with like;
    # False: the plain forward over every prompt + response row, as a one-file script has it.
    share_prompts: bool = True


@dataclass(frozen=True)
class Completions:
    """Sampled responses: each row's tokens (the stop token included when it ended the row) and
    whether the stop token ended it (else the length limit did)."""

    tokens: list[list[int]]
    stopped: list[bool]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
             eos_id: int, pad_id: int, seeds: Sequence[int] | None = None) -> Completions:
    """Batched decoding with a KV cache, as the embedded engine decodes a wave (its left padding
    and its `sample_rows`): temperature 0 is greedy, otherwise each row draws from its own
    generator, seeded with `seeds[i]` (at random without), over the whole vocabulary."""
    params = [SamplingParams(temperature=temperature, sampling_seed=None if seeds is None else seeds[i])
              for i in range(len(prompts))]
    generators = [request_generator(p) for p in params]
    input_ids, mask, positions = left_padded(prompts, pad_id)
    tokens: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    cache, step_ids = None, input_ids
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        drawn = [token for token, _ in sample_rows(out.logits[:, -1].float(), params, generators)]
        for i, token in enumerate(drawn):
            if not stopped[i]:  # a finished row keeps decoding with the others, its tokens unused
                tokens[i].append(token)
                stopped[i] = token == eos_id
        if all(stopped):
            break
        step_ids = torch.tensor(drawn, dtype=torch.long)[:, None]
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
    return Completions(tokens, stopped)


def completion_text(tokenizer, tokens: Sequence[int], eos_id: int) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode([t for t in tokens if t != eos_id])


def greedy_accuracy(model: torch.nn.Module, tokenizer, problems: Sequence[arithmetic.Problem], *,  # type: ignore[no-untyped-def]
                    max_new_tokens: int = 8, batch: int = 600) -> float:
    """Held-out accuracy as the demo measures it: greedy, exact answer in the strict format."""
    eos_id, pad_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id or 0)
    texts: list[str] = []
    stopped: list[bool] = []
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        prompts = [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in chunk]
        out = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=0.0, eos_id=eos_id, pad_id=pad_id)
        texts.extend(completion_text(tokenizer, t, eos_id) for t in out.tokens)
        stopped.extend(out.stopped)
    return arithmetic.accuracy(texts, [p.answer for p in problems], stopped)


@dataclass(frozen=True)
class LoopStep:
    step: int
    mean_reward: float
    loss: float
    phases: dict[str, float]             # sample, score, forward, backward, optimizer (seconds)


class SingleProcessGRPO:
    """The loop's state: model, optimizer, schedule, the train problems and the random streams."""

    def __init__(self, config: SingleProcessConfig) -> None:
        from transformers import AutoModelForCausalLM

        from policyloop.models.tokenizer import load_tokenizer
        from policyloop.rl.trainer import LrSchedule

        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32)
        self.model.train()
        self.tokenizer = load_tokenizer(config.model_path)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.optimizer.lr,
                                           weight_decay=config.optimizer.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LrSchedule(config.optimizer))
        self.problems, _ = arithmetic.split(arithmetic.ArithmeticConfig())
        self.rng = random.Random(config.seed)
        self.steps = 0

    def step(self) -> LoopStep:
        c = self.config
        clock = PhaseClock()
        chosen = [self.rng.choice(self.problems) for _ in range(c.groups_per_step)]
        prompts = [self.tokenizer(p.prompt, add_special_tokens=False).input_ids for p in chosen
                   for _ in range(c.group_size)]
        self.model.eval()
        out = generate(self.model, prompts, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                       eos_id=self.eos_id, pad_id=self.pad_id, seeds=[self.rng.getrandbits(62) for _ in prompts])
        self.model.train()
        clock.lap("sample")
        rewards = [arithmetic.score(completion_text(self.tokenizer, tokens, self.eos_id), stopped,
                                    chosen[i // c.group_size].answer).reward
                   for i, (tokens, stopped) in enumerate(zip(out.tokens, out.stopped, strict=True))]
        clock.lap("score")
        loss = self.update(prompts, out.tokens, rewards, clock)
        self.steps += 1
        return LoopStep(self.steps, sum(rewards) / len(rewards), loss, clock.seconds)

    def update(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
               rewards: Sequence[float], clock: PhaseClock | None = None) -> float:
        """One optimizer step on groups of `group_size` consecutive samples (the learner's
        objective, on-policy: the behaviour log-probabilities are this forward pass's)."""
        c = self.config
        clock = clock or PhaseClock()
        grouped = torch.tensor(list(rewards), dtype=torch.float32).reshape(-1, c.group_size)
        advantages = compute_advantages(grouped, c.loss.advantages).reshape(-1)
        batch = pack(prompts, responses, pad_id=self.pad_id)
        logprobs, entropy = token_logprobs_and_entropy(self.model, batch, share_prompts=c.share_prompts)
        counts = BatchCounts(tokens=float(batch.response_mask.sum()), sequences=len(prompts),
                             width=max(len(r) for r in responses))
        result = objective(c.loss, logprobs, advantages[:, None].expand_as(batch.response_mask), batch.response_mask,
                           counts, behaviour_logprobs=logprobs.detach(), entropy=entropy)
        clock.lap("forward")
        result.loss.backward()
        clock.lap("backward")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.optimizer.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        return result.statistics["loss"]

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the weights now (evaluated later, off the training clock)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@dataclass(frozen=True)
class Snapshot:
    seconds: float                       # training time when it was taken
    steps: int
    weights: dict[str, torch.Tensor]


def train_for(loop: SingleProcessGRPO, seconds: float, marks: Sequence[float]) -> tuple[list[Snapshot], float]:
    """Trains for `seconds` of wall time, snapshotting the weights as each mark (seconds into the
    run) passes; returns the snapshots and the seconds the loop actually ran."""
    pending = sorted(m for m in marks if m <= seconds)
    snapshots = [Snapshot(0.0, 0, loop.snapshot())]
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        while pending and elapsed >= pending[0]:
            # Snapshotting is bookkeeping of the measurement: it stays off the training clock.
            taken = time.monotonic()
            snapshots.append(Snapshot(pending.pop(0), loop.steps, loop.snapshot()))
            started += time.monotonic() - taken
        if elapsed >= seconds:
            return snapshots, elapsed
        loop.step()


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Puts weights named as the checkpoint's tensors into `model` (a tied head may be absent)."""
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"the model has no tensors named {result.unexpected_keys[:3]}")
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing:
        raise KeyError(f"no weights given for {sorted(missing)[:3]}")


@dataclass(frozen=True)
class CurvePoint:
    seconds: float
    steps: int
    accuracy: float


def time_to_accuracy(curve: Sequence[CurvePoint], target: float) -> float | None:
    """The training time at which held-out accuracy first reaches `target`, interpolated linearly
    between the two evaluations around it; None when it never does."""
    previous: CurvePoint | None = None
    for point in sorted(curve, key=lambda p: p.seconds):
        if point.accuracy >= target:
            if previous is None or point.accuracy == previous.accuracy:
                return point.seconds
            share = (target - previous.accuracy) / (point.accuracy - previous.accuracy)
            return previous.seconds + share * (point.seconds - previous.seconds)
        previous = point
    return None
