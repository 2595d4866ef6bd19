"""`policyloop demo` checks its objective flags before it starts anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("flags", "named"), [
    (["--loss", "dpo"], "Input should be 'ppo', 'gspo' or 'cispo'"),
    (["--off-policy", "sometimes"], "Input should be 'none', 'tis' or 'decoupled'"),
    (["--off-policy", "tis", "--tis-cap", "0"], "tis_cap"),
    (["--weight-update-mode", "sideways"], "--weight-update-mode must be one of"),
])
def test_demo_refuses_an_unknown_objective(flags: list[str], named: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run([sys.executable, "-m", "policyloop", "demo", "--run-dir", str(tmp_path / "run"), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and named in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()  # no cluster was started
