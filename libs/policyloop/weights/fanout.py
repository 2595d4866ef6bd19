"""Where each replica fetches versions from: a tree under the publisher, of fan-out `fanout`.

Every replica that relays (serves Fetch from what it verified) can be a parent; leaves cannot.
A joining replica goes under the shallowest parent with room, a parent on its own node (then its
own zone) preferred as long as that costs at most one level more. Members join again within
`lease_s` or drop out; a replica whose parent failed it names that parent, which drops it. The
children of a member that dropped out keep fetching from it until it fails them, then join again
and are placed anew (with their own subtrees, never under one of their descendants)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PUBLISHER = ""  # the root's id: a placement under it fetches from the publisher


@dataclass
class TreeMember:
    replica: str
    endpoint: str  # where it relays; "" for a leaf
    node: str
    zone: str
    parent: str
    depth: int
    expires_at: float
    joined: int  # join order: earlier members are preferred among equals


@dataclass(frozen=True)
class Placement:
    parent: str  # PUBLISHER: fetch from the publisher
    parent_endpoint: str
    depth: int


class FanoutTree:
    def __init__(self, fanout: int, lease_s: float, *, node: str = "", zone: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if fanout < 1:
            raise ValueError("fanout must be at least 1")
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.fanout = fanout
        self.lease_s = lease_s
        self.node, self.zone = node, zone  # the publisher's own labels
        self.clock = clock
        self.members: dict[str, TreeMember] = {}
        # Parent id -> the members placed under it. Kept apart from the members: the children of a
        # member that dropped out still point at it until they join again.
        self.children: dict[str, set[str]] = {}
        self._joins = 0

    def join(self, replica: str, *, endpoint: str = "", node: str = "", zone: str = "",
             failed_parent: str = "") -> Placement:
        """The replica's placement: the same as before while its parent is a member, a new one
        otherwise. `failed_parent` (a member that failed this replica) is dropped first."""
        if not replica:
            raise ValueError("replica: an id is required")
        now = self.clock()
        self._expire(now)
        if failed_parent and failed_parent != replica:
            self.drop(failed_parent)
        member = self.members.get(replica)
        if member is not None and (member.endpoint, member.node, member.zone) != (endpoint, node, zone):
            # Back as something else (a leaf now, another endpoint or node): placed anew.
            self.drop(replica)
            member = None
        if member is None:
            # A new member has no children yet: any that pointed at an earlier one with this id
            # know it by what it was, and are placed anew when they join again.
            self.children.pop(replica, None)
            self._joins += 1
            member = self.members[replica] = TreeMember(replica, endpoint, node, zone, PUBLISHER, 0, now,
                                                        self._joins)
            self._place(member)
        elif not self.is_placed(replica):
            self._place(member)  # its parent dropped out
        member.expires_at = now + self.lease_s
        return self.placement(replica)

    def placement(self, replica: str) -> Placement:
        member = self.members[replica]
        parent = self.members.get(member.parent)
        return Placement(member.parent, parent.endpoint if parent is not None else "", member.depth)

    def drop(self, replica: str) -> None:
        """Takes a member out. Its children keep their parent until they join again."""
        member = self.members.pop(replica, None)
        if member is not None:
            self.children.get(member.parent, set()).discard(replica)

    def is_placed(self, replica: str) -> bool:
        """Whether the chain of parents from a member reaches the publisher, each link one its
        parent knows: not through a member that dropped out or came back as something else (so a
        member placed anew can never land under what was its own subtree)."""
        seen: set[str] = set()
        while replica != PUBLISHER:
            member = self.members.get(replica)
            if member is None or replica in seen or replica not in self.children_of(member.parent):
                return False
            seen.add(replica)
            replica = member.parent
        return True

    def children_of(self, parent: str) -> set[str]:
        """The members placed under `parent` (PUBLISHER: the root)."""
        return self.children.get(parent, set())

    @property
    def depth(self) -> int:
        return max((m.depth for m in self.members.values()), default=0)

    def _expire(self, now: float) -> None:
        for replica in [r for r, m in self.members.items() if m.expires_at < now]:
            self.drop(replica)

    def _descendants(self, replica: str) -> set[str]:
        found, todo = set(), list(self.children_of(replica))
        while todo:
            child = todo.pop()
            if child not in found:
                found.add(child)
                todo.extend(self.children_of(child))
        return found

    def _locality(self, node: str, zone: str, member: TreeMember) -> int:
        """0: same node, 1: same zone, 2: elsewhere or unknown (labels not given)."""
        if member.node and node == member.node:
            return 0
        if member.zone and zone == member.zone:
            return 1
        return 2

    def _place(self, member: TreeMember) -> None:
        self.children_of(member.parent).discard(member.replica)
        excluded = self._descendants(member.replica) | {member.replica}
        # (depth of the placement, locality, join order, parent id)
        options: list[tuple[int, int, int, str]] = []
        if len(self.children_of(PUBLISHER)) < self.fanout:
            here = 0 if self.node and self.node == member.node else 1 if self.zone and self.zone == member.zone else 2
            options.append((1, here, 0, PUBLISHER))
        for parent in self.members.values():
            room = len(self.children_of(parent.replica)) < self.fanout
            if parent.endpoint and room and parent.replica not in excluded and self.is_placed(parent.replica):
                options.append((parent.depth + 1, self._locality(member.node, member.zone, parent), parent.joined,
                                parent.replica))
        if not options:  # every parent is full: the publisher takes it beyond its fan-out
            chosen_parent, depth = PUBLISHER, 1
        else:
            shallowest = min(depth for depth, *_ in options)
            near = [o for o in options if o[0] <= shallowest + 1]
            depth, _, _, chosen_parent = min(near, key=lambda o: (o[1], o[0], o[2]))
        member.parent = chosen_parent
        self.children.setdefault(chosen_parent, set()).add(member.replica)
        self._set_depth(member, depth)

    def _set_depth(self, member: TreeMember, depth: int) -> None:
        member.depth = depth
        for child in self.children_of(member.replica):
            if child in self.members:
                self._set_depth(self.members[child], depth + 1)
