"""reward: scores Rollouts and publishes Trajectories."""
