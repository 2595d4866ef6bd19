"""The side-by-side harness's figures from two curves (the whole harness runs at a small size in
tests/integration/test_perf_smoke.py, marked slow)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from single_process import CurvePoint  # noqa: E402
from vs_single_process import compare, median_or_none, side  # noqa: E402


def test_ratios_are_cluster_time_over_single_time_and_single_speed_over_cluster_speed() -> None:
    single = side([CurvePoint(0, 0, 0.2), CurvePoint(60, 240, 0.7), CurvePoint(120, 480, 0.8)], 120.0, 480)
    cluster = side([CurvePoint(0, 0, 0.2), CurvePoint(60, 120, 0.5), CurvePoint(120, 240, 0.65),
                    CurvePoint(180, 360, 0.8)], 180.0, 360)
    assert single["steps_per_s"] == 4.0 and cluster["steps_per_s"] == 2.0
    assert single["time_to_60_s"] == 48.0 and cluster["time_to_60_s"] == 100.0
    assert single["time_to_75_s"] == 90.0 and cluster["time_to_75_s"] == 160.0
    assert compare(single, cluster) == {"time_to_60_ratio": 2.083, "time_to_75_ratio": 1.778, "steps_per_s_ratio": 2.0}


def test_a_side_that_never_gets_there_has_no_ratio() -> None:
    single = side([CurvePoint(0, 0, 0.2), CurvePoint(60, 240, 0.7)], 60.0, 240)
    cluster = side([CurvePoint(0, 0, 0.2), CurvePoint(60, 100, 0.4)], 60.0, 100)
    ratios = compare(single, cluster)
    assert ratios["time_to_60_ratio"] is None and ratios["time_to_75_ratio"] is None
    # The single process reached 60% at 48 s and the cluster not in its 60 s: above 1.25.
    assert ratios["time_to_60_ratio_above"] == 1.25 and "time_to_75_ratio_above" not in ratios
    assert ratios["steps_per_s_ratio"] == 2.4
    assert median_or_none([None, 1.0, 3.0, 2.0]) == 2.0 and median_or_none([None]) is None
