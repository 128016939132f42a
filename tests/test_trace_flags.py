"""Trace flags and trace state (dask_otel.span_context, docs/traces.md "Ids and
sampling"): the caller's flags, W3C Level 2's random flag 0x02 included, reach
the client block, the mirrored spans, the tasks' context and task spans, and an
HTTP call made inside a task; a Dask-rooted trace says random; the trace state
a sampler returns is kept. Real clusters, a real instrumented HTTP client
(opentelemetry-instrumentation-requests) and a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

import dask_otel
from dask_otel.span_context import RANDOM, child_context, dask_span_context, root_flags
from tests.support.cluster import otel_cluster
from tests.test_end_to_end import wsgi_server

#: A caller's span as SDK >= 1.42 makes a root: sampled and random (flags 03)
CALLER = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(0x03),
    trace_state=TraceState([("vendor", "opaque-1")]),
)
#: Task spans on, so that every span a trace can have is there
TASK_SPANS = {"otel.tasks.spans": True}


@contextmanager
def traceparent_server() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 that answers 200 and keeps the ``traceparent``
    header of every request; yields its URL and that list"""
    received: list[str] = []

    def app(environ, start_response):
        received.append(environ.get("HTTP_TRACEPARENT", ""))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    with wsgi_server(app) as url:
        yield url, received


def call_with_requests(url: str) -> int:
    """A task: an HTTP GET with ``requests``, instrumented in the worker process;
    returns the flags of the context the task ran in"""
    import requests
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    RequestsInstrumentor().instrument()  # once per worker process
    requests.get(url, timeout=10).raise_for_status()
    return int(trace.get_current_span().get_span_context().trace_flags)


def current_flags(_=None) -> int:
    return int(trace.get_current_span().get_span_context().trace_flags)


@contextmanager
def caller_span(context: SpanContext) -> Iterator[None]:
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(context)))
    try:
        yield
    finally:
        otel_context.detach(token)


def test_callers_flags_03_reach_an_http_call_made_inside_a_task():
    with traceparent_server() as (url, received), otel_cluster(processes=True) as (
        client, mirrored
    ):
        with caller_span(CALLER), dask_otel.span("request") as sid:
            in_block = current_flags()
            in_task = client.submit(call_with_requests, url, key="call-1").result()
        exported = mirrored.by_dask_id(sid)
    assert in_block == in_task == 0x03
    (traceparent,) = received
    assert traceparent.startswith(f"00-{CALLER.trace_id:032x}-")
    # The call's span is the SDK's child of the task's context: SDKs before 1.42
    # (no TraceFlags.RANDOM_TRACE_ID) make their children with the sampled bit only
    sdk_keeps_random = hasattr(TraceFlags, "RANDOM_TRACE_ID")
    assert traceparent.endswith("-03" if sdk_keeps_random else "-01")
    assert int(exported.context.trace_flags) == 0x03


def test_callers_flags_reach_the_task_spans_with_its_trace_state():
    with otel_cluster(TASK_SPANS) as (client, mirrored):
        with caller_span(CALLER), dask_otel.span("request") as sid:
            client.submit(current_flags, key="current_flags-1").result()
        exported = mirrored.by_dask_id(sid)
        (task_span,) = [
            s for s in mirrored.children(exported) if "dask.task.key" in s.attributes
        ]
    assert int(task_span.context.trace_flags) == 0x03
    assert task_span.context.trace_state.to_header() == "vendor=opaque-1"


def test_a_callers_unrandom_flags_stay_01():
    """Nothing says random that the caller did not: flags 01 stay 01"""
    caller = SpanContext(CALLER.trace_id, CALLER.span_id, True, TraceFlags(0x01))
    with otel_cluster() as (client, mirrored), caller_span(caller):
        with dask_otel.span("request") as sid:
            assert current_flags() == 0x01
            assert client.submit(current_flags, key="flags-1").result() == 0x01
        assert int(mirrored.by_dask_id(sid).context.trace_flags) == 0x01


def test_a_dask_rooted_trace_says_random():
    with otel_cluster(TASK_SPANS) as (client, mirrored):
        with dask_otel.span("rooted") as sid:
            in_block = current_flags()
            in_task = client.submit(current_flags, key="current_flags-2").result()
        exported = mirrored.by_dask_id(sid)
        (task_span,) = [
            s for s in mirrored.children(exported) if "dask.task.key" in s.attributes
        ]
    assert in_block == in_task == 0x03
    assert int(exported.context.trace_flags) == 0x03
    assert int(task_span.context.trace_flags) == 0x03


def test_only_a_uuid4_root_id_is_random():
    """A uuid4's low 56 bits are random; a hand-made id, hashed, is not"""
    assert root_flags(str(uuid.uuid4())) == RANDOM
    assert root_flags("my-own-span-id") == 0
    assert root_flags(str(uuid.uuid1())) == 0


class _ThresholdSampler(Sampler):
    """Keeps everything and writes a consistent-probability threshold into the
    trace state, as the OTel spec's consistent samplers do (``ot=th:0``)"""

    def should_sample(self, parent_context, trace_id, name, kind=None,
                      attributes=None, links=None, trace_state=None) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        state = parent.trace_state if parent.is_valid else TraceState()
        return SamplingResult(Decision.RECORD_AND_SAMPLE, None, state.update("ot", "th:0")
                              if "ot" in state else state.add("ot", "th:0"))

    def get_description(self) -> str:
        return "ThresholdSampler"


def test_the_trace_state_a_sampler_returns_is_kept():
    sampler = _ThresholdSampler()
    rooted = dask_span_context(str(uuid.uuid4()), str(uuid.uuid4()), "root", None, sampler,
                               is_remote=True)
    assert rooted.trace_state.to_header() == "ot=th:0"
    joined = dask_span_context("a" * 32, "b" * 32, "root", CALLER, sampler, is_remote=True)
    assert joined.trace_state.to_header() == "ot=th:0,vendor=opaque-1"
    # a child of a Dask span (TaskGroup and task spans) keeps it too
    assert child_context(joined, 7).trace_state == joined.trace_state


def test_without_a_returned_trace_state_the_callers_is_kept():
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    joined = dask_span_context("a" * 32, "b" * 32, "root", CALLER, ALWAYS_ON, is_remote=True)
    assert joined.trace_state.to_header() == "vendor=opaque-1"
