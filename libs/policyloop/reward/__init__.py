"""The reward role: scoring rollouts by their task's typed scorer (policyloop.v1.Scorer).

Built-in verifiers run in this process (`verifiers`); unit tests and a team's reward code run as
sandbox jobs (`unit_tests` with its `unit_test_harness`, `reward_code`), never here; `answer`
is the part of a trajectory they judge. `registry` maps each scorer kind to what
scores it, and `handler` turns a Rollout into a scored Trajectory on TRAJECTORIES.
"""
