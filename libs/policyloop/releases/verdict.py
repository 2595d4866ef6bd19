"""The regression rule: a version is flagged when even the top of its interval is below the
best pass rate the run reached before it (worse than the best by more than its interval)."""

from __future__ import annotations

from collections.abc import Iterable

from policyloop.contracts.v1 import loop_pb2


def judge(result: loop_pb2.VersionEval, earlier: Iterable[loop_pb2.VersionEval]) -> None:
    """Sets `best_version` and `regressed` on `result` against the run's earlier versions."""
    before = [e for e in earlier if e.version < result.version]
    if not before:
        result.best_version, result.regressed = 0, False
        return
    best = max(before, key=lambda e: (e.pass_rate, e.version))
    result.best_version = best.version
    result.regressed = result.pass_rate_high < best.pass_rate


ROLLBACK = "rollback"  # how a rollback's reason starts


def promotable(result: loop_pb2.VersionEval, every: int) -> bool:
    """Evaluated, not a regression, and (every > 1) a multiple of `every`."""
    return not result.regressed and (every <= 1 or result.version % every == 0)


def rule_promotes(result: loop_pb2.VersionEval, current: loop_pb2.Promotion | None, every: int) -> bool:
    """Promotion by rule: a promotable version newer than the one served. A rollback holds: the
    rule promotes nothing over it until a promotion by hand."""
    if not promotable(result, every):
        return False
    return current is None or (current.version < result.version and not current.reason.startswith(ROLLBACK))
