"""The ledger audit: every generated trajectory is accounted for, or counted lost."""

from __future__ import annotations

from policyloop.contracts.v1 import bus_pb2
from policyloop.ledger import DROPPED, GENERATED, TRAINED, audit, regroup

E = bus_pb2.LedgerEvent


def generated(*ids: str) -> bus_pb2.LedgerEvent:
    return E(kind=GENERATED, trajectory_ids=ids)


def trained(version: int, *ids: str, manifest: str = "") -> bus_pb2.LedgerEvent:
    return E(kind=TRAINED, policy_version=version, step=version, trajectory_ids=ids,
             manifest_hash=manifest or f"m{version}")


def test_every_fate_is_counted_and_the_rest_is_lost() -> None:
    events = [generated("a/0", "a/1"), generated("b/0", "b/1"), generated("c/0", "c/1"), generated("d/0", "d/1"),
              trained(1, "a/0", "a/1"), E(kind=DROPPED, reason="stale", trajectory_ids=["b/0", "b/1"])]
    report = audit(events, scored=["a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "d/0"], dead_lettered=["c/0"],
                   pending=["c/1", "d/0"])
    assert report.generated == 8 and report.scored == 7 and report.trained == 2 and report.steps == 1
    assert report.dropped == {"stale": 2} and report.dead_lettered == 1 and report.pending == 2
    assert report.lost == 1 and report.lost_ids == ["d/1"]
    assert report.trained_twice == 0 and report.versions_monotonic


def test_a_trajectory_in_two_steps_is_trained_twice() -> None:
    report = audit([generated("a/0"), trained(1, "a/0"), trained(2, "a/0")])
    assert report.trained_twice == 1 and report.twice_ids == ["a/0"] and report.trained == 1


def test_a_replayed_step_recorded_again_is_not_a_reuse() -> None:
    report = audit([generated("a/0", "b/0"), trained(1, "a/0"), trained(1, "a/0"), trained(2, "b/0")])
    assert report.versions_monotonic and report.trained_twice == 0 and report.steps == 2


def test_reused_or_skipped_versions_are_caught() -> None:
    reused = audit([generated("a/0", "b/0"), trained(1, "a/0"), trained(1, "b/0", manifest="other")])
    assert not reused.versions_monotonic
    gap = audit([generated("a/0", "b/0"), trained(1, "a/0"), trained(3, "b/0")])
    assert not gap.versions_monotonic


def test_a_dropped_then_trained_trajectory_counts_as_trained() -> None:
    # A redelivered copy of a trained sample can be dropped later: the sample's fate is trained.
    report = audit([generated("a/0"), trained(1, "a/0"), E(kind=DROPPED, reason="stale", trajectory_ids=["a/0"])])
    assert report.trained == 1 and report.dropped == {} and report.lost == 0


def test_regroup_splits_batch_order_into_groups() -> None:
    samples = [bus_pb2.Trajectory(trajectory_id=f"{g}/{i}", group_id=g) for g in ("x", "y") for i in range(2)]
    assert [[t.trajectory_id for t in group] for group in regroup(samples)] == [["x/0", "x/1"], ["y/0", "y/1"]]


def test_trained_ids_never_recorded_as_generated_are_a_gap_not_ignored() -> None:
    report = audit([generated("a/0"), trained(1, "a/0", "x/0", "x/1")])
    assert report.trained == 1 and report.trained_not_generated == 2 and report.lost == 0


def test_each_model_has_its_own_version_sequence_and_a_run_can_be_audited_alone() -> None:
    from policyloop.ledger import of_run

    def step(model: str, version: int, *ids: str) -> bus_pb2.LedgerEvent:
        return E(kind=TRAINED, model=model, policy_version=version, step=version, trajectory_ids=ids,
                 manifest_hash=f"{model}{version}")

    events = [generated("ra:1/0", "ra:2/0", "rb:1/0", "rb:2/0"), step("policy.lora.ra", 1, "ra:1/0"),
              step("policy.lora.rb", 1, "rb:1/0"), step("policy.lora.ra", 2, "ra:2/0"),
              step("policy.lora.rb", 2, "rb:1/0")]  # rb trains a sample twice
    whole = audit(events)
    assert whole.versions_monotonic and whole.steps == 4 and whole.trained_twice == 1
    ra, rb = audit(of_run("ra", events)), audit(of_run("rb", events))
    assert (ra.generated, ra.trained, ra.trained_twice, ra.lost, ra.steps) == (2, 2, 0, 0, 2)
    assert (rb.generated, rb.trained, rb.trained_twice, rb.lost, rb.twice_ids) == (2, 1, 1, 1, ["rb:1/0"])
    skipped = audit([generated("ra:1/0"), step("policy.lora.ra", 1, "ra:1/0"), step("policy.lora.rb", 2, "rb:1/0")])
    assert not skipped.versions_monotonic  # rb's sequence starts at 2
