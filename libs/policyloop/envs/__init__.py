"""Environments: the built-in task sets (arithmetic, code) and the tools a multi-turn environment
offers the policy (their markers and formats). Running episodes is the rollout's
(`policyloop.rollout.episodes`); scoring is the scorers' (`policyloop.scorers`). `spec` reads what an
environment definition fixes for each task."""
