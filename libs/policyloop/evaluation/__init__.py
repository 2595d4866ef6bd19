"""The evaluator role: it scores a run's eval splits on each k-th version, on an engine pinned to
that version (`scoring`, `evaluator`), records the result and promotes by rule
(policyloop.releases)."""
