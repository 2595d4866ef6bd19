"""rollout: pulls Tasks, samples a group of completions per task, publishes Rollouts."""
