"""Which run a learner shared by many runs steps next.

Stride scheduling: each run has a weight (its priority) and a pass, which a step of the run
advances by 1 / weight. Among the runs that hold a full batch, the one with the lowest pass goes
next (ties: the one that went longest ago), so runs that are always ready get steps in
proportion to their weights — in turns, with equal weights. A run without a full batch is
skipped: a slow, stopped or failing run never holds up another. A run does not bank turns while
it has no batch: when it is ready again its pass is brought up to the pass of the latest step,
so it rejoins the rotation instead of taking a burst of steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class _Share:
    weight: float
    pass_value: float = 0.0
    last_turn: int = -1  # the pick that last chose it


class FairShare:
    def __init__(self) -> None:
        self._shares: dict[str, _Share] = {}
        self._clock = 0.0         # the pass at which the latest step was taken
        self._picks = 0
        self._ready_before: set[str] = set()

    def add(self, run_id: str, weight: float = 1.0) -> None:
        """A run joins (again: its weight changes, its place stays)."""
        if not weight > 0:
            raise ValueError(f"weight must be positive, not {weight}")
        share = self._shares.get(run_id)
        if share is None:
            self._shares[run_id] = _Share(weight, pass_value=self._clock)
        else:
            share.weight = weight

    def remove(self, run_id: str) -> None:
        self._shares.pop(run_id, None)
        self._ready_before.discard(run_id)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._shares

    def pick(self, ready: Iterable[str]) -> str | None:
        """The run to step now among `ready` (those holding a full batch; unknown ones are
        ignored), counted as stepped; None when none is ready."""
        candidates = [r for r in dict.fromkeys(ready) if r in self._shares]
        for run_id in candidates:
            if run_id not in self._ready_before:  # back from having no batch: no banked turns
                share = self._shares[run_id]
                share.pass_value = max(share.pass_value, self._clock)
        self._ready_before = set(candidates)
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (self._shares[r].pass_value, self._shares[r].last_turn))
        share = self._shares[chosen]
        self._clock = share.pass_value
        share.pass_value += 1.0 / share.weight
        share.last_turn = self._picks
        self._picks += 1
        return chosen
