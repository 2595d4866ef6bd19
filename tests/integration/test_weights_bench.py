"""The weight-sync harness runs end to end on a small model: every figure is present and the
replicas end exact (the figures themselves are measured with the default size, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_weights_bench_prints_every_figure(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "perf" / "weights_bench.py"), "--params", "3e5", "--hidden", "64",
         "--vocab", "512", "--versions", "2", "--publish-versions", "1", "--soak", "20", "--soak-params", "1e5",
         "--threads", "1", "--out", str(tmp_path / "out"), "--tmp-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    for key in ("params", "raw_bytes", "delta_bytes", "ratio", "changed_fraction", "cores", "encode_gbps",
                "decode_gbps", "crossover_gbps"):
        assert key in figures, key
    assert figures["exact"] and figures["publish_exact"] and figures["soak_exact"]
    assert figures["soak_final_version"] == 21 and figures["params"] >= 3e5
    assert figures["delta_bytes"] < figures["raw_bytes"]
    cases = {f"{mode}_{link}_{c}c" for mode in ("full", "delta") for link in ("unthrottled", "10gbps", "1gbps")
             for c in (1, 4)}
    assert set(figures["publish"]) == cases and all(v > 0 for v in figures["publish"].values())
    assert (tmp_path / "out" / "publish_latency.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "result.json").read_text()) == figures
