"""Logging (structlog, JSON) and Prometheus metrics shared by every service."""
