"""Where a step's wall time goes: consecutive phases timed on one clock, so that the phases of a
step add up to its wall time (policyloop_learner_phase_seconds, perf/step_profile.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


class PhaseClock:
    """`lap(name)` ends the phase running since the last lap (or the start) and files its time
    under `name` (added up when a name comes again). `sync`, called before each lap, waits for
    work queued on an accelerator, so that its time is filed under the phase that queued it.
    `ended_ns` keeps the wall-clock time each phase last ended (spans are in wall-clock time)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync
        self.mark = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.ended_ns: dict[str, int] = {}

    def lap(self, name: str) -> float:
        self.sync()
        now = time.perf_counter()
        elapsed, self.mark = now - self.mark, now
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        self.ended_ns[name] = time.time_ns()
        return elapsed
