"""The Dask span -> OTel SpanContext rule (dask_otel.span_context): ids and the
sampling decision. The spans the rule gives, end to end: tests/test_spans.py,
tests/test_client.py, tests/test_task_context.py."""

from __future__ import annotations


def test_ratio_sampler_keeps_the_ratio_of_dask_trace_ids(monkeypatch):
    """Dask trace ids are uuid4s, whose low 64 bits (what TraceIdRatioBased reads)
    always start with binary 10; sampled as they are, 10 % would keep none"""
    import uuid

    from opentelemetry.sdk.trace import TracerProvider

    from dask_otel.sampling import trace_sampled

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    for ratio in (0.1, 0.5, 0.9):
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", str(ratio))
        sampler = TracerProvider().sampler  # as the scheduler's reads them
        kept = sum(trace_sampled(sampler, uuid.uuid4().int, "root") for _ in range(10_000))
        assert abs(kept / 10_000 - ratio) <= 0.02, (ratio, kept)
