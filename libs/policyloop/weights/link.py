"""A byte-rate limit on a transfer path: models a network link of a given speed (the perf
harness emulates 10 and 1 Gbit/s with it) and caps a publisher's egress in production so that
weight traffic does not starve everything else on the NIC."""

from __future__ import annotations

import asyncio
import time


class LinkLimit:
    """Bytes pass at most at `gbps` gigabits per second, shared by every stream that uses it
    (first come, first served, like frames queued on one link). 0 means no limit."""

    def __init__(self, gbps: float) -> None:
        if gbps < 0:
            raise ValueError("gbps must not be negative")
        self.bytes_per_s = gbps * 1e9 / 8
        self._free_at = 0.0

    @property
    def limited(self) -> bool:
        return self.bytes_per_s > 0

    async def take(self, nbytes: int) -> None:
        """Returns when `nbytes` have crossed the link."""
        if not self.limited or nbytes <= 0:
            return
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        await asyncio.sleep(self._free_at - now)
