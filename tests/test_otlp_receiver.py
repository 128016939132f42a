"""Tests for tests/support/otlp_receiver.py against the real OpenTelemetry SDK exporters."""

from __future__ import annotations

import gzip
import http.client
import importlib.util
import os
import socket
import ssl
import threading
import time

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.metrics import Observation
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from tests.support.otlp_receiver import (
    BlackHole,
    OTLPReceiver,
    _generate_tls_files,
    _HTTPHandler,
    _HTTPServer,
    decode_attributes,
)

pytestmark = pytest.mark.timeout(60)

PROTOCOLS = ["grpc", "http/protobuf"]
TIMEOUT = 2  # exporter timeout (seconds): keeps the fault tests quick


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No OTEL_* configuration or CA-bundle override leaks in from the machine."""
    for key in list(os.environ):
        if key.startswith("OTEL_") or key in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
            monkeypatch.delenv(key)


@pytest.fixture(params=PROTOCOLS)
def receiver(request):
    with OTLPReceiver(request.param) as r:
        yield r


def span_exporter(protocol, **kwargs):
    kwargs.setdefault("timeout", TIMEOUT)
    return (GrpcSpanExporter if protocol == "grpc" else HttpSpanExporter)(**kwargs)


def metric_exporter(protocol, **kwargs):
    kwargs.setdefault("timeout", TIMEOUT)
    return (GrpcMetricExporter if protocol == "grpc" else HttpMetricExporter)(**kwargs)


def finished_span(name="unit"):
    """A finished SDK span (a ReadableSpan) to hand to exporter.export() directly."""
    with TracerProvider().get_tracer("test").start_as_current_span(name) as span:
        pass
    return span


# -- data arrives decoded ----------------------------------------------------------


def test_spans_roundtrip_via_env(receiver, monkeypatch):
    receiver.apply_env(monkeypatch)
    provider = TracerProvider(resource=Resource.create({"service.name": "svc", "deploy.zone": "z1"}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter(receiver.protocol)))
    tracer = provider.get_tracer("dask_otel.test", "1.0")
    t0 = time.time()
    with tracer.start_as_current_span("parent", attributes={"n": 3}) as parent:
        with tracer.start_as_current_span("child") as child:
            child.set_attribute("key", "value")
            child.set_attribute("ratio", 0.5)
            child.set_attribute("flag", True)
            child.set_attribute("keys", ["a", "b"])
            child.set_attribute("sizes", [1, 2, 3])
            child.add_event("spilled", {"bytes": 1024})
            child.set_status(Status(StatusCode.ERROR, "boom"))
    provider.force_flush()

    spans = receiver.wait_for(lambda r: len(r.spans()) == 2 and r.spans())
    by_name = {s.name: s for s in spans}
    p, c = by_name["parent"], by_name["child"]
    assert p.trace_id == c.trace_id == format(parent.get_span_context().trace_id, "032x")
    assert len(p.trace_id) == 32 and len(p.span_id) == 16
    assert p.span_id == format(parent.get_span_context().span_id, "016x")
    assert c.span_id == format(child.get_span_context().span_id, "016x")
    assert c.parent_span_id == p.span_id
    assert p.parent_span_id is None
    assert c.attributes == {"key": "value", "ratio": 0.5, "flag": True, "keys": ("a", "b"), "sizes": (1, 2, 3)}
    assert p.attributes == {"n": 3}
    assert [(name, attrs) for name, _, attrs in c.events] == [("spilled", {"bytes": 1024})]
    assert p.start <= c.events[0][1] <= p.end
    assert t0 - 1 < p.start <= c.start <= c.end <= p.end < time.time() + 1
    assert (c.status_code, c.status_message) == ("ERROR", "boom")
    assert (p.status_code, p.status_message) == ("UNSET", "")
    assert c.resource["service.name"] == "svc" and c.resource["deploy.zone"] == "z1"
    assert c.scope == "dask_otel.test"
    assert c.kind == "INTERNAL"
    assert receiver.span_names() == ["child", "parent"]
    assert receiver.spans("child") == [c]
    assert receiver.requests == 1 and receiver.rejected == 0
    assert receiver.raw_requests[0][0] == "traces"
    provider.shutdown()


def test_metrics_roundtrip(receiver):
    reader = PeriodicExportingMetricReader(
        metric_exporter(receiver.protocol, endpoint=receiver.metrics_endpoint),
        export_interval_millis=3_600_000,  # only force_flush exports
    )
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "svc"}))
    meter = provider.get_meter("dask_otel.test")
    counter = meter.create_counter("tasks", unit="{task}", description="tasks done")
    counter.add(2, {"state": "memory"})
    counter.add(3, {"state": "memory"})
    counter.add(1, {"state": "erred"})
    meter.create_observable_gauge(
        "spill.bytes", callbacks=[lambda options: [Observation(7.5, {"worker": "w1"})]], unit="By"
    )
    histogram = meter.create_histogram("duration", unit="s")
    histogram.record(0.2)
    histogram.record(3.0)
    provider.force_flush()

    points = receiver.wait_for(lambda r: {"tasks", "spill.bytes", "duration"} <= set(r.metric_names()) and r)
    tasks = {p.attributes["state"]: p for p in points.metric_points("tasks")}
    assert tasks["memory"].value == 5 and tasks["erred"].value == 1
    assert tasks["memory"].kind == "sum" and tasks["memory"].monotonic is True
    assert tasks["memory"].unit == "{task}" and tasks["memory"].description == "tasks done"
    assert tasks["memory"].temporality == "cumulative"
    assert tasks["memory"].resource["service.name"] == "svc"
    assert tasks["memory"].scope == "dask_otel.test"
    assert abs(tasks["memory"].time - time.time()) < 60
    [gauge] = receiver.metric_points("spill.bytes")
    assert (gauge.kind, gauge.monotonic, gauge.value, gauge.unit) == ("gauge", None, 7.5, "By")
    assert gauge.attributes == {"worker": "w1"}
    [hist] = receiver.metric_points("duration")
    assert hist.kind == "histogram" and hist.count == 2 and hist.value == pytest.approx(3.2)
    assert hist.min == 0.2 and hist.max == 3.0 and sum(hist.bucket_counts) == 2

    # a second export appends cumulative points after the first ones
    counter.add(1, {"state": "erred"})
    provider.force_flush()
    receiver.wait_for(lambda r: len(r.metric_points("tasks")) == 4)
    assert [p.value for p in receiver.metric_points("tasks") if p.attributes["state"] == "erred"] == [1, 2]
    provider.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_gzip_compression(protocol):
    with OTLPReceiver(protocol) as receiver:
        if protocol == "grpc":
            exporter = span_exporter(protocol, endpoint=receiver.endpoint, compression=grpc.Compression.Gzip)
        else:
            exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint, compression=HttpCompression.Gzip)
        assert exporter.export([finished_span("zipped")]) == SpanExportResult.SUCCESS
        assert receiver.span_names() == ["zipped"]
        if protocol == "http/protobuf":
            assert receiver.headers[-1]["content-encoding"] == "gzip"
        exporter.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_headers_from_env(protocol, monkeypatch):
    with OTLPReceiver(protocol) as receiver:
        env = receiver.apply_env(monkeypatch, headers={"authorization": "Bearer s3cret", "x-tenant": "dask"})
        assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer%20s3cret,x-tenant=dask"
        spans = span_exporter(protocol)
        metrics = metric_exporter(protocol)
        assert spans.export([finished_span()]) == SpanExportResult.SUCCESS
        provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(metrics, 3_600_000)])
        provider.get_meter("m").create_counter("c").add(1)
        provider.force_flush()
        assert receiver.requests == 2
        for headers in receiver.headers:
            assert headers["authorization"] == "Bearer s3cret"
            assert headers["x-tenant"] == "dask"
            assert headers["user-agent"].startswith("OTel-OTLP-Exporter-Python")
        spans.shutdown()
        provider.shutdown()


# -- fault modes -------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unavailable_then_recovery(protocol):
    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint)
        t0 = time.monotonic()
        assert exporter.export([finished_span("lost")]) == SpanExportResult.FAILURE
        elapsed = time.monotonic() - t0
        # retried once after the ~1s (±20%) backoff; the next 2s backoff exceeds the 2s deadline
        assert 0.7 < elapsed < TIMEOUT + 0.5
        assert receiver.requests == 2 and receiver.rejected == 2
        assert receiver.spans() == []

        receiver.mode = "ok"
        assert exporter.export([finished_span("kept")]) == SpanExportResult.SUCCESS
        assert receiver.span_names() == ["kept"]
        exporter.shutdown()


#: The OTLP/HTTP exporter of opentelemetry-sdk 1.41 (the oldest pyproject allows)
#: tries once per export and returns FAILURE on a 503; retrying within the export,
#: with the Retry-After hint, came with opentelemetry-exporter-otlp-common
HTTP_RETRIES = pytest.param("http/protobuf", marks=pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter.otlp.common") is None,
    reason="this OTLP/HTTP exporter does not retry within one export",
))


@pytest.mark.parametrize("protocol", ["grpc", HTTP_RETRIES])
def test_retry_after_hint_and_recovery_within_one_export(protocol):
    """With a retry hint the exporter retries quickly, so an outage shorter than
    its timeout is invisible to the caller."""
    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        receiver.retry_after = 0.1
        exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=5)
        threading.Timer(0.35, setattr, (receiver, "mode", "ok")).start()
        t0 = time.monotonic()
        assert exporter.export([finished_span("late")]) == SpanExportResult.SUCCESS
        assert time.monotonic() - t0 < 3
        assert receiver.rejected >= 2 and receiver.span_names() == ["late"]  # >= 2: the hint was used
        exporter.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_reject_mode_is_not_retried(protocol):
    with OTLPReceiver(protocol, mode="reject") as receiver:
        exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint)
        t0 = time.monotonic()
        assert exporter.export([finished_span()]) == SpanExportResult.FAILURE
        assert time.monotonic() - t0 < 0.7  # no backoff (which would be >= 0.8s)
        assert receiver.requests == 1 and receiver.rejected == 1
        exporter.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", HTTP_RETRIES])
def test_metric_exporter_unavailable_then_recovery(protocol):
    collected = InMemoryMetricReader()
    MeterProvider(metric_readers=[collected]).get_meter("m").create_counter("c").add(1)
    data = collected.get_metrics_data()
    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        exporter = metric_exporter(protocol, endpoint=receiver.metrics_endpoint)
        t0 = time.monotonic()
        assert exporter.export(data) == MetricExportResult.FAILURE
        assert 0.7 < time.monotonic() - t0 < TIMEOUT + 0.5
        assert receiver.requests == 2 and receiver.metric_points() == []

        receiver.retry_after = 0.01  # with a retry hint: all 6 attempts, quickly
        receiver.clear()
        assert exporter.export(data) == MetricExportResult.FAILURE
        assert receiver.requests == 6

        receiver.mode = "ok"
        assert exporter.export(data) == MetricExportResult.SUCCESS
        [point] = receiver.metric_points("c")
        assert (point.kind, point.monotonic, point.value) == ("sum", True, 1)
        exporter.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stop_and_restart_on_same_port(protocol):
    receiver = OTLPReceiver(protocol).start()
    try:
        port, endpoint = receiver.port, receiver.endpoint
        exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=5)
        assert exporter.export([finished_span("before")]) == SpanExportResult.SUCCESS

        receiver.stop()
        assert not receiver.running
        with socket.socket() as probe:  # really closed
            assert probe.connect_ex(("127.0.0.1", port)) != 0
        failing = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=1)
        assert failing.export([finished_span("while-down")]) == SpanExportResult.FAILURE
        failing.shutdown()

        receiver.start()
        assert (receiver.port, receiver.endpoint) == (port, endpoint)
        # the long-lived exporter reconnects by itself
        assert exporter.export([finished_span("after")]) == SpanExportResult.SUCCESS
        assert receiver.span_names() == ["before", "after"]
        exporter.shutdown()
    finally:
        receiver.stop()


def test_http_close_after_the_accept_loop_already_left():
    """close() may find serve() gone: serve() saw ``_closed`` when an accept woke it
    and closed its end of the wake pipe (CI once failed here with BrokenPipeError)."""
    server = _HTTPServer(("127.0.0.1", 0), OTLPReceiver("http/protobuf"), None)
    server._closed = True  # the first half of close(), seen by the loop on its own
    server.serve()  # returns at once, closing the listener and its end of the wake pipe
    server.close()  # must not raise


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stop_drops_kept_alive_connections(protocol):
    """A stopped receiver must not keep serving over connections opened earlier."""
    receiver = OTLPReceiver(protocol).start()
    exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=1)
    try:
        assert exporter.export([finished_span()]) == SpanExportResult.SUCCESS
        t0 = time.monotonic()
        receiver.stop()
        # causal: it did not wait for the kept-alive connection to go idle
        assert time.monotonic() - t0 < _HTTPHandler.timeout
        assert exporter.export([finished_span()]) == SpanExportResult.FAILURE
        assert receiver.requests == 1
    finally:
        exporter.shutdown()
        receiver.stop()


def test_batch_processor_survives_outage(monkeypatch):
    """End to end: spans produced while the collector is down arrive after it restarts."""
    with OTLPReceiver("grpc") as receiver:
        receiver.apply_env(monkeypatch)
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(span_exporter("grpc", timeout=5), schedule_delay_millis=100))
        tracer = provider.get_tracer("t")
        receiver.mode = "unavailable"
        receiver.retry_after = 0.2
        with tracer.start_as_current_span("during-outage"):
            pass
        receiver.wait_for(lambda r: r.rejected >= 1, timeout=10)
        receiver.mode = "ok"
        receiver.wait_for(lambda r: r.spans("during-outage"), timeout=10)
        provider.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_black_hole_times_out(protocol):
    with BlackHole() as hole:
        endpoint = hole.endpoint + ("/v1/traces" if protocol == "http/protobuf" else "")
        exporter = span_exporter(protocol, endpoint=endpoint, timeout=1)
        t0 = time.monotonic()
        assert exporter.export([finished_span()]) == SpanExportResult.FAILURE
        assert 0.8 < time.monotonic() - t0 < 3
        assert hole.connections >= 1
        exporter.shutdown()
    assert hole.env("grpc")["OTEL_EXPORTER_OTLP_INSECURE"] == "true"


def test_delay(receiver):
    receiver.delay = 0.3
    exporter = span_exporter(receiver.protocol, endpoint=receiver.traces_endpoint)
    t0 = time.monotonic()
    assert exporter.export([finished_span()]) == SpanExportResult.SUCCESS
    assert time.monotonic() - t0 >= 0.3
    exporter.shutdown()


# -- TLS -------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_via_env(protocol, monkeypatch):
    with OTLPReceiver(protocol, tls=True) as receiver:
        assert receiver.endpoint.startswith("https://127.0.0.1:")
        # as on many CI machines; for HTTP this would override the exporter's certificate
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", ssl.get_default_verify_paths().openssl_cafile)
        env = receiver.apply_env(monkeypatch)
        assert env["OTEL_EXPORTER_OTLP_CERTIFICATE"] == receiver.certificate_path
        assert "OTEL_EXPORTER_OTLP_INSECURE" not in env
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(span_exporter(protocol)))
        with provider.get_tracer("t").start_as_current_span("secure"):
            pass
        metrics = MeterProvider(metric_readers=[PeriodicExportingMetricReader(metric_exporter(protocol), 3_600_000)])
        metrics.get_meter("m").create_counter("secure.count").add(1)
        metrics.force_flush()
        assert receiver.span_names() == ["secure"]
        assert receiver.metric_names() == ["secure.count"]
        provider.shutdown()
        metrics.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_via_arguments_and_untrusted_client_fails(protocol):
    with OTLPReceiver(protocol, tls=True) as receiver:
        if protocol == "grpc":
            with open(receiver.certificate_path, "rb") as f:
                trusted = {"credentials": grpc.ssl_channel_credentials(f.read())}
            untrusted = {"credentials": grpc.ssl_channel_credentials(b"")}  # no usable roots
        else:
            trusted = {"certificate_file": receiver.certificate_path}
            untrusted = {"certificate_file": ssl.get_default_verify_paths().cafile or True}
        good = span_exporter(protocol, endpoint=receiver.traces_endpoint, **trusted)
        assert good.export([finished_span("tls-args")]) == SpanExportResult.SUCCESS
        bad = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=1, **untrusted)
        assert bad.export([finished_span("untrusted")]) == SpanExportResult.FAILURE
        assert receiver.span_names() == ["tls-args"]
        good.shutdown()
        bad.shutdown()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_restart(protocol):
    with OTLPReceiver(protocol, tls=True) as receiver:
        kwargs = (
            {"credentials": grpc.ssl_channel_credentials(open(receiver.certificate_path, "rb").read())}
            if protocol == "grpc"
            else {"certificate_file": receiver.certificate_path}
        )
        exporter = span_exporter(protocol, endpoint=receiver.traces_endpoint, timeout=5, **kwargs)
        assert exporter.export([finished_span("one")]) == SpanExportResult.SUCCESS
        receiver.stop()
        receiver.start()
        assert exporter.export([finished_span("two")]) == SpanExportResult.SUCCESS
        assert receiver.span_names() == ["one", "two"]
        exporter.shutdown()


@pytest.mark.parametrize("backend", ["openssl", "cryptography"])
def test_certificate_generation_backends(backend, tmp_path):
    if backend == "cryptography":
        pytest.importorskip("cryptography")
    elif not __import__("shutil").which("openssl"):
        pytest.skip("no openssl CLI")
    files = _generate_tls_files(str(tmp_path), backend)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(files.server_cert, files.server_key)
    client_ctx = ssl.create_default_context(cafile=files.ca_cert)
    if hasattr(ssl, "VERIFY_X509_STRICT"):
        client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            for _ in range(2):
                conn, _ = listener.accept()
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        for hostname in ("127.0.0.1", "localhost"):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=hostname) as tls:
                    tls.sendall(b"x")
        thread.join(5)


# -- plumbing ----------------------------------------------------------------------


def test_env_and_endpoints():
    with OTLPReceiver("grpc") as g, OTLPReceiver("http/protobuf") as h:
        assert g.port != h.port
        assert g.env() == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{g.port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }
        assert h.env() == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{h.port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        assert g.traces_endpoint == g.metrics_endpoint == g.endpoint
        assert h.traces_endpoint == h.endpoint + "/v1/traces"
        assert h.metrics_endpoint == h.endpoint + "/v1/metrics"
        assert g.certificate_path is None
    with pytest.raises(ValueError):
        OTLPReceiver("http/json")
    with pytest.raises(ValueError):
        OTLPReceiver().mode = "sometimes"


def test_wait_for_timeout_message_and_clear(receiver):
    exporter = span_exporter(receiver.protocol, endpoint=receiver.traces_endpoint)
    exporter.export([finished_span("compute")])
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.3s .*\['compute'\]") as info:
        receiver.wait_for(lambda r: r.spans("never"), timeout=0.3)
    assert "test_otlp_receiver.py" in str(info.value)
    assert time.monotonic() - t0 < 3
    assert receiver.wait_for(lambda r: r.requests) == 1
    receiver.clear()
    assert (receiver.spans(), receiver.metric_points(), receiver.headers, receiver.requests) == ([], [], [], 0)
    exporter.shutdown()


def test_wait_for_wakes_on_arrival(receiver):
    exporter = span_exporter(receiver.protocol, endpoint=receiver.traces_endpoint)
    threading.Timer(0.2, exporter.export, ([finished_span("soon")],)).start()
    t0 = time.monotonic()
    assert receiver.wait_for(lambda r: r.spans("soon"), timeout=10)
    assert time.monotonic() - t0 < 3
    exporter.shutdown()


def test_http_edge_cases():
    with OTLPReceiver("http/protobuf") as receiver:
        body = ExportTraceServiceRequest().SerializeToString()
        conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=5)

        def post(path, data, headers=None, chunked=False):
            conn.request("POST", path, body=data, headers={"Content-Type": "application/x-protobuf", **(headers or {})},
                         encode_chunked=chunked)  # fmt: skip
            response = conn.getresponse()
            response.read()
            return response.status

        assert post("/v1/profiles", body) == 404  # a signal the receiver does not serve
        assert post("/v1/traces", b"\xff\xff garbage") == 400
        assert post("/v1/traces", gzip.compress(body), {"Content-Encoding": "gzip"}) == 200
        assert post("/v1/metrics", iter([body[:1], body[1:]] if body else [b""]), chunked=True) == 200
        assert (receiver.requests, receiver.rejected) == (3, 1)
        conn.close()


def test_decode_attributes():
    def kv(key, **value):
        return KeyValue(key=key, value=AnyValue(**value))

    attrs = [
        kv("s", string_value="x"),
        kv("i", int_value=3),
        kv("d", double_value=0.25),
        kv("b", bool_value=False),
        kv("raw", bytes_value=b"\x00"),
        kv("arr", array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="y")])),
        kv("map", kvlist_value=KeyValueList(values=[kv("k", string_value="v")])),
        KeyValue(key="empty"),
    ]
    assert decode_attributes(attrs) == {
        "s": "x", "i": 3, "d": 0.25, "b": False, "raw": b"\x00", "arr": (1, "y"), "map": {"k": "v"}, "empty": None,
    }  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_logs_are_received_with_their_trace_context(protocol):
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    with OTLPReceiver(protocol) as receiver:
        endpoint = receiver.endpoint + ("/v1/logs" if protocol == "http/protobuf" else "")
        kwargs = {"insecure": True} if protocol == "grpc" else {}
        provider = LoggerProvider(shutdown_on_exit=False)
        provider.add_log_record_processor(
            SimpleLogRecordProcessor(OTLPLogExporter(endpoint=endpoint, **kwargs))
        )
        context = trace.set_span_in_context(
            NonRecordingSpan(SpanContext(0xABC, 0xDEF, False, TraceFlags(1)))
        )
        provider.get_logger("t").emit(body="hello", severity_text="WARN", context=context)
        (log,) = receiver.wait_for(lambda r: r.logs())
        provider.shutdown()
    assert (log.body, log.severity_text) == ("hello", "WARN")
    assert (log.trace_id, log.span_id) == (f"{0xABC:032x}", f"{0xDEF:016x}")
