"""The application around Dask: its own tracing in the client process, and the
caller's context as ``dask_otel.span`` hands it on."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def app_tracer(sampler=None) -> tuple[InMemorySpanExporter, trace.Tracer]:
    """The application's own tracing: a TracerProvider of this process (not the
    global one), exporting to memory"""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**({"sampler": sampler} if sampler else {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("app")


def caller_carrier(trace_id: int, span_id: int, sampled: bool) -> dict[str, str]:
    """What dask_otel.span puts in the ``otel`` annotation for a caller's span,
    with baggage ``tenant=acme``"""
    from opentelemetry import baggage, propagate
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    caller = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(int(sampled)))
    context = trace.set_span_in_context(NonRecordingSpan(caller))
    context = baggage.set_baggage("tenant", "acme", context)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier
