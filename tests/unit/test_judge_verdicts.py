"""How a judge's reply becomes a reward: a number (mapped onto [0, 1] by a range), the first label
the reply says, a JSON object's field; a reply without a verdict is an error naming what is
missing, never a zero. The prompt the judge is sent, and the cache key of a judgement."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import bus_pb2
from policyloop.scorers.judge import judge_prompt, judge_spec, reply_key, verdict
from policyloop.scorers.score import UnscorableTrajectory


def test_a_number_verdict_is_the_first_number_mapped_onto_its_range() -> None:
    plain = judge_spec("j", "{response}")
    assert verdict(plain, "I would say 7.5, maybe 8") == 7.5
    assert verdict(plain, "-3") == -3.0
    ranged = judge_spec("j", "{response}", min_score=1, max_score=11)
    assert verdict(ranged, "Score: 6") == pytest.approx(0.5)
    assert verdict(ranged, "40") == 1.0 and verdict(ranged, "0") == 0.0  # clamped
    with pytest.raises(UnscorableTrajectory, match="holds no number: 'no idea'"):
        verdict(plain, "no idea")


def test_a_label_verdict_is_the_first_label_said_as_a_whole_word() -> None:
    spec = judge_spec("j", "{response}", verdict_kind="label", labels={"yes": 1.0, "no": 0.0, "partly": 0.5})
    assert verdict(spec, "YES, it is right") == 1.0
    assert verdict(spec, "Partly. But no, not fully") == 0.5  # the first said
    assert verdict(spec, "Nope; notably it is... no") == 0.0  # "Nope" and "notably" are not "no"
    with pytest.raises(UnscorableTrajectory, match="names none of the labels"):
        verdict(spec, "unclear")


def test_a_json_verdict_reads_its_field_as_a_number_or_a_label() -> None:
    spec = judge_spec("j", "{response}", verdict_kind="json", max_score=10)
    assert verdict(spec, 'Thinking {bad json} then {"score": 7, "why": "ok"}') == pytest.approx(0.7)
    labelled = judge_spec("j", "{response}", verdict_kind="json", json_field="verdict", labels={"pass": 1, "fail": 0})
    assert verdict(labelled, '{"verdict": "PASS"}') == 1.0
    for reply, problem in (('{"other": 1}', "no JSON object with 'verdict'"), ("{}", "no JSON object"),
                           ('{"verdict": "maybe"}', "not a number or a label"), ("plain", "no JSON object")):
        with pytest.raises(UnscorableTrajectory, match=problem):
            verdict(labelled, reply)
    with pytest.raises(UnscorableTrajectory, match="not a number"):
        verdict(spec, '{"score": true}')


def test_the_prompt_and_the_cache_key() -> None:
    traj = bus_pb2.Trajectory(prompt_text="12+34=", response_text="46",
                              scorer=bus_pb2.Scorer(answer="46"))
    template = 'Q: {prompt} A: {response} (expected {answer}); reply {"score": n}'
    assert judge_prompt(template, traj) == 'Q: 12+34= A: 46 (expected 46); reply {"score": n}'
    # The model's last turn is the response of a multi-turn sample.
    traj.turns.add(role=bus_pb2.Turn.ROLE_MODEL, text="<call>")
    traj.turns.add(role=bus_pb2.Turn.ROLE_MODEL, text="46!")
    assert judge_prompt("{response}", traj) == "46!"
    key = reply_key("j", "m", "content", 64)
    assert key == reply_key("j", "m", "content", 64)
    assert len({key, reply_key("k", "m", "content", 64), reply_key("j", "n", "content", 64),
                reply_key("j", "m", "content!", 64), reply_key("j", "m", "content", 65)}) == 5
    with pytest.raises(ValueError, match="verdict must be one of number, label, json"):
        judge_spec("j", "{response}", verdict_kind="stars")
