"""Refusals of LoopService requests. Every error names the offending field, so the gateway can
answer with a message a user can act on."""

from __future__ import annotations


class InvalidField(ValueError):
    """INVALID_ARGUMENT: the request is malformed."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class FailedPrecondition(InvalidField):
    """FAILED_PRECONDITION: the request is well formed, but the cluster does not do what it asks."""
