"""The arithmetic environment: disjoint deterministic splits and the strict verifier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from policyloop.envs.arithmetic import (
    ArithmeticConfig,
    Problem,
    accuracy,
    all_problems,
    heldout_problems,
    is_heldout,
    score,
    split,
    train_problems,
)

BOTH = ArithmeticConfig(digits=2, ops=("+", "-"))


def test_prompt_and_answer() -> None:
    assert Problem(12, "+", 34).prompt == "12+34="
    assert Problem(12, "+", 34).answer == "46"
    assert Problem(12, "-", 34).answer == "-22"
    assert Problem(50, "-", 50).answer == "0"


def test_config_space() -> None:
    assert ArithmeticConfig().operand_range == range(10, 100)
    assert ArithmeticConfig(digits=1).operand_range == range(0, 10)
    assert BOTH.size == 2 * 90 * 90 == len(list(all_problems(BOTH)))
    with pytest.raises(ValueError):
        ArithmeticConfig(ops=("*",))
    with pytest.raises(ValueError):
        ArithmeticConfig(heldout_fraction=1.0)


def test_split_is_exhaustive_disjoint_and_about_the_fraction() -> None:
    train, heldout = split(BOTH)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(all_problems(BOTH))
    assert all(is_heldout(p) for p in heldout) and not any(is_heldout(p) for p in train)
    assert 0.18 < len(heldout) / BOTH.size < 0.22
    for op in BOTH.ops:  # each operator is split, not one of them wholesale
        share = sum(p.op == op for p in heldout) / (BOTH.size / 2)
        assert 0.17 < share < 0.23


def test_samplers_respect_the_split_exhaustively() -> None:
    _, heldout = split(BOTH)
    heldout_set = set(heldout)
    drawn_train = train_problems(BOTH, 20_000, seed=0)
    assert not heldout_set & set(drawn_train)
    assert {p.op for p in drawn_train} == {"+", "-"}
    all_heldout = heldout_problems(BOTH, len(heldout), seed=0)
    assert set(all_heldout) == heldout_set and len(all_heldout) == len(heldout)
    with pytest.raises(ValueError):
        heldout_problems(BOTH, len(heldout) + 1, seed=0)


def test_samplers_are_deterministic_by_seed() -> None:
    config = ArithmeticConfig()
    assert train_problems(config, 100, seed=3) == train_problems(config, 100, seed=3)
    assert train_problems(config, 100, seed=3) != train_problems(config, 100, seed=4)
    assert heldout_problems(config, 50, seed=3) == heldout_problems(config, 50, seed=3)
    assert len(set(heldout_problems(config, 200, seed=1))) == 200


def test_split_is_stable_across_processes() -> None:
    """The hash is not Python's salted hash(): another interpreter agrees."""
    code = (
        "from policyloop.envs.arithmetic import ArithmeticConfig, split;"
        "print(','.join(p.prompt for p in split(ArithmeticConfig())[1][:20]))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"})
    assert other.stdout.strip() == ",".join(p.prompt for p in split(ArithmeticConfig())[1][:20])


def test_large_operands_sample_without_enumerating() -> None:
    config = ArithmeticConfig(digits=5, ops=("+", "-"))
    assert config.size > 10**9
    heldout = heldout_problems(config, 100, seed=0)
    assert len(set(heldout)) == 100 and all(is_heldout(p) for p in heldout)
    assert not any(is_heldout(p) for p in train_problems(config, 100, seed=0))


def components(result) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {c.name: c.value for c in result.breakdown}


def test_score_correct() -> None:
    result = score("46", True, "46")
    assert result.reward == pytest.approx(1.1)
    assert components(result) == {"format": 1.0, "exact_answer": 1.0}
    assert {c.name: c.weight for c in result.breakdown} == {"format": 0.1, "exact_answer": 1.0}


def test_score_wrong_but_well_formed() -> None:
    result = score("47", True, "46")
    assert result.reward == pytest.approx(0.1)
    assert components(result) == {"format": 1.0, "exact_answer": 0.0}


@pytest.mark.parametrize("text", ["46 ", " 46", "4 6", "46x", "", "-", "+46", "46\n", "4６", "46=", "--46"])
def test_score_bad_format(text: str) -> None:
    result = score(text, True, "46")
    assert result.reward == 0.0
    assert components(result) == {"format": 0.0, "exact_answer": 0.0}


def test_score_length_truncated_is_not_rewarded() -> None:
    result = score("46", False, "46")
    assert result.reward == 0.0
    assert "length" in result.breakdown[0].detail


def test_score_negative_answers_and_leading_zeros() -> None:
    assert score("-22", True, "-22").reward == pytest.approx(1.1)
    assert score("22", True, "-22").reward == pytest.approx(0.1)
    assert score("046", True, "46").reward == pytest.approx(0.1)  # well formed, not the answer
    assert score("0", True, "0").reward == pytest.approx(1.1)


def test_accuracy() -> None:
    assert accuracy(["46", "47", "-5", "12 ", "9"], ["46", "46", "-5", "12", "9"],
                    [True, True, True, True, False]) == pytest.approx(2 / 5)
    assert accuracy(["1"], ["1"], [True]) == 1.0
    with pytest.raises(ValueError):
        accuracy(["1"], ["1", "2"], [True])
    with pytest.raises(ValueError):
        accuracy([], [], [])
