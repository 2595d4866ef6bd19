"""GRPO pieces as pure functions, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from policyloop.contracts.v1 import bus_pb2
from policyloop.contracts.versions import sample_lag
from policyloop.rl.advantages import group_advantages
from policyloop.rl.batching import Admission, GroupCollector
from policyloop.rl.logprobs import pack, response_values


def test_group_advantages() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # no signal in a uniform group
    assert torch.allclose(group_advantages(rewards, scale_by_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4))


def test_clipping_boundaries_and_the_clipped_loss_value() -> None:
    from policyloop.rl.losses import loss_settings
    from policyloop.rl.objective import BatchCounts, objective

    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    result = objective(loss_settings(clip_low=0.2, clip_high=0.3), logp, adv, torch.ones(1, 4),
                       BatchCounts(tokens=4, sequences=1, width=4), behaviour_logprobs=old)
    result.loss.backward()
    stats = result.statistics
    # ratio 1.5 > 1.3 with A>0 and ratio 0.5 < 0.8 with A<0 are clipped (no gradient);
    # the other two are not (the pessimistic min keeps the unclipped term).
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert stats["clip_fraction"] == 0.5
    expected = -(1.3 * 1 + 1.5 * -1 + 0.5 * 1 + 0.8 * -1) / 4
    assert math.isclose(stats["loss"], expected, rel_tol=1e-5)


def test_pack_places_responses_after_prompts() -> None:
    batch = pack([[5, 6], [7]], [[1, 2, 3], [4]], [[True, False, True], [True]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]
    assert batch.targets.tolist() == [[6, 1, 2, 3], [4, 0, 0, 0]]
    values = response_values([[-0.1, -0.2, -0.3], [-0.4]], [[5, 6], [7]], 5)
    assert torch.allclose(values, torch.tensor([[0, -0.1, -0.2, -0.3], [-0.4, 0, 0, 0]]))


def traj(group: str, index: int, size: int = 2, versions: tuple[int, ...] = (3,)) -> bus_pb2.Trajectory:
    spans = [bus_pb2.VersionSpan(version=v, start=i, end=i + 1) for i, v in enumerate(versions)]
    return bus_pb2.Trajectory(trajectory_id=f"{group}/{index}", group_id=group, sample_index=index,
                              group_size=size, version_spans=spans)


def test_group_collector_completes_groups_in_order_and_refuses_duplicates() -> None:
    collector = GroupCollector()
    assert collector.add(traj("a", 0)) is Admission.PENDING
    assert collector.add(traj("b", 0)) is Admission.PENDING
    assert collector.add(traj("a", 0)) is Admission.DUPLICATE
    assert collector.add(traj("b", 1)) is Admission.COMPLETE
    assert collector.add(traj("a", 1)) is Admission.COMPLETE
    assert collector.add(traj("a", 1)) is Admission.DUPLICATE
    [first] = collector.take(1)
    assert [t.trajectory_id for t in first] == ["b/0", "b/1"]
    collector.trained.add_step(t.trajectory_id for t in first)
    assert collector.add(traj("b", 0)) is Admission.DUPLICATE  # trained already
    assert collector.complete_groups == 1


def test_recent_steps_remember_a_bounded_window() -> None:
    from policyloop.rl.batching import RecentSteps

    recent = RecentSteps(window=2, steps=[["a/0", "a/1"], ["b/0"]])
    assert "a/0" in recent and "b/0" in recent and len(recent) == 3
    recent.add_step(["c/0"])
    assert "a/0" not in recent and "a/1" not in recent and "c/0" in recent
    assert list(recent.steps) == [["b/0"], ["c/0"]]


def test_sample_lag_uses_the_oldest_token() -> None:
    assert sample_lag(traj("a", 0, versions=(4, 5, 5)), trained_version=6) == 2
    assert sample_lag(bus_pb2.Trajectory(), trained_version=6) == 0


def test_split_stale_drops_whole_groups_beyond_the_bound() -> None:
    from policyloop.contracts.v1 import bus_pb2
    from policyloop.rl.batching import split_stale

    def sample(version: int) -> bus_pb2.Trajectory:
        return bus_pb2.Trajectory(version_spans=[bus_pb2.VersionSpan(version=version, start=0, end=1),
                                                 bus_pb2.VersionSpan(version=version + 1, start=1, end=2)])

    fresh_group, mixed_group = [sample(3), sample(3)], [sample(3), sample(1)]
    fresh, stale = split_stale([fresh_group, mixed_group], training_version=4, max_lag=1)
    assert fresh == [fresh_group] and stale == [mixed_group]  # the oldest token decides
    assert split_stale([mixed_group], 4, -1) == ([mixed_group], [])
    assert split_stale([fresh_group], 3, 0) == ([fresh_group], [])


def test_groups_from_older_versions_are_taken_first() -> None:
    from policyloop.rl.batching import GroupCollector

    def member(group: str, index: int, version: int) -> bus_pb2.Trajectory:
        return bus_pb2.Trajectory(trajectory_id=f"{group}/{index}", group_id=group, sample_index=index, group_size=1,
                                  version_spans=[bus_pb2.VersionSpan(version=version, start=0, end=1)])

    collector = GroupCollector()
    for group, version in (("new", 5), ("late-old", 3), ("newer", 6), ("also-5", 5)):
        collector.add(member(group, 0, version))
    taken = collector.take(3)
    assert [g[0].group_id for g in taken] == ["late-old", "new", "also-5"]  # ties keep completion order
    assert [g[0].group_id for g in collector.take(3)] == ["newer"]


def test_a_runs_last_groups_are_taken_alone_and_its_incomplete_ones_discarded() -> None:
    """A run's last groups go as a batch they do not fill, of one kind and of that run only; a run
    that ended gives up the groups still missing members."""
    def member(run: str, group: str, index: int, size: int, supervised: bool = False) -> bus_pb2.Trajectory:
        return bus_pb2.Trajectory(trajectory_id=f"{group}/{index}", group_id=group, sample_index=index,
                                  group_size=size, run_id=run, supervised=supervised)

    collector = GroupCollector()
    for sample in (member("a", "a1", 0, 1), member("b", "b1", 0, 1), member("a", "a2", 0, 1, supervised=True),
                   member("a", "a3", 0, 1), member("c", "c1", 0, 2)):
        collector.add(sample)
    assert collector.runs() == {"a": 3, "b": 1, "c": 0}  # c: an incomplete group only
    assert [g[0].group_id for g in collector.take(8, {"a"})] == ["a1", "a3"]  # the oldest one's kind
    assert [g[0].group_id for g in collector.take(8, {"a"})] == ["a2"]
    assert [[t.trajectory_id for t in g] for g in collector.discard_incomplete("c")] == [["c1/0"]]
    assert collector.runs() == {"b": 1} and collector.discard_incomplete("b") == []
    assert collector.kinds == {False: 1, True: 0} and collector.has_batch(1) and not collector.has_batch(2)


def test_lr_schedule_warms_up_then_holds_or_decays_to_its_floor() -> None:
    from policyloop.rl.trainer import LrSchedule, TrainerConfig

    constant = LrSchedule(TrainerConfig(warmup_steps=4))
    assert [constant(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = LrSchedule(TrainerConfig(warmup_steps=2, schedule="cosine", decay_steps=6, min_lr_ratio=0.1))
    values = [cosine(s) for s in range(9)]
    assert values[:3] == [0.5, 1.0, 1.0] and values[4] == pytest.approx(0.55)
    assert values[6:] == [pytest.approx(0.1)] * 3 and all(a >= b for a, b in zip(values[2:-1], values[3:], strict=True))
    with pytest.raises(ValueError, match="decay_steps"):
        LrSchedule(TrainerConfig(schedule="cosine", warmup_steps=5, decay_steps=5))
