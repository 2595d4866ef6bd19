"""Wall-clock time as the wire formats carry it."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Unix time in whole milliseconds (the `*_unix_ms` fields of every message)."""
    return int(time.time() * 1000)
