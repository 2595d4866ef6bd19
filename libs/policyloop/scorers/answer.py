"""The part of a trajectory a scorer judges."""

from __future__ import annotations

from policyloop.contracts.v1 import bus_pb2


def answer_text(traj: bus_pb2.Trajectory) -> str:
    """What a verifier judges: the model's last turn in a multi-turn trajectory (the transcript
    before it holds the tools' output, which is not the model's answer), else the response."""
    model_turns = [t for t in traj.turns if t.role == bus_pb2.Turn.ROLE_MODEL]
    return model_turns[-1].text if model_turns else traj.response_text
