"""The scorers that run in the reward service's own process (scorers.kinds declares them): the
built-in verifiers — exact answer, numeric tolerance and regex — against the trajectory's typed
scorer (its parameters and answer), and the rewards an environment gave its episode's steps."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.answer import answer_text
from policyloop.scorers.score import Score, UnscorableTrajectory, component, scorer_kind

Verifier = Callable[[bus_pb2.Trajectory], Score]
DEFAULT_FORMAT_WEIGHT = 0.1  # BuiltinVerifier.format_weight 0


def _stopped(traj: bus_pb2.Trajectory) -> bool:
    return traj.finish_reason == bus_pb2.FINISH_REASON_STOP


def _format_weight(traj: bus_pb2.Trajectory) -> float:
    return traj.scorer.builtin.format_weight or DEFAULT_FORMAT_WEIGHT


def _answer(traj: bus_pb2.Trajectory) -> str:
    if not traj.scorer.answer:
        raise UnscorableTrajectory(f"scorer.answer: the {scorer_kind(traj.scorer)} verifier needs it")
    return traj.scorer.answer


def exact_answer(traj: bus_pb2.Trajectory) -> Score:
    """The format term for a completion ended by a stop token (and, with `pattern`, that matches
    it whole: the environment's answer format), and the answer term for the answer itself — the
    text as it stands with a pattern, else the text without surrounding blanks."""
    answer, text, stopped = _answer(traj), answer_text(traj), _stopped(traj)
    pattern = traj.scorer.builtin.pattern
    if pattern:
        well_formed = stopped and re.fullmatch(pattern, text) is not None
        detail = "ok" if well_formed else "stopped by the length limit" if not stopped else \
            f"not in the format {pattern!r}: {text[:32]!r}"
        correct = well_formed and text == answer
    else:
        well_formed, detail = stopped, "ended by a stop token" if stopped else "stopped by the length limit"
        correct = stopped and text.strip() == answer
    parts = [component("format", float(well_formed), _format_weight(traj), detail),
             component("exact_answer", float(correct), 1.0, f"expected {answer!r}, got {text[:32]!r}")]
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
