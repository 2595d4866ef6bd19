"""One trace per task, following each trajectory across services: the gateway's feed, the
rollout's sampling (each turn, each tool call, each sandbox job), the reward's scoring, the
learner's step that trained it and the version that carried it to the engines.

The trace context travels in NATS message headers (W3C `traceparent`): `Bus.publish` writes the
current context into every message and a pull worker continues it around its handler, so a
span made anywhere under a handler is part of the message's trace. Spans are exported over
OTLP/HTTP when `tracing.otlp_endpoint` is set; otherwise nothing is recorded, and a service
still passes on the context it received, so a trace is not cut by a service that does not
export. The span and attribute names are listed in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

TRACER_NAME = "policyloop"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans under the endpoint

# Attributes every span of a trajectory's life may carry (policyloop.*: the loop's own names).
TRAJECTORY_ID = "policyloop.trajectory_id"
TASK_ID = "policyloop.task_id"
RUN_ID = "policyloop.run_id"
ENVIRONMENT = "policyloop.environment"
POLICY_VERSION = "policyloop.policy_version"
STEP = "policyloop.step"

AttributeValue = str | bool | int | float


class TracingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str = Field(
        "", description="OTLP/HTTP endpoint that receives spans (a collector, Jaeger, Tempo; e.g. "
                        "http://collector:4318): they are POSTed to <endpoint>/v1/traces. Empty: no spans are made "
                        "(the trace context is still passed on).")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of tasks traced. Decided where a trace starts (the gateway's feed) "
                                         "and followed by every service after it, so a trace is never partial.")
    export_timeout_s: float = Field(10.0, gt=0, description="Deadline of one export of a batch of spans.")
    batch_delay_s: float = Field(2.0, gt=0, description="Most seconds a finished span waits before it is exported.")


@dataclass
class _Tracing:
    provider: TracerProvider | None = None
    tracer: trace.Tracer = trace.NoOpTracer()


_state = _Tracing()


def setup_tracing(service: str, instance_id: str, settings: TracingSettings) -> bool:
    """Exports this process's spans when an endpoint is set; True when it does. The provider
    is this module's own (not the global one), so a process can set it up again (tests)."""
    shutdown_tracing()
    if not settings.otlp_endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": service, "service.namespace": "policyloop",
                                "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint.rstrip("/") + TRACES_PATH,
                                timeout=settings.export_timeout_s)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=settings.batch_delay_s * 1000))
    _state.provider, _state.tracer = provider, provider.get_tracer(TRACER_NAME)
    return True


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Exports what is left and stops exporting (a stopping service calls it last)."""
    provider, _state.provider, _state.tracer = _state.provider, None, trace.NoOpTracer()
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


def enabled() -> bool:
    return _state.provider is not None


def tracer() -> trace.Tracer:
    return _state.tracer


def inject(headers: dict[str, str]) -> None:
    """Writes the current trace context into message headers (nothing when there is none)."""
    propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def current() -> Context:
    """The current context, to continue later (e.g. a trajectory held until its step)."""
    return otel_context.get_current()


@contextmanager
def continued(parent: Context) -> Iterator[None]:
    """Makes `parent` the current context: what is published inside carries it on."""
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def span(name: str, *, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[Span]:
    """A span around the block, current inside it. Without tracing it makes nothing, and the
    context of `parent` (if given) is current inside, so it is passed on all the same."""
    if not enabled():
        if parent is None:
            yield trace.INVALID_SPAN
        else:
            with continued(parent):
                yield trace.INVALID_SPAN
        return
    with _state.tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes,
                                             record_exception=True, set_status_on_exception=True) as made:
        yield made


def record_span(name: str, parent: Context, start_ns: int, end_ns: int,
                attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """A finished span with times measured before (e.g. the step that trained a trajectory,
    recorded under each trajectory's own context)."""
    if not enabled():
        return
    made = _state.tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    made.end(end_time=end_ns)


def annotate(attributes: Mapping[str, AttributeValue]) -> None:
    """Adds attributes to the current span (a handler's outcome on its message's span)."""
    trace.get_current_span().set_attributes(attributes)
