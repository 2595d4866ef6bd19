"""An OpenEnv environment, written as OpenEnv's authors write one: a sums quiz with a second try.

reset(seed) asks "What is a + b?" (or a - b); the reply's last number is the answer, and a reply
that restates the expression shows its work. A try scores 0.75 for the right answer and 0.25 for
the work shown; the first try counts fully, the second (after "No. Try again: ...") half. Right
or out of tries: done. The attempts are the environment's state, one instance per session. Serve it with

    python -m uvicorn sums_quiz:app --port 8000      (from this directory)
"""

import random
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

NUMBER = re.compile(r"-?\d+")
TRIES = (1.0, 0.5)  # what each try's score counts for
SHOWN = 0.25        # of a try's score: the expression restated (the rest: the right answer)


class QuizAction(Action):
    answer: str = Field(..., description="The reply; its last number is the answer")


class QuizObservation(Observation):
    message: str = Field(default="", description="The question, or the verdict on the last answer")


class SumsQuiz(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.expression, self.question, self.result = "", "", 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> QuizObservation:
        rng = random.Random(seed)
        a, b, op = rng.randrange(10), rng.randrange(10), rng.choice("+-")
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        self.expression, self.result = f"{a} {op} {b}", a + b if op == "+" else a - b
        self.question = f"What is {self.expression}?"
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return QuizObservation(message=self.question, done=False, reward=0.0)

    def step(self, action: QuizAction) -> QuizObservation:  # type: ignore[override]
        attempt = self._state.step_count
        self._state.step_count += 1
        numbers = NUMBER.findall(action.answer)
        right = bool(numbers) and int(numbers[-1]) == self.result
        reward = TRIES[attempt] * ((1 - SHOWN) * right + SHOWN * (self.expression in action.answer))
        if right:
            return QuizObservation(message="Right.", done=True, reward=reward)
        if attempt + 1 < len(TRIES):
            return QuizObservation(message=f"No. Try again: {self.question}", done=False, reward=reward)
        return QuizObservation(message=f"No, it is {self.result}.", done=True, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumsQuiz, QuizAction, QuizObservation, env_name="sums_quiz", max_concurrent_envs=256)
