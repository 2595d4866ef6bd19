"""Served traces as an RL environment: which recorded outcome becomes a prompt's reference answer."""

from __future__ import annotations

from policyloop.contracts.v1 import serving_pb2
from policyloop.serving.traces import TracedExchange, environment_from_traces, in_eval_split, reference_answer


def exchange(trace_id: str, prompt: list[int], response: str, *feedback: serving_pb2.TraceFeedback,
             response_ids: int = 2, finish_reason: str = "stop") -> TracedExchange:
    trace = serving_pb2.Trace(trace_id=trace_id, prompt_token_ids=prompt, response_text=response,
                              response_token_ids=list(range(response_ids)), weights_version="7",
                              finish_reason=finish_reason)
    return TracedExchange(trace, list(feedback))


def feedback(at: int, reward: float | None = None, correction: str = "") -> serving_pb2.TraceFeedback:
    return serving_pb2.TraceFeedback(created_unix_ms=at, reward=reward, correction=correction)


def test_a_correction_wins_then_a_rewarded_response_and_the_newest_feedback_counts() -> None:
    assert reference_answer(exchange("a", [1], "41", feedback(1, 0.0, "42")), 1.0) == "42"
    assert reference_answer(exchange("b", [1], " 42 ", feedback(1, 1.0)), 1.0) == "42"
    assert reference_answer(exchange("c", [1], "42", feedback(2, 0.0), feedback(1, 1.0)), 1.0) is None
    assert reference_answer(exchange("d", [1], "42", feedback(1, 0.5)), 1.0) is None
    assert reference_answer(exchange("e", [1], "   ", feedback(1, 1.0)), 1.0) is None  # nothing to judge by
    assert reference_answer(exchange("f", [1], "42"), 0.0) is None  # no feedback at all
    assert reference_answer(exchange("g", [1], "42", feedback(1, 1.0), finish_reason="length"), 1.0) is None
    assert reference_answer(exchange("h", [1], "4", feedback(1, 1.0, "42"), finish_reason="length"), 1.0) == "42"


def test_each_prompt_keeps_its_newest_outcome_and_the_split_is_stable() -> None:
    exchanges = [exchange("t1", [5, 6], "1", feedback(1, 1.0)), exchange("t2", [5, 6], "2", feedback(2, 1.0)),
                 exchange("t3", [7], "x", feedback(3, 0.0, "9"), response_ids=6),
                 exchange("t4", [8], "y", feedback(4, 0.0))]
    env = environment_from_traces(exchanges, "served", "v1", eval_fraction=0.0)
    assert sorted((tuple(t.prompt_token_ids), t.answer) for t in env.tasks) == [((5, 6), "2"), ((7,), "9")]
    assert env.sampling.max_new_tokens == 12 and env.WhichOneof("scorer") == "builtin"
    split = environment_from_traces(exchanges, "served", "v1", eval_fraction=0.5)
    assert len(split.tasks) + len(split.eval_tasks) == 2
    assert {t.metadata["trace_id"] for t in split.eval_tasks} == {
        tid for tid in ("t2", "t3") if in_eval_split(tid, 0.5)}


def test_as_sft_data_a_rewarded_response_is_its_exact_ids_and_a_correction_its_text() -> None:
    from policyloop.gateway.validation import prepare_environment

    exchanges = [exchange("t1", [5, 6], "1", feedback(1, 1.0), response_ids=3),
                 exchange("t3", [7], "x", feedback(3, 0.0, "9"), response_ids=6),
                 exchange("t4", [8], "y", feedback(4, 0.0))]
    env = environment_from_traces(exchanges, "served", "v1", eval_fraction=0.0, supervised=True)
    demos = {t.metadata["trace_id"]: t for t in env.tasks}
    assert env.supervised and set(demos) == {"t1", "t3"}
    assert list(demos["t1"].demonstration_token_ids) == [0, 1, 2] and not demos["t1"].demonstration_text
    assert demos["t3"].demonstration_text == "9" and not demos["t3"].demonstration_token_ids
    held_out = environment_from_traces(exchanges, "served", "v1", eval_fraction=1.0, supervised=True)
    assert not held_out.tasks and {t.answer for t in held_out.eval_tasks} == {"1", "9"}
    only_ids = environment_from_traces(exchanges[:1], "served", "v1", eval_fraction=0.0, supervised=True)
    prepare_environment(only_ids)  # exact ids need no tokenizer at the gateway
