"""The fan-out tree's placements: full levels before deeper ones, fan-out respected (the publisher
takes more only when no relay has room), the same node (then zone) first, leases, failed parents
dropped and their children placed anew, never a cycle."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyloop.weights.fanout import PUBLISHER, FanoutTree


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_shape(tree: FanoutTree) -> None:
    """Each member's depth is its parent's plus one, a parent has at most `fanout` children, a leaf
    none, and following parents always reaches the publisher."""
    for member in tree.members.values():
        if not tree.is_placed(member.replica):
            continue  # its parent dropped out: placed anew when it joins again
        parent = tree.members.get(member.parent)
        if member.parent == PUBLISHER:
            assert member.depth == 1
        elif parent is not None:
            assert parent.endpoint and member.depth == parent.depth + 1
            assert member.replica in tree.children_of(parent.replica)
        seen, walk = set(), member
        while walk.parent != PUBLISHER and walk.parent in tree.members and tree.is_placed(walk.replica):
            assert walk.replica not in seen, "a cycle"
            seen.add(walk.replica)
            walk = tree.members[walk.parent]
    for member in tree.members.values():
        live = [c for c in tree.children_of(member.replica) if c in tree.members and tree.is_placed(c)]
        assert all(tree.members[c].parent == member.replica for c in live)
        assert len(live) <= tree.fanout
        assert member.endpoint or not live


def test_levels_fill_before_deeper_ones_and_the_depth_is_the_logarithm() -> None:
    tree = FanoutTree(fanout=4, lease_s=60)
    for i in range(1000):
        tree.join(f"r{i}", endpoint=f"10.0.0.{i % 250}:{7000 + i}")
    check_shape(tree)
    # 4 + 16 + 64 + 256 = 340 members fill four levels; the rest are at depth 5.
    assert tree.depth == 5 == math.ceil(math.log(1000 * 3 / 4 + 1, 4))
    assert sum(m.depth == 1 for m in tree.members.values()) == 4


def test_a_parent_on_the_same_node_then_the_same_zone_is_preferred_within_one_level() -> None:
    tree = FanoutTree(fanout=2, lease_s=60)
    tree.join("a", endpoint="a:1", node="n1", zone="z1")
    tree.join("b", endpoint="b:1", node="n2", zone="z2")
    assert tree.join("c", endpoint="c:1", node="n2", zone="z2").parent == "b"  # same node
    assert tree.join("d", endpoint="d:1", node="n3", zone="z1").parent == "a"  # same zone
    assert tree.join("e", endpoint="e:1", node="n2", zone="z2").parent == "b"
    # b is full: a node-mate of b goes under c (b's child, same node), one level deeper.
    placed = tree.join("f", endpoint="f:1", node="n2", zone="z2")
    assert (placed.parent, placed.depth) == ("c", 3)
    check_shape(tree)


def test_the_placement_is_stable_while_the_parent_lives_and_renewed_by_joining() -> None:
    clock = Clock()
    tree = FanoutTree(fanout=1, lease_s=10, clock=clock)
    tree.join("a", endpoint="a:1")
    assert tree.join("b", endpoint="b:1").parent == "a"
    clock.now = 8
    assert tree.join("b", endpoint="b:1").parent == "a"  # b renews; a's lease runs out at 10
    clock.now = 12
    placed = tree.join("b", endpoint="b:1")
    assert (placed.parent, placed.depth) == (PUBLISHER, 1) and "a" not in tree.members


def test_a_failed_parent_is_dropped_and_its_children_placed_anew_with_their_subtrees() -> None:
    tree = FanoutTree(fanout=2, lease_s=60)
    for name in "abcdefg":
        tree.join(name, endpoint=f"{name}:1")
    # a, b under the publisher; c, d under a; e, f under b; g under c.
    assert tree.placement("g").parent == "c"
    placed = tree.join("c", endpoint="c:1", failed_parent="a")
    assert "a" not in tree.members and placed.parent == PUBLISHER  # a's place at the root is free
    assert tree.placement("g") == tree.placement("g") and tree.members["g"].depth == 2  # moved with c
    assert tree.join("d", endpoint="d:1").parent not in ("a", "d", "g")
    check_shape(tree)


def test_a_replica_is_never_placed_under_its_own_descendant() -> None:
    tree = FanoutTree(fanout=1, lease_s=60)
    for name in "abcd":
        tree.join(name, endpoint=f"{name}:1")  # a chain: a ← b ← c ← d
    placed = tree.join("b", endpoint="b:1", failed_parent="a")
    assert placed.parent == PUBLISHER and tree.members["d"].depth == 3
    check_shape(tree)


def test_a_member_back_after_being_dropped_is_not_placed_under_its_old_grandchild() -> None:
    tree = FanoutTree(fanout=1, lease_s=60)
    for name in ("p", "c", "g"):
        tree.join(name, endpoint=f"{name}:1")  # a chain: p ← c ← g
    tree.join("x", failed_parent="p")  # a leaf reports p: dropped, its place at the root taken by x
    placed = tree.join("p", endpoint="p:1")
    assert placed.parent not in ("c", "g")  # c and g hang from the old p: not placed until they join
    assert not tree.is_placed("c") and not tree.is_placed("g")
    check_shape(tree)


def test_leaves_take_no_children_and_a_returning_replica_with_new_labels_is_placed_anew() -> None:
    tree = FanoutTree(fanout=1, lease_s=60)
    tree.join("leaf")  # no relay endpoint
    placed = tree.join("relay", endpoint="relay:1")
    assert placed.parent == PUBLISHER  # the root is full, and a leaf takes no child: over the fan-out
    assert tree.join("other", endpoint="o:1").parent == "relay"
    assert tree.join("relay", endpoint="relay:2").parent != "other"
    with pytest.raises(ValueError, match="replica"):
        tree.join("")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(-1, 30),
                                             st.sampled_from(["", "n1", "n2"])), max_size=80))
def test_any_sequence_of_joins_and_failures_keeps_the_tree_sound(fanout: int, events: list) -> None:
    tree = FanoutTree(fanout=fanout, lease_s=60)
    for replica, relays, failed, node in events:
        tree.join(f"r{replica}", endpoint=f"h:{replica}" if relays else "", node=node, zone=node[:1],
                  failed_parent=f"r{failed}" if failed >= 0 else "")
        check_shape(tree)
