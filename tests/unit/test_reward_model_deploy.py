"""`policyloop up --reward-model`'s engine process beside the services: waited for on its /health,
listed by `up` with its /classify address, and shown by `top` as a process without a health report
of its own. (The processes and settings `up` starts are checked against compose and Kubernetes in
tests/unit/test_k8s.py.)"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from policyloop.cluster import local
from policyloop.cluster.local import ClusterError, ClusterInfo, ManagedProcess
from policyloop.cluster.scrape import Sample, Scrape
from policyloop.cluster.top import Ledger, render


def _engine_on(port: int, tmp_path: Path) -> ManagedProcess:
    return ManagedProcess(f"{local.REWARD_MODEL}-0", ["engine"], {}, tmp_path / "engine.log", {"http": port})


@pytest.fixture
def health_server() -> Iterator[tuple[int, list[int]]]:
    """An HTTP server answering /health with the first of `statuses` (then the next, …)."""
    statuses: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], statuses
    finally:
        server.shutdown()
        server.server_close()


def test_up_waits_for_the_engine_to_answer_its_health(health_server: tuple[int, list[int]], tmp_path: Path) -> None:
    port, statuses = health_server
    statuses += [503, 503, 200]  # loading, then ready
    local.wait_engine_healthy(_engine_on(port, tmp_path), timeout_s=10)
    assert statuses == [200]
    statuses[0] = 503
    with pytest.raises(ClusterError, match=rf"reward-model-0 at http://127.0.0.1:{port}/health is not healthy"):
        local.wait_engine_healthy(_engine_on(port, tmp_path), timeout_s=0.5)


def test_up_reports_an_engine_that_exits_before_it_is_healthy(tmp_path: Path) -> None:
    engine = _engine_on(1, tmp_path)  # nothing listens on port 1
    engine.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    engine.proc.wait()
    with pytest.raises(ClusterError, match=r"reward-model-0 exited with 3 before it was healthy .*engine.log"):
        local.wait_engine_healthy(engine, timeout_s=10)


def test_up_lists_the_engine_by_its_classify_address(tmp_path: Path) -> None:
    from policyloop.cli.cluster import _print_endpoints
    from policyloop.cli.common import console

    info = ClusterInfo(str(tmp_path), "nats://127.0.0.1:1", "redis://127.0.0.1:2/0", "default", 1,
                       processes={"reward-0": {"http": 9101}, f"{local.REWARD_MODEL}-0": {"http": 9102}})
    with console.capture() as captured:
        _print_endpoints(info)
    lines = {line.split()[1]: line for line in captured.get().splitlines() if line.startswith("│ ")}
    assert "http://127.0.0.1:9101/metrics, /healthz" in lines["reward-0"]
    engine = lines[f"{local.REWARD_MODEL}-0"]
    assert local.REWARD_MODEL_NAME in engine and "http://127.0.0.1:9102/classify" in engine
    assert "/healthz" not in engine


def test_top_shows_the_engine_without_a_health_report_of_its_own() -> None:
    """The engine exports no policyloop_service_healthy: `up` is its health. A service missing
    that report is still unhealthy."""
    samples = [Sample("up", {"instance": "reward-0", "service": "reward"}, 1.0),
               Sample("policyloop_service_healthy", {"instance": "reward-0", "service": "reward"}, 1.0),
               Sample("up", {"instance": "gateway-0", "service": "gateway"}, 1.0),
               Sample("up", {"instance": f"{local.REWARD_MODEL}-0", "service": local.REWARD_MODEL}, 1.0),
               Sample("up", {"instance": f"{local.REWARD_MODEL}-1", "service": local.REWARD_MODEL}, 0.0),
               Sample("policyloop_engine_classify_in_flight",
                      {"instance": f"{local.REWARD_MODEL}-0", "service": local.REWARD_MODEL}, 2.0)]
    ledger = Ledger.between(None, Scrape(samples, at=1.0, source="test"))
    assert ledger.services == [("gateway-0", "gateway", True, False, 0),
                               ("reward-0", "reward", True, True, 0),
                               (f"{local.REWARD_MODEL}-0", local.REWARD_MODEL, True, None, 0),
                               (f"{local.REWARD_MODEL}-1", local.REWARD_MODEL, False, False, 0)]
    text = Console(width=120, record=True)
    text.print(render(ledger))
    [row] = [line for line in text.export_text().splitlines() if f"{local.REWARD_MODEL}-0" in line]
    assert [cell.strip() for cell in row.split("│")[2:4]] == ["yes", "–"], row
