"""docs/metrics.md lists every metric the services define, with its type and labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

import policyloop.telemetry.metrics as metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def defined() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Sample name (counters with _total) → (type, labels) of every metric in the module."""
    out = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name + ("_total" if value._type == "counter" else "")
            out[name] = (value._type, tuple(value._labelnames))
    return out


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = re.findall(r"^\| `(policyloop_\w+)` \| (\w+) \|\s*([\w, ]*?)\s*\|", DOC.read_text(), re.M)
    return {name: (kind, tuple(label.strip() for label in labels.split(",") if label.strip()))
            for name, kind, labels in rows}


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    assert documented() == defined()


def test_the_run_label_is_bounded() -> None:
    from policyloop.telemetry.metrics import RunLabels

    labels = RunLabels(2)
    assert [labels(r) for r in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]
