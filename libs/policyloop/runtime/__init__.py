"""The process around a service: settings, connections, health, heartbeats, graceful stop."""

from policyloop.runtime.service import (
    ServiceCannotStart,
    ServiceContext,
    limit_threads,
    run_main,
    run_pull_workers,
    serve,
)
from policyloop.runtime.settings import ServiceSettings, load_settings

__all__ = [
    "ServiceCannotStart", "ServiceContext", "ServiceSettings", "limit_threads", "load_settings", "run_main",
    "run_pull_workers", "serve",
]
