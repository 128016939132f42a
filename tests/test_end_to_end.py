"""One trace from an HTTP request to the HTTP calls made inside Dask tasks.

Through real components only: a WSGI web service instrumented with
opentelemetry-instrumentation-wsgi whose handler runs a ``dask_otel.span``
workflow on ``dask scheduler`` + ``dask worker`` processes (switched on by the
preload variable alone), whose tasks call a second instrumented web service with
``requests`` (opentelemetry-instrumentation-requests, on the workers' global
TracerProvider, which is the bridge's). Every process exports over OTLP/gRPC to the
test receiver, which plays the collector; it hands what it received, batch by
batch, to Jaeger over OTLP/HTTP, as a collector's second exporter would.
The trace is read back from both.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import dask_otel
from tests.support.backends import JaegerServer
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.span_tree import as_node, assert_span_tree
from tests.support.tasks import fetch_and_score

N_ITEMS = 3


def catalog_app(environ, start_response):
    """The second service: a price per item"""
    item = int(environ["PATH_INFO"].rsplit("/", 1)[-1])
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps({"price": 10 + item}).encode()]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _ThreadingWSGIServer(WSGIServer):
    daemon_threads = True


@contextmanager
def wsgi_server(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a thread; yields its base URL"""
    server = make_server("127.0.0.1", 0, app, server_class=_ThreadingWSGIServer,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def forward_to_jaeger(receiver: OTLPReceiver, jaeger: JaegerServer) -> None:
    """What the receiver got, batch by batch, to Jaeger over OTLP/HTTP"""
    for signal, request in receiver.raw_requests:
        if signal != "traces":
            continue
        post = urllib.request.Request(
            jaeger.otlp_http_endpoint + "/v1/traces", data=request.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"}, method="POST",
        )
        with urllib.request.urlopen(post, timeout=30) as answer:
            assert answer.status == 200


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_trace_from_the_request_to_the_http_calls_inside_tasks():
    with (
        JaegerServer() as jaeger,
        OTLPReceiver("grpc") as receiver,
        dask_processes(receiver.env()) as cluster,
        cluster.client() as client,
    ):
        # The web services' own tracing, in this process, to the collector
        provider = TracerProvider(resource=Resource.create({"service.name": "web"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True))
        )

        with wsgi_server(OpenTelemetryMiddleware(catalog_app, tracer_provider=provider)) as catalog:

            def reports_app(environ, start_response):
                """The first service: runs the report on the Dask cluster"""
                with dask_otel.span("nightly report") as report_id:
                    with dask_otel.span("fetch and score"):
                        scores = client.gather(
                            client.map(fetch_and_score, range(N_ITEMS), catalog=catalog)
                        )
                start_response("200 OK", [("Content-Type", "application/json")])
                return [json.dumps({"report_id": report_id, "scores": scores}).encode()]

            with wsgi_server(OpenTelemetryMiddleware(reports_app, tracer_provider=provider)) as web:
                with urllib.request.urlopen(f"{web}/reports", timeout=120) as answer:
                    body = json.loads(answer.read())
        provider.shutdown()

        # The collector's view: wait for the last spans (the Dask root comes last)
        receiver.wait_for(lambda r: r.spans("nightly report"), timeout=60)
        (request_span,) = [
            s for s in receiver.spans()
            if s.kind == "SERVER" and any("/reports" in str(v) for v in s.attributes.values())
        ]
        trace_id = request_span.trace_id

        def whole_trace(r: OTLPReceiver):
            spans = [s for s in r.spans() if s.trace_id == trace_id]
            kinds = [s.kind for s in spans]
            return spans if kinds.count("CLIENT") == N_ITEMS and kinds.count("SERVER") == N_ITEMS + 1 else None

        spans = receiver.wait_for(whole_trace, timeout=60)
        time.sleep(1.0)  # anything late would break "one trace" below
        spans = [s for s in receiver.spans() if s.trace_id == trace_id]
        # Every HTTP span and every Dask span of the run is in this one trace
        assert {s.trace_id for s in receiver.spans() if s.kind in ("SERVER", "CLIENT")} == {trace_id}
        assert {s.trace_id for s in receiver.spans() if s.scope == "dask_otel"} == {trace_id}
        by_id = assert_span_tree(spans, one_trace=True, dask_roots=("nightly report",))

        by_name: dict[str, list] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        (report,) = by_name["nightly report"]
        (fetch,) = by_name["fetch and score"]
        assert report.parent_span_id == request_span.span_id
        assert report.span_id == f"{int(body['report_id'].replace('-', ''), 16) & (2**64 - 1):016x}"
        assert fetch.parent_span_id == report.span_id
        (group,) = by_name["taskgroup/fetch_and_score"]
        assert group.parent_span_id == fetch.span_id
        calls = [s for s in spans if s.kind == "CLIENT"]
        # Each call was made in its task's context, the Dask span "fetch and score"...
        assert {c.parent_span_id for c in calls} == {fetch.span_id}
        assert {r["task_span_id"] for r in body["scores"]} == {fetch.span_id}
        # ...and the catalog's server span of each call is a child of that call
        inner = [s for s in spans if s.kind == "SERVER" and s is not request_span]
        assert sorted(s.parent_span_id for s in inner) == sorted(c.span_id for c in calls)
        assert by_id[calls[0].span_id].parent_id == fetch.span_id

        # Jaeger's view of the same trace: the same spans, the same tree
        forward_to_jaeger(receiver, jaeger)
        stored = jaeger.wait_for_trace(trace_id, count=len(spans), timeout=60)
        assert_span_tree(stored, one_trace=True, dask_roots=("nightly report",))
        assert {(n.span_id, n.parent_id) for n in map(as_node, stored)} == {
            (s.span_id, s.parent_span_id) for s in spans
        }
