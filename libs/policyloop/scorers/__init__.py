"""Scoring a trajectory by its task's typed scorer (policyloop.v1.Scorer), shared by the roles that
judge samples: the reward service (training rewards) and the evaluator (eval splits).

Built-in verifiers run in the caller's process (`verifiers`); unit tests and a team's reward code
run as sandbox jobs (`unit_tests` with its `unit_test_harness`, `reward_code`), never there;
`answer` is the part of a trajectory they judge. `registry` maps each scorer kind to what scores it.
"""
