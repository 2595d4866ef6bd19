"""A run's LoRA spec at the gateway: checked field by field (INVALID_ARGUMENT naming lora.<field>),
defaults filled in, and matched against what the running learner trains (FAILED_PRECONDITION)."""

from __future__ import annotations

import pytest

from policyloop.contracts.v1 import loop_pb2, status_pb2
from policyloop.gateway.errors import FailedPrecondition, InvalidField
from policyloop.gateway.validation import check_run_against_learner, lora_spec, validate_start_run
from policyloop.rl.settings import DEFAULT_TARGET_MODULES, LoraSpec


def run(**lora: object) -> loop_pb2.StartRunRequest:
    request = loop_pb2.StartRunRequest(environments=[loop_pb2.EnvironmentMix(environment="addition@demo", weight=1)])
    if lora:
        request.lora.CopyFrom(loop_pb2.LoraSpec(**lora))
    return request


@pytest.mark.parametrize(("lora", "field"), [
    ({"rank": 2000}, "lora.rank"),
    ({"rank": 8, "alpha": -1.0}, "lora.alpha"),
    ({"dropout": 1.5}, "lora.dropout"),
    ({"target_modules": ["q_proj", "q_proj"]}, "lora.target_modules"),
    ({"target_modules": ["layers.0.q_proj"]}, "lora.target_modules"),
])
def test_a_bad_lora_spec_is_refused_naming_its_field(lora: dict, field: str) -> None:
    with pytest.raises(InvalidField) as refused:
        validate_start_run(run(**lora))
    assert str(refused.value).startswith(f"{field}:")


def test_unset_fields_take_their_defaults_and_round_trip() -> None:
    spec = lora_spec(loop_pb2.LoraSpec(rank=8))
    assert spec == LoraSpec(rank=8, alpha=16.0, dropout=0.0, target_modules=DEFAULT_TARGET_MODULES)
    assert lora_spec(loop_pb2.LoraSpec()).rank == 16
    assert LoraSpec.from_proto(spec.to_proto()) == spec
    validate_start_run(run(rank=4, target_modules=["q_proj", "v_proj"]))


def test_a_run_must_match_what_the_learner_trains() -> None:
    loop = status_pb2.LoopConfig(model="policy", max_lag=1)
    full = status_pb2.LearnerStatus(loop=loop, full_model=True)
    many = status_pb2.LearnerStatus(loop=loop, lora_runs=True)
    both = status_pb2.LearnerStatus(loop=loop, full_model=True, lora_runs=True, tinker=True)
    with pytest.raises(FailedPrecondition, match="^lora: the cluster's learner trains no LoRA runs"):
        check_run_against_learner(run(rank=16), full)
    with pytest.raises(FailedPrecondition, match="^lora: the cluster's learner trains LoRA runs only"):
        check_run_against_learner(run(), many)
    check_run_against_learner(run(), full)
    check_run_against_learner(run(rank=16), many)
    check_run_against_learner(run(), both)  # one learner for every kind: either run is taken
    check_run_against_learner(run(rank=16), both)
    check_run_against_learner(run(rank=16), None)  # no learner up yet: only the spec itself is checked
