"""A multi-turn verifiers environment, written as its authors write one: sums and differences of
one-digit numbers, with a second try after a wrong answer. Right at the first try: reward 1;
at the second: 0.5."""

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


def is_right(parser: vf.Parser, completion, answer: str) -> bool:
    numbers = NUMBER.findall(parser.parse_answer(completion) or "")
    return bool(numbers) and numbers[-1] == answer


class SecondTry(vf.MultiTurnEnv):
    @vf.stop
    async def answered_right(self, state: vf.State) -> bool:
        return bool(state["trajectory"]) and is_right(self.parser, state["trajectory"][-1]["completion"],
                                                      state["answer"])

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        question = state["prompt"][-1]["content"]
        return [{"role": "user", "content": f"No. Try again: {question}"}]


def load_environment(count: int = 64, eval_count: int = 32, seed: int = 0) -> vf.Environment:
    parser = vf.Parser()

    def tries(completion, answer, state) -> float:
        right = is_right(parser, state["trajectory"][-1]["completion"], answer) if state["trajectory"] else False
        return (1.0 if len(state["trajectory"]) == 1 else 0.5) if right else 0.0

    return SecondTry(dataset=Dataset.from_list(questions(count, seed)),
                     eval_dataset=Dataset.from_list(questions(eval_count, seed + 1)),
                     parser=parser, rubric=vf.Rubric(funcs=[tries], parser=parser), max_turns=2)
