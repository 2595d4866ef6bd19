"""A small OTLP/HTTP receiver for tests, built on OpenTelemetry's own protobuf definitions (the
collector is not available here): it accepts ExportTraceServiceRequest bodies at /v1/traces
and keeps every span with the service that sent it."""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(any_value: AnyValue) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, object] = field(hash=False)
    error: bool = False


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                receiver._keep(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), name=span.name,
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, attributes={a.key: _value(a.value) for a in span.attributes},
                        error=span.status.code == span.status.STATUS_CODE_ERROR))
        with self._lock:
            self.spans.extend(received)
            self.requests += 1

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, check: Callable[[list[ReceivedSpan]], bool], what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not check(self.snapshot()):
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in self.snapshot()})
                raise AssertionError(f"not within {timeout_s:.0f} s: {what}; received {names}")
            time.sleep(0.2)


def lineage(spans: list[ReceivedSpan], leaf: ReceivedSpan) -> list[ReceivedSpan]:
    """The chain of spans from the trace's root to `leaf` (each found by its parent id)."""
    by_id = {s.span_id: s for s in spans}
    chain = [leaf]
    while chain[-1].parent_span_id:
        parent = by_id.get(chain[-1].parent_span_id)
        assert parent is not None, f"the parent of {chain[-1].name!r} ({chain[-1].service}) never arrived"
        chain.append(parent)
    return chain[::-1]


def lineage_or_none(spans: list[ReceivedSpan], leaf: ReceivedSpan) -> list[ReceivedSpan]:
    """`lineage`, or [leaf] with a parent id that is not there yet while spans are arriving."""
    try:
        return lineage(spans, leaf)
    except AssertionError:
        return [leaf]


def roots_and_children(spans: list[ReceivedSpan]) -> tuple[list[ReceivedSpan], dict[str, list[ReceivedSpan]]]:
    children: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        children[s.parent_span_id].append(s)
    return children.get("", []), children
