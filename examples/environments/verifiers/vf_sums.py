"""A single-turn verifiers environment, written as its authors write one: sums and differences of
one-digit numbers asked in chat, reward 1 when the reply's last number is the result."""

import random
import re

import verifiers as vf
from datasets import Dataset

NUMBER = re.compile(r"-?\d+")


def questions(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, op = rng.randrange(10), rng.randrange(10), rng.choice("+-")
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)})
    return rows


def correct_result(parser, completion, answer) -> float:
    numbers = NUMBER.findall(parser.parse_answer(completion) or "")
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def load_environment(count: int = 64, eval_count: int = 32, seed: int = 0) -> vf.Environment:
    parser = vf.Parser()
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(questions(count, seed)),
        eval_dataset=Dataset.from_list(questions(eval_count, seed + 1)),
        parser=parser, rubric=vf.Rubric(funcs=[correct_result], parser=parser))
