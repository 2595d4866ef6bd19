"""The process around a service: settings, connections, health, heartbeats, graceful stop."""

from policyloop.runtime.service import (
    ServiceCannotStart,
    ServiceContext,
    limit_threads,
    model_directory,
    run_loops,
    run_main,
    run_pull_workers,
    serve,
)
from policyloop.runtime.settings import ServiceSettings, load_settings

__all__ = [
    "ServiceCannotStart", "ServiceContext", "ServiceSettings", "limit_threads", "load_settings", "model_directory",
    "run_loops", "run_main", "run_pull_workers", "serve",
]
