"""policyloop: an RL post-training loop built from independent services over NATS and gRPC."""

__version__ = "0.1.0"
