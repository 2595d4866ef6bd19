"""The worker that runs a verifiers environment in a session, run here as the sandbox runs it (one
process, JSON lines on stdin and stdout) on examples/environments/verifiers/vf_sums.py with the
official library: the rubric's reward comes with the episode's end, an empty model reply is the
model's failure (scored, not the environment's), and a conversation may only grow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policyloop.envs import verifiers_worker
from policyloop.envs.verifiers_worker import Conversation, Malformed

ENVIRONMENTS = Path(__file__).resolve().parents[2] / "examples" / "environments" / "verifiers"
ROW = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "example_id": 0}


def episode(tmp_path: Path, *actions: dict, environment: str = "vf-sums") -> list[dict]:
    """The worker's answers to a reset with ROW, then to each action."""
    (tmp_path / "env").mkdir()
    source = environment.replace("-", "_") + ".py"
    (tmp_path / "env" / source).write_bytes((ENVIRONMENTS / source).read_bytes())
    lines = [{"reset": {"prompt_text": json.dumps(ROW), "answer": "5"}}, *({"action": a} for a in actions)]
    done = subprocess.run([sys.executable, "-I", verifiers_worker.__file__, environment, '{"count": 2}'],
                          input="".join(json.dumps(line) + "\n" for line in lines), capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(("action", "reward"), [
    ({"text": "2 + 3 = 5.", "content": "2 + 3 = 5."}, 1.0),
    ({"text": "2 + 3 = 6.", "content": "2 + 3 = 6."}, 0.0),
    ({"text": "", "content": ""}, 0.0),  # an empty reply: verifiers' ModelError, scored by the rubric
])
def test_the_rubric_scores_the_models_reply(tmp_path: Path, action: dict, reward: float) -> None:
    opened, ended = episode(tmp_path, action)
    assert opened == {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "tools_json": "[]"}
    assert ended == {"done": True, "reward": reward}


def reply(text: str) -> dict:
    return {"text": text, "content": text}


@pytest.mark.parametrize(("replies", "reward"), [
    (["2 + 3 = 6.", "2 + 3 = 5."], 0.5),
    (["2 + 3 = 6.", "4"], 0.0),
])
def test_a_multi_turn_environment_answers_a_wrong_reply_and_scores_the_tries(
        tmp_path: Path, replies: list[str], reward: float) -> None:
    answers = episode(tmp_path, *map(reply, replies), environment="vf-second-try")
    assert answers[1:-1] == [{"messages": [{"role": "user", "content": "No. Try again: What is 2 + 3?"}]}] * (
        len(replies) - 1)
    assert answers[-1] == {"done": True, "reward": reward}


def test_a_conversation_may_only_grow() -> None:
    conversation = Conversation()
    first = [{"role": "system", "content": "Add."}, {"role": "user", "content": [{"type": "text", "text": "2+3"}]}]
    assert conversation.added(first) == [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3"}]
    grown = [*first, {"role": "assistant", "content": "5"}, {"role": "tool", "content": "5"}]
    assert conversation.added(grown) == [{"role": "tool", "content": "5"}]
    with pytest.raises(Malformed, match="rewrote the conversation"):  # an earlier turn dropped
        conversation.added([first[1], {"role": "assistant", "content": "5"}, {"role": "user", "content": "?"}])
    with pytest.raises(Malformed, match="may add"):
        Conversation().added([{"role": "assistant", "content": "I start"}])
