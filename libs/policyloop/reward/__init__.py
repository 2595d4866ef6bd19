"""The reward role: `handler` turns a Rollout into a scored Trajectory on TRAJECTORIES, scored by
its task's typed scorer through the scorer registry (policyloop.scorers)."""
