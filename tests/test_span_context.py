"""The Dask span -> OTel SpanContext rule (dask_otel.span_context): ids, the
sampling decision, and one composition seen from every process that makes it: the
client inside a ``dask_otel.span`` block, the task on the worker, the scheduler's
exported span, its TaskGroup spans, and a link to it from another trace. Real
in-process cluster; the caller's span is a ``NonRecordingSpan`` with a W3C trace
state, as one extracted from a request. The spans the rule gives, end to end:
tests/test_spans.py, tests/test_client.py, tests/test_task_context.py."""

from __future__ import annotations

from distributed import span, wait
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

import dask_otel
from dask_otel.span_context import dask_span_context, otel_span_id, trace_decision
from tests.support.cluster import otel_cluster

CALLER = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "opaque-1")]),
)


def current_context(_=None) -> tuple[int, int, bool, bool, str]:
    """The current span's context in a task: trace id, span id, remote, sampled,
    trace state"""
    c = trace.get_current_span().get_span_context()
    return c.trace_id, c.span_id, c.is_remote, c.trace_flags.sampled, c.trace_state.to_header()


def test_every_process_composes_the_same_context_with_the_callers_trace_state():
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(CALLER)))
    try:
        with otel_cluster() as (client, mirrored):
            with dask_otel.span("request") as sid:
                in_client = current_context()
                in_task = client.submit(current_context, 1, key="ctx-task").result()
            exported = mirrored.by_dask_id(sid)
            (group,) = mirrored.children(exported)
    finally:
        otel_context.detach(token)

    expected = (CALLER.trace_id, otel_span_id(sid), True, True, "vendor=opaque-1")
    # Elsewhere the span is remote; in the scheduler, which makes it, it is not
    assert in_client == expected
    assert in_task == expected
    c = exported.context
    assert (c.trace_id, c.span_id, c.is_remote, c.trace_flags.sampled) == expected[:2] + (False, True)
    assert c.trace_state.to_header() == "vendor=opaque-1"
    assert exported.parent.span_id == CALLER.span_id and exported.parent.is_remote
    # TaskGroup spans are children: the caller's trace state reaches them too
    assert group.context.trace_state.to_header() == "vendor=opaque-1"
    assert group.parent.span_id == c.span_id


def test_a_link_to_a_producer_is_the_context_the_producer_is_exported_with():
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(CALLER)))
    try:
        with otel_cluster() as (client, mirrored):
            with dask_otel.span("producer") as producer_id:
                data = client.submit(sum, [1, 2], key="produced-data")
                wait(data)
        # another trace, without a caller, consumes the producer's data
            otel_context.detach(token)
            token = None
            with span("consumer") as consumer_id:
                assert client.submit(lambda x: x + 1, data, key="consume-data").result() == 4
            producer = mirrored.by_dask_id(producer_id)
            consumer = mirrored.by_dask_id(consumer_id)
    finally:
        if token is not None:
            otel_context.detach(token)
    (link,) = consumer.links
    assert link.context == producer.context
    assert link.context.trace_state.to_header() == "vendor=opaque-1"


def test_without_a_sampler_the_callers_flag_decides():
    unsampled = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    context = dask_span_context("root", "own", "tag", unsampled, None, is_remote=True)
    assert not context.trace_flags.sampled and context.trace_id == 1
    context = dask_span_context("root", "own", "tag", None, None, is_remote=True)
    assert context.trace_flags.sampled and context.trace_state.to_header() == ""


def test_ratio_sampler_keeps_the_ratio_of_dask_trace_ids(monkeypatch):
    """Dask trace ids are uuid4s, whose low 64 bits (what TraceIdRatioBased reads)
    always start with binary 10; sampled as they are, 10 % would keep none"""
    import uuid

    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    for ratio in (0.1, 0.5, 0.9):
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", str(ratio))
        sampler = TracerProvider().sampler  # as the scheduler's reads them
        kept = sum(trace_decision(sampler, uuid.uuid4().int, "root")[0] for _ in range(10_000))
        assert abs(kept / 10_000 - ratio) <= 0.02, (ratio, kept)


def test_a_child_of_a_dask_span_is_in_its_trace_with_its_trace_state_and_sampled():
    """What a TaskGroup batch's span and a task span share with their Dask span
    (dask_otel.span_context.child_context): its trace and trace state, sampled,
    made in this process, with their own id"""
    from dask_otel.span_context import child_context

    parent = dask_span_context(
        "a" * 32, "b" * 32, "root", CALLER, None, is_remote=True
    )
    child = child_context(parent, 42)
    assert (child.trace_id, child.span_id) == (CALLER.trace_id, 42)
    assert child.trace_state == CALLER.trace_state
    assert child.trace_flags.sampled and not child.is_remote
