"""Prometheus for the local cluster: the package's scrape configuration and alert rules copied
into the run directory, a file-based service discovery file listing every service instance's
/metrics (rewritten whenever the set of processes or their ports change), and the server itself
on a free port with its data beside them."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CONFIG_FILES = ("prometheus.yml", "alerts.yml")
TARGETS_FILE = "targets/local.json"


@dataclass(frozen=True)
class ScrapeTarget:
    """One process whose /metrics Prometheus reads."""

    service: str     # gateway, rollout, …
    instance: str    # rollout-0, …
    address: str     # host:port of its HTTP server

    def entry(self) -> dict[str, object]:
        return {"targets": [self.address], "labels": {"service": self.service, "instance": self.instance}}


def write_config(directory: Path) -> Path:
    """The shared configuration, as shipped in policyloop.telemetry/prometheus, into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    shipped = resources.files("policyloop.telemetry").joinpath("prometheus")
    for name in CONFIG_FILES:
        (directory / name).write_bytes(shipped.joinpath(name).read_bytes())
    (directory / "targets").mkdir(exist_ok=True)
    return directory / "prometheus.yml"


def write_targets(directory: Path, targets: Iterable[ScrapeTarget]) -> Path:
    """The discovery file, replaced atomically (Prometheus re-reads it on change)."""
    path = directory / TARGETS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([t.entry() for t in sorted(targets, key=lambda t: t.instance)], indent=2))
    tmp.replace(path)
    return path


def prometheus_binary() -> str | None:
    """Where prometheus is installed, or None (the cluster then runs without it)."""
    return shutil.which("prometheus")


def prometheus_command(binary: str, directory: Path, port: int) -> list[str]:
    """The server on 127.0.0.1:`port`, its configuration and TSDB in `directory`."""
    return [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=15d",
            "--web.enable-lifecycle"]


def wait_ready(url: str, timeout_s: float) -> bool:
    """Whether Prometheus at `url` answers /-/ready within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
