"""Environments: the built-in task sets (arithmetic, code), the tools a multi-turn environment
offers the policy (their markers and formats), and episodes: the one loop that drives every
sample (`episode`) and the python tool's episodes (`tool_episodes`), used by the rollout replica
and the evaluator alike. Scoring is the scorers' (`policyloop.scorers`). `spec` reads what an
environment definition fixes for each task."""
