"""JSON logs through structlog, with service, run_id, instance and policy_version bound."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, service: str, run_id: str, instance: str, level: str = "INFO") -> None:
    """Sends every log line to stderr as one JSON object carrying the service's identity.

    The identity is process-wide (not a contextvar) so that lines from every asyncio task
    carry the current policy version after `bind_policy_version` changes it.
    """
    log_level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(log_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _IDENTITY.clear()
    _IDENTITY.update(service=service, run_id=run_id, instance=instance, policy_version=0)
    # Libraries that use the standard logging module (nats, grpc) go to stderr too.
    logging.basicConfig(level=max(log_level, logging.WARNING), stream=sys.stderr)


_IDENTITY: dict[str, object] = {}


def _add_identity(_logger: object, _method: str, event: dict[str, object]) -> dict[str, object]:
    for key, value in _IDENTITY.items():
        event.setdefault(key, value)
    return event


def bind_policy_version(version: int) -> None:
    _IDENTITY["policy_version"] = version


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
