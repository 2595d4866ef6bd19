"""A multi-turn tool environment in verifiers: the model may call `add` and `subtract`, then
answers; reward 1 when its final reply states the result."""

import random
import re

import verifiers as vf
from datasets import Dataset

NUMBER = re.compile(r"-?\d+")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract the second integer from the first.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return a - b


def questions(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, op = rng.randrange(10, 100), rng.randrange(1, 10), rng.choice("+-")
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)})
    return rows


def stated_result(parser, completion, answer) -> float:
    numbers = NUMBER.findall(parser.parse_answer(completion) or "")
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def load_environment(count: int = 64, eval_count: int = 32, seed: int = 0, max_turns: int = 3) -> vf.Environment:
    parser = vf.Parser()
    return vf.ToolEnv(
        dataset=Dataset.from_list(questions(count, seed)),
        eval_dataset=Dataset.from_list(questions(eval_count, seed + 1)),
        tools=[add, subtract], max_turns=max_turns, parser=parser,
        rubric=vf.Rubric(funcs=[stated_result], parser=parser))
