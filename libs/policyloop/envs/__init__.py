"""Environments: validation of user submissions and how a run's tasks are drawn from them."""
