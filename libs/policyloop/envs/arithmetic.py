"""The built-in arithmetic environment: `a op b=` problems, a fixed train / held-out split and
a strict verifier.

Pure functions, no torch: the reward service, the bootstrap and the evaluation code all share
them, so "correct" means the same thing everywhere.

Split. Every problem is assigned to the held-out split by a stable hash (xxh64) of its prompt
text, never by Python's `hash()` (salted per process) and never by sampling, so the split is the
same in every process, on every machine and for every seed, and train and held-out never
overlap. The assignment depends only on the prompt and `heldout_fraction`, so a problem keeps
its split when `digits` or `ops` change.

Verifier. A completion is the text the model generated with the end-of-sequence token stripped
by the caller. Two components:

- "format" (weight 0.1): 1 if the completion is exactly an integer (ASCII digits, optional
  leading '-', nothing else — no spaces, no trailing text) and generation ended on the stop
  token, not on the length limit. A small weight: it teaches the model to stop cleanly without
  outweighing correctness.
- "exact_answer" (weight 1.0): 1 if the format holds and the completion equals `str(a op b)`
  exactly ("046" is not 46). It requires the format, so a length-truncated completion that
  happens to start with the answer earns nothing.

reward = sum(value * weight), so the reward is one of 0.0 (bad format), 0.1 (well formed but
wrong) or 1.1 (correct).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

NAME = "arithmetic"
OPS: tuple[str, ...] = ("+", "-")
FORMAT_WEIGHT = 0.1
EXACT_ANSWER_WEIGHT = 1.0
# ASCII only: `\d` would also accept other scripts' digits.
ANSWER_RE = re.compile(r"-?[0-9]+")
# Above this many problems the held-out split is sampled by rejection instead of enumerated.
ENUMERATE_LIMIT = 1_000_000


@dataclass(frozen=True)
class ArithmeticConfig:
    """Which problems exist and how they are split."""

    digits: int = 2
    """Every operand has exactly this many digits (2: 10..99; 1: 0..9)."""
    ops: tuple[str, ...] = ("+",)
    """Operators drawn from, a subset of ("+", "-")."""
    heldout_fraction: float = 0.2
    """Share of all problems assigned to the held-out split (by prompt hash)."""

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {self.ops}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")

    @property
    def operand_range(self) -> range:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return range(low, 10**self.digits)

    @property
    def size(self) -> int:
        """How many distinct problems there are (both splits)."""
        return len(self.operand_range) ** 2 * len(self.ops)


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)


@dataclass(frozen=True)
class ScoreComponent:
    name: str
    value: float
    weight: float
    detail: str


@dataclass(frozen=True)
class Score:
    reward: float
    breakdown: list[ScoreComponent]


def _heldout_position(prompt: str) -> float:
    """A stable, uniform number in [0, 1) for a prompt."""
    return xxhash.xxh64_intdigest(prompt.encode()) / 2**64


def is_heldout(problem: Problem, heldout_fraction: float = 0.2) -> bool:
    return _heldout_position(problem.prompt) < heldout_fraction


def all_problems(config: ArithmeticConfig) -> Iterator[Problem]:
    """Every problem of the config, both splits, in a fixed order."""
    for op in config.ops:
        for a in config.operand_range:
            for b in config.operand_range:
                yield Problem(a, op, b)


def split(config: ArithmeticConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out), each in `all_problems` order. Enumerates the whole space."""
    train: list[Problem] = []
    heldout: list[Problem] = []
    for problem in all_problems(config):
        (heldout if is_heldout(problem, config.heldout_fraction) else train).append(problem)
    return train, heldout


def _random_problem(config: ArithmeticConfig, rng: random.Random) -> Problem:
    operands = config.operand_range
    return Problem(rng.choice(operands), rng.choice(config.ops), rng.choice(operands))


def train_problems(config: ArithmeticConfig, count: int, seed: int) -> list[Problem]:
    """`count` train problems drawn uniformly with replacement; the same for the same seed.

    Rejection sampling keeps this cheap for any number of digits (no enumeration)."""
    rng = random.Random(seed)
    out: list[Problem] = []
    while len(out) < count:
        problem = _random_problem(config, rng)
        if not is_heldout(problem, config.heldout_fraction):
            out.append(problem)
    return out


def heldout_problems(config: ArithmeticConfig, count: int, seed: int) -> list[Problem]:
    """`count` distinct held-out problems; the same for the same seed. Raises ValueError when
    the held-out split has fewer than `count` problems."""
    rng = random.Random(seed)
    if config.size <= ENUMERATE_LIMIT:
        _, heldout = split(config)
        if count > len(heldout):
            raise ValueError(f"asked for {count} held-out problems, the split has {len(heldout)}")
        return rng.sample(heldout, count)
    chosen: dict[Problem, None] = {}  # a dict keeps the draw order, so the result is deterministic
    while len(chosen) < count:
        problem = _random_problem(config, rng)
        if is_heldout(problem, config.heldout_fraction):
            chosen[problem] = None
    return list(chosen)


def format_ok(completion_text: str, finished_by_stop: bool) -> bool:
    return finished_by_stop and ANSWER_RE.fullmatch(completion_text) is not None


def score(completion_text: str, finished_by_stop: bool, answer: str) -> Score:
    """The verifier (see the module docstring for the components and their weights)."""
    well_formed = format_ok(completion_text, finished_by_stop)
    correct = well_formed and completion_text == answer
    if not finished_by_stop:
        format_detail = "stopped by the length limit"
    elif not well_formed:
        format_detail = f"not an integer: {completion_text[:32]!r}"
    else:
        format_detail = "ok"
    breakdown = [
        ScoreComponent("format", float(well_formed), FORMAT_WEIGHT, format_detail),
        ScoreComponent("exact_answer", float(correct), EXACT_ANSWER_WEIGHT,
                       f"expected {answer!r}, got {completion_text[:32]!r}"),
    ]
    return Score(reward=sum(c.value * c.weight for c in breakdown), breakdown=breakdown)


def accuracy(completions: Sequence[str], answers: Sequence[str], finished_by_stop: Sequence[bool]) -> float:
    """Share of completions that are exactly the answer in the strict format."""
    if not (len(completions) == len(answers) == len(finished_by_stop)):
        raise ValueError("completions, answers and finished_by_stop must have the same length")
    if not completions:
        raise ValueError("accuracy of no completions is undefined")
    correct = sum(
        format_ok(text, stopped) and text == answer
        for text, answer, stopped in zip(completions, answers, finished_by_stop, strict=True)
    )
    return correct / len(completions)
