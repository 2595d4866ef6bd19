"""A replay reads its step's trajectories from the group messages in TRAJECTORIES, against a
real NATS: each group once, members by id; a record naming what a group does not hold is refused."""

from __future__ import annotations

import pytest

from policyloop.bus import Bus, trajectories_subject
from policyloop.ledger import stored_trajectories
from tests.helpers import publish_group, scored_group


async def test_members_are_read_by_id_from_their_groups_message(bus: Bus) -> None:
    a, b = scored_group("a", size=3), scored_group("b")
    seq_a = await publish_group(bus, trajectories_subject("e"), *a)
    seq_b = await publish_group(bus, trajectories_subject("e"), *b)
    ids = ["b/1", "a/2", "a/0", "b/0"]
    read = await stored_trajectories(bus, ids, [seq_b, seq_a, seq_a, seq_b])
    assert [t.trajectory_id for t in read] == ids and read[1] == a[2]


async def test_a_record_that_does_not_match_what_trajectories_holds_is_refused(bus: Bus) -> None:
    seq = await publish_group(bus, trajectories_subject("e"), *scored_group("a"))
    with pytest.raises(LookupError, match=f"the group at TRAJECTORIES sequence {seq} has no trajectory z/0"):
        await stored_trajectories(bus, ["a/0", "z/0"], [seq, seq])
    with pytest.raises(LookupError, match="no longer holds sequence 99"):
        await stored_trajectories(bus, ["a/0"], [99])
    with pytest.raises(ValueError, match="2 trajectory ids for 1 sequences"):
        await stored_trajectories(bus, ["a/0", "a/1"], [seq])
