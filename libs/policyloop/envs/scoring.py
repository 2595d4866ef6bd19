"""Scoring a trajectory with its task's built-in verifier (named in the task's metadata by the
gateway: `scorer`, plus `answer`, `pattern`, `tolerance`, `format_weight`)."""

from __future__ import annotations

import math
import re

from policyloop.contracts.v1 import bus_pb2
from policyloop.envs import arithmetic
from policyloop.trajectories import answer_text


class UnscorableTrajectory(ValueError):
    """The task names no scorer this service can run, or lacks what the scorer needs."""


def _component(name: str, value: float, weight: float, detail: str) -> bus_pb2.RewardComponent:
    return bus_pb2.RewardComponent(name=name, value=value, weight=weight, detail=detail)


def _format_weight(metadata: dict[str, str]) -> float:
    return float(metadata.get("format_weight", arithmetic.FORMAT_WEIGHT))


def score_trajectory(traj: bus_pb2.Trajectory) -> tuple[float, list[bus_pb2.RewardComponent]]:
    """(reward, breakdown) of one trajectory."""
    metadata = dict(traj.metadata)
    scorer = metadata.get("scorer", "")
    text = answer_text(traj)
    stopped = traj.finish_reason == bus_pb2.FINISH_REASON_STOP
    if scorer == "exact_answer":
        answer = _required(metadata, "answer", scorer)
        if re.fullmatch(r"-?\d+", answer):
            # Integer answers (the arithmetic environment): the strict integer format.
            result = arithmetic.score(text, stopped, answer)
            parts = [_component(c.name, c.value, c.weight, c.detail) for c in result.breakdown]
        else:
            parts = [_component("format", float(stopped), _format_weight(metadata), "ended by a stop token"),
                     _component("exact_answer", float(stopped and text.strip() == answer), 1.0,
                                f"expected {answer!r}")]
    elif scorer == "numeric_tolerance":
        answer = float(_required(metadata, "answer", scorer))
        tolerance = float(metadata.get("tolerance", "0"))
        try:
            value = float(text.strip())
            well_formed = stopped and math.isfinite(value)
        except ValueError:
            value, well_formed = math.nan, False
        parts = [_component("format", float(well_formed), _format_weight(metadata), "a number, ended by stop"),
                 _component("within_tolerance", float(well_formed and abs(value - answer) <= tolerance), 1.0,
                            f"expected {answer} ± {tolerance}")]
    elif scorer == "regex":
        pattern = _required(metadata, "pattern", scorer)
        parts = [_component("regex", float(stopped and re.fullmatch(pattern, text) is not None), 1.0,
                            f"fullmatch {pattern!r}")]
    else:
        raise UnscorableTrajectory(f"metadata.scorer: {scorer!r} is not a built-in verifier this service runs")
    return sum(p.value * p.weight for p in parts), parts


def _required(metadata: dict[str, str], key: str, scorer: str) -> str:
    if key not in metadata:
        raise UnscorableTrajectory(f"metadata.{key}: the {scorer} verifier needs it")
    return metadata[key]
