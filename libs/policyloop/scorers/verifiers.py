"""The built-in verifiers: exact answer, numeric tolerance and regex, run in the reward
service's own process against the trajectory's typed scorer (its parameters and answer), and the
rewards an environment program gave its episode's steps."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs import arithmetic
from policyloop.scorers.answer import answer_text
from policyloop.scorers.score import Score, UnscorableTrajectory, component, scorer_kind

Verifier = Callable[[bus_pb2.Trajectory], Score]


def _stopped(traj: bus_pb2.Trajectory) -> bool:
    return traj.finish_reason == bus_pb2.FINISH_REASON_STOP


def _format_weight(traj: bus_pb2.Trajectory) -> float:
    return traj.scorer.builtin.format_weight or arithmetic.FORMAT_WEIGHT


def _answer(traj: bus_pb2.Trajectory) -> str:
    if not traj.scorer.answer:
        raise UnscorableTrajectory(f"scorer.answer: the {scorer_kind(traj.scorer)} verifier needs it")
    return traj.scorer.answer


def exact_answer(traj: bus_pb2.Trajectory) -> Score:
    answer, text, stopped = _answer(traj), answer_text(traj), _stopped(traj)
    if re.fullmatch(r"-?\d+", answer):
        # Integer answers (the arithmetic environment): the strict integer format.
        result = arithmetic.score(text, stopped, answer)
        parts = [component(c.name, c.value, c.weight, c.detail) for c in result.breakdown]
    else:
        parts = [component("format", float(stopped), _format_weight(traj), "ended by a stop token"),
                 component("exact_answer", float(stopped and text.strip() == answer), 1.0, f"expected {answer!r}")]
    return sum(p.value * p.weight for p in parts), parts


def numeric_tolerance(traj: bus_pb2.Trajectory) -> Score:
    try:
        answer = float(_answer(traj))
    except ValueError as exc:
        raise UnscorableTrajectory(f"scorer.answer: {traj.scorer.answer!r} is not a number") from exc
    tolerance = traj.scorer.builtin.tolerance
    try:
        value = float(answer_text(traj).strip())
        well_formed = _stopped(traj) and math.isfinite(value)
    except ValueError:
        value, well_formed = math.nan, False
    parts = [component("format", float(well_formed), _format_weight(traj), "a number, ended by stop"),
             component("within_tolerance", float(well_formed and abs(value - answer) <= tolerance), 1.0,
                       f"expected {answer} ± {tolerance}")]
    return sum(p.value * p.weight for p in parts), parts


def regex(traj: bus_pb2.Trajectory) -> Score:
    pattern = traj.scorer.builtin.pattern
    if not pattern:
        raise UnscorableTrajectory("scorer.builtin.pattern: the regex verifier needs it")
    matched = _stopped(traj) and re.fullmatch(pattern, answer_text(traj)) is not None
    parts = [component("regex", float(matched), 1.0, f"fullmatch {pattern!r}")]
    return sum(p.value * p.weight for p in parts), parts


def environment_reward(traj: bus_pb2.Trajectory) -> Score:
    """What an environment program gave: its step rewards, each with the model turn it rewards."""
    model_turns = [turn for turn in traj.turns if turn.role == bus_pb2.Turn.ROLE_MODEL]
    parts = [component(f"turn_{i}", turn.reward, 1.0, "the environment's reward for this step")
             for i, turn in enumerate(model_turns) if turn.HasField("reward")]
    return sum(p.value for p in parts), parts


VERIFIERS: dict[str, Verifier] = {
    "exact_answer": exact_answer,
    "numeric_tolerance": numeric_tolerance,
    "regex": regex,
    "environment_reward": environment_reward,
}


def verify(traj: bus_pb2.Trajectory) -> Score:
    """(reward, breakdown) of a trajectory whose scorer is a built-in verifier."""
    kind = scorer_kind(traj.scorer)
    if kind not in VERIFIERS:
        raise UnscorableTrajectory(f"scorer: {kind or 'none'!r} is not a built-in verifier")
    return VERIFIERS[kind](traj)
