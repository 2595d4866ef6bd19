"""RL logic as pure functions: advantages, policy losses, log-probabilities, batching."""
