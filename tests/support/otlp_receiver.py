"""An in-process OTLP receiver for tests.

This module gives tests a *real* OTLP endpoint to point OpenTelemetry SDK
exporters at, over real sockets on ``127.0.0.1``, so that what arrives can be
asserted on as plain Python values instead of mocking exporters.

* :class:`OTLPReceiver` serves the OTLP ``TraceService``/``MetricsService``/
  ``LogsService`` ``Export`` calls over gRPC (grpcio + opentelemetry-proto) or
  ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` over HTTP with protobuf bodies
  (stdlib :mod:`http.server`; ``gzip``/``deflate`` bodies are accepted),
  optionally with TLS (a throw-away CA and server certificate are generated
  once per process).  Received data is decoded into :class:`ReceivedSpan`,
  :class:`ReceivedPoint` and :class:`ReceivedLog` records.
* Fault injection for reliability tests: ``receiver.mode = "unavailable"``
  (gRPC ``UNAVAILABLE`` / HTTP 503, which exporters retry) or ``"reject"``
  (gRPC ``INVALID_ARGUMENT`` / HTTP 400, which exporters do not retry), an
  optional ``retry_after`` hint and ``delay`` before answering, and
  ``stop()``/``start()`` on the same port to simulate a collector restart.
  ``receiver.refuse = {"metrics"}`` makes it a backend that does not serve a
  signal at all (Phoenix and Jaeger take traces only): HTTP 405 (or
  ``refuse_status``) / gRPC ``UNIMPLEMENTED``, whatever the mode.
* :class:`BlackHole` accepts TCP connections and never reads or answers, to
  simulate a hung collector.

Typical use::

    def test_something(monkeypatch):
        with OTLPReceiver("grpc") as receiver:      # or "http/protobuf", tls=True
            receiver.apply_env(monkeypatch)         # or pass receiver.env() to a subprocess
            ...                                     # run code that exports
            spans = receiver.wait_for(lambda r: r.spans("compute"))
            assert spans[0].attributes["key"] == "value"

Everything runs in daemon threads (gRPC's handler pool is a
``ThreadPoolExecutor``, shut down by ``stop()``), and ``stop()`` returns
promptly, also closing kept-alive client connections.

How the Python OTLP exporters (1.45) behave against it, worth knowing when
writing reliability tests:

* Both gRPC and HTTP exporters retry retryable failures (UNAVAILABLE, 503,
  connection errors ...) with a backoff of 1, 2, 4 ... seconds (±20 %), at
  most 6 attempts, and give up as soon as the next backoff would overrun their
  ``timeout`` (default 10 s, ``timeout=0`` also means 10 s). With
  ``timeout=2`` an unavailable receiver therefore sees exactly 2 attempts and
  ``export()`` returns FAILURE after ~1 s. A ``retry_after`` hint replaces the
  backoff. Non-retryable errors ("reject") fail at once.
* The HTTP exporters' ``endpoint=`` argument is the full URL
  (``receiver.traces_endpoint``); only OTEL_EXPORTER_OTLP_ENDPOINT is a base.
* The HTTP exporters verify TLS through ``requests``, which lets
  REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override their ``certificate_file`` and
  OTEL_EXPORTER_OTLP_CERTIFICATE; see :meth:`OTLPReceiver.env`.
"""

from __future__ import annotations

import gzip
import os
import secrets
import selectors
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Iterable, TypeVar
from urllib.parse import quote

import grpc
from google.protobuf.message import DecodeError
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.support import oracle

__all__ = [
    "BlackHole",
    "OTLPReceiver",
    "ReceivedPoint",
    "ReceivedSpan",
    "decode_attributes",
    "decode_metrics_request",
    "decode_trace_request",
]

HOST = "127.0.0.1"
MODES = ("ok", "unavailable", "reject")
PROTOCOLS = ("grpc", "http/protobuf")

T = TypeVar("T")


# --------------------------------------------------------------------------
# Decoded records
# --------------------------------------------------------------------------


@dataclass
class ReceivedSpan:
    """One span as received, decoded into plain Python values."""

    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str | None  # 16 hex digits, None for a root span
    name: str
    start: float  # seconds since the epoch
    end: float
    attributes: dict[str, Any]  # arrays become tuples, kvlists dicts
    events: list[tuple[str, float, dict[str, Any]]]  # (name, time, attributes)
    status_code: str  # "UNSET" | "OK" | "ERROR"
    status_message: str
    resource: dict[str, Any]
    scope: str  # instrumentation scope name
    kind: str = "INTERNAL"  # "INTERNAL" | "SERVER" | "CLIENT" | "PRODUCER" | "CONSUMER" | "UNSPECIFIED"
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (trace_id, span_id, attributes)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class ReceivedLog:
    """One log record as received, decoded into plain Python values."""

    body: Any
    severity_text: str
    severity_number: int
    trace_id: str | None  # 32 lowercase hex digits; None when the record had no span
    span_id: str | None  # 16 lowercase hex digits
    time: float  # seconds since the epoch
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


@dataclass
class ReceivedPoint:
    """One metric data point as received, flattened with its metric's metadata.

    ``value`` is the number for sums and gauges, and the sum for histograms and
    summaries (``count``, ``bucket_counts`` ... carry the rest).
    """

    name: str
    unit: str
    kind: str  # "sum" | "gauge" | "histogram" | "exponential_histogram" | "summary"
    monotonic: bool | None  # only for sums
    value: int | float | None
    attributes: dict[str, Any]
    resource: dict[str, Any]
    time: float  # seconds since the epoch
    start_time: float | None = None
    temporality: str | None = None  # "cumulative" | "delta" for sums and histograms
    description: str = ""
    scope: str = ""
    count: int | None = None  # histograms and summaries
    bucket_counts: tuple[int, ...] | None = None  # explicit-bucket histograms
    explicit_bounds: tuple[float, ...] | None = None
    min: float | None = None
    max: float | None = None
    #: ``(trace id, span id)`` in hex of each exemplar of the point
    exemplars: tuple[tuple[str | None, str | None], ...] = ()


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def _any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    return getattr(value, which)


def decode_attributes(key_values: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP ``KeyValue`` list -> dict (arrays as tuples)."""
    return {kv.key: _any_value(kv.value) for kv in key_values}


def _seconds(nanos: int) -> float:
    return nanos / 1e9


def _hex_or_none(raw: bytes) -> str | None:
    return raw.hex() if raw else None


def decode_trace_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = decode_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=_hex_or_none(span.parent_span_id),
                        name=span.name,
                        start=_seconds(span.start_time_unix_nano),
                        end=_seconds(span.end_time_unix_nano),
                        attributes=decode_attributes(span.attributes),
                        events=[
                            (e.name, _seconds(e.time_unix_nano), decode_attributes(e.attributes))
                            for e in span.events
                        ],
                        status_code=trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        status_message=span.status.message,
                        resource=dict(resource),
                        scope=scope_spans.scope.name,
                        kind=trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        links=[
                            (link.trace_id.hex(), link.span_id.hex(), decode_attributes(link.attributes))
                            for link in span.links
                        ],
                    )
                )
    return spans


def decode_logs_request(request: logs_service_pb2.ExportLogsServiceRequest) -> list[ReceivedLog]:
    out = []
    for resource_logs in request.resource_logs:
        resource = decode_attributes(resource_logs.resource.attributes)
        for scope_logs in resource_logs.scope_logs:
            for record in scope_logs.log_records:
                out.append(
                    ReceivedLog(
                        body=_any_value(record.body),
                        severity_text=record.severity_text,
                        severity_number=record.severity_number,
                        trace_id=_hex_or_none(record.trace_id),
                        span_id=_hex_or_none(record.span_id),
                        time=_seconds(record.time_unix_nano),
                        attributes=decode_attributes(record.attributes),
                        resource=resource,
                        scope=scope_logs.scope.name,
                    )
                )
    return out


def _temporality(value: int) -> str | None:
    if value == metrics_pb2.AGGREGATION_TEMPORALITY_UNSPECIFIED:
        return None
    return metrics_pb2.AggregationTemporality.Name(value).removeprefix("AGGREGATION_TEMPORALITY_").lower()


def decode_metrics_request(request: metrics_service_pb2.ExportMetricsServiceRequest) -> list[ReceivedPoint]:
    points = []
    for resource_metrics in request.resource_metrics:
        resource = decode_attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            scope = scope_metrics.scope.name
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind is None:
                    continue
                data = getattr(metric, kind)
                common = dict(
                    name=metric.name,
                    unit=metric.unit,
                    kind=kind,
                    description=metric.description,
                    scope=scope,
                    monotonic=data.is_monotonic if kind == "sum" else None,
                    temporality=_temporality(data.aggregation_temporality)
                    if hasattr(data, "aggregation_temporality")
                    else None,
                )
                for dp in data.data_points:
                    extra: dict[str, Any] = {}
                    if kind != "summary":
                        extra["exemplars"] = tuple(
                            (_hex_or_none(e.trace_id), _hex_or_none(e.span_id)) for e in dp.exemplars
                        )
                    if kind in ("sum", "gauge"):
                        which = dp.WhichOneof("value")
                        value = getattr(dp, which) if which else None
                    else:
                        value = dp.sum if kind == "summary" or dp.HasField("sum") else None
                        extra["count"] = dp.count
                        if kind == "histogram":
                            extra["bucket_counts"] = tuple(dp.bucket_counts)
                            extra["explicit_bounds"] = tuple(dp.explicit_bounds)
                        if kind != "summary":
                            extra["min"] = dp.min if dp.HasField("min") else None
                            extra["max"] = dp.max if dp.HasField("max") else None
                    points.append(
                        ReceivedPoint(
                            value=value,
                            attributes=decode_attributes(dp.attributes),
                            resource=dict(resource),
                            time=_seconds(dp.time_unix_nano),
                            start_time=_seconds(dp.start_time_unix_nano) if dp.start_time_unix_nano else None,
                            **common,
                            **extra,
                        )
                    )
    return points


# --------------------------------------------------------------------------
# TLS material
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _TLSFiles:
    ca_cert: str  # what clients trust (OTEL_EXPORTER_OTLP_CERTIFICATE)
    server_cert: str
    server_key: str


_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = placeholder
[v3_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[v3_server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
"""


def _generate_with_openssl(openssl: str, directory: str) -> _TLSFiles:
    def path(name: str) -> str:
        return os.path.join(directory, name)

    with open(path("openssl.cnf"), "w") as f:
        f.write(_OPENSSL_CONFIG)
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    common = ["-config", path("openssl.cnf")]
    commands = [
        [openssl, "req", "-x509", "-new", *common, *new_key, "-extensions", "v3_ca", "-days", "3",
         "-subj", "/CN=dask-otel test CA", "-keyout", path("ca.key"), "-out", path("ca.pem")],
        [openssl, "req", "-new", *common, *new_key, "-subj", "/CN=localhost",
         "-keyout", path("server.key"), "-out", path("server.csr")],
        [openssl, "x509", "-req", "-in", path("server.csr"), "-CA", path("ca.pem"), "-CAkey", path("ca.key"),
         "-set_serial", str(secrets.randbits(63)), "-days", "3", "-extfile", path("openssl.cnf"),
         "-extensions", "v3_server", "-out", path("server.pem")],
    ]  # fmt: skip
    for command in commands:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr}")
    return _TLSFiles(path("ca.pem"), path("server.pem"), path("server.key"))


def _generate_with_cryptography(directory: str) -> _TLSFiles:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        )

    def key_usage(**flags: bool) -> x509.KeyUsage:
        names = ["digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                 "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"]  # fmt: skip
        return x509.KeyUsage(**{n: flags.get(n, False) for n in names})

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        builder("dask-otel test CA", "dask-otel test CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        builder("localhost", "dask-otel test CA", server_key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(digital_signature=True, key_encipherment=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = _TLSFiles(*(os.path.join(directory, n) for n in ("ca.pem", "server.pem", "server.key")))
    with open(files.ca_cert, "wb") as f:
        f.write(ca_cert.public_bytes(serialization.Encoding.PEM))
    with open(files.server_cert, "wb") as f:
        f.write(server_cert.public_bytes(serialization.Encoding.PEM))
    with open(files.server_key, "wb") as f:
        f.write(
            server_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return files


_tls_lock = threading.Lock()
_tls_cache: _TLSFiles | None = None
_tls_tmpdir: tempfile.TemporaryDirectory | None = None


def _generate_tls_files(directory: str, backend: str | None = None) -> _TLSFiles:
    """A CA and a server certificate for IP:127.0.0.1/DNS:localhost in ``directory``.

    ``backend`` is "openssl" (the CLI, preferred), "cryptography" or None (auto).
    """
    openssl = shutil.which("openssl")
    if backend == "openssl" or (backend is None and openssl):
        if not openssl:
            raise RuntimeError("the openssl CLI is not on PATH")
        return _generate_with_openssl(openssl, directory)
    return _generate_with_cryptography(directory)


def tls_files() -> _TLSFiles:
    """The process-wide test certificates (generated on first use, removed at exit)."""
    global _tls_cache, _tls_tmpdir
    with _tls_lock:
        if _tls_cache is None:
            _tls_tmpdir = tempfile.TemporaryDirectory(prefix="otlp-receiver-tls-")
            _tls_cache = _generate_tls_files(_tls_tmpdir.name)
        return _tls_cache


# --------------------------------------------------------------------------
# Receiver
# --------------------------------------------------------------------------


@dataclass
class _Reply:
    """What the transport should answer to one Export request."""

    ok: bool
    grpc_code: grpc.StatusCode = grpc.StatusCode.OK
    http_status: int = 200
    message: str = ""
    retry_after: float | None = None


class OTLPReceiver:
    """A real OTLP/gRPC or OTLP/HTTP (protobuf) receiver on 127.0.0.1.

    Parameters
    ----------
    protocol:
        ``"grpc"`` or ``"http/protobuf"``.
    tls:
        Serve TLS with a certificate for 127.0.0.1/localhost signed by a test
        CA; point clients at :attr:`certificate_path`.
    mode:
        Initial fault mode, see :attr:`mode`.
    port:
        Port to bind; 0 (the default) picks a free one, which is then kept
        across ``stop()``/``start()``.

    Attributes that tests may set at any time:

    ``mode``
        ``"ok"``: accept and record data. ``"unavailable"``: answer gRPC
        UNAVAILABLE / HTTP 503 (retryable; data is not recorded).
        ``"reject"``: answer gRPC INVALID_ARGUMENT / HTTP 400 (not retryable).
    ``retry_after``
        Seconds; when set, "unavailable" answers carry a retry hint (gRPC
        ``google.rpc.RetryInfo`` trailer, HTTP ``Retry-After``) which the
        Python exporters use instead of their exponential backoff.
    ``delay``
        Seconds to wait before answering each request (cut short by stop()).
    ``refuse``
        Signals (``"traces"``, ``"metrics"``, ``"logs"``) not served at all, like
        a traces-only backend: answered with HTTP ``refuse_status`` (405 Method
        Not Allowed, as Phoenix answers; 404 and 501 mean the same) or gRPC
        UNIMPLEMENTED, not recorded, whatever the mode.
    """

    def __init__(
        self,
        protocol: str = "grpc",
        tls: bool = False,
        mode: str = "ok",
        *,
        port: int = 0,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        self.protocol = protocol
        self.tls = tls
        self.mode = mode
        self.retry_after: float | None = None
        self.delay: float = 0.0
        self.refuse: set[str] = set()
        self.refuse_status: int = 405
        self._port = port
        self._tls_files = tls_files() if tls else None

        self._cond = threading.Condition()
        self._generation = 0  # bumped on every request, for wait_for
        self._spans: list[ReceivedSpan] = []
        self._points: list[ReceivedPoint] = []
        self._logs: list[ReceivedLog] = []
        self._raw: list[tuple[str, Any]] = []
        self._headers: list[dict[str, str]] = []
        self._requests = 0
        self._rejected = 0

        self._stopping = threading.Event()
        self._grpc_server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._http: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    # -- configuration ---------------------------------------------------

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {value!r}")
        self._mode = value

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("the receiver has not been started")
        return self._port

    @property
    def running(self) -> bool:
        return self._grpc_server is not None or self._http is not None

    @property
    def endpoint(self) -> str:
        """Base URL for OTEL_EXPORTER_OTLP_ENDPOINT or a gRPC exporter's ``endpoint``."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{HOST}:{self.port}"

    @property
    def traces_endpoint(self) -> str:
        """``endpoint=`` argument for a span exporter of this protocol (HTTP needs the path)."""
        return self.endpoint + ("/v1/traces" if self.protocol == "http/protobuf" else "")

    @property
    def metrics_endpoint(self) -> str:
        """``endpoint=`` argument for a metric exporter of this protocol."""
        return self.endpoint + ("/v1/metrics" if self.protocol == "http/protobuf" else "")

    @property
    def certificate_path(self) -> str | None:
        """PEM file of the CA that signed the server certificate (None without TLS)."""
        return self._tls_files.ca_cert if self._tls_files else None

    def env(self, headers: dict[str, str] | None = None) -> dict[str, str]:
        """Environment variables pointing SDK exporters at this receiver.

        OTEL_EXPORTER_OTLP_ENDPOINT and _PROTOCOL; _INSECURE=true for plain
        gRPC; _CERTIFICATE with TLS; _HEADERS from ``headers``. For
        http/protobuf with TLS also REQUESTS_CA_BUNDLE: the HTTP exporters use
        a ``requests.Session`` whose ``verify`` (their certificate file) is
        silently overridden by REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE when those are
        set, as they often are on CI machines.
        """
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol,
        }
        if self.certificate_path:
            env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = self.certificate_path
            if self.protocol == "http/protobuf":
                env["REQUESTS_CA_BUNDLE"] = self.certificate_path
        elif self.protocol == "grpc":
            env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
        if headers:
            env["OTEL_EXPORTER_OTLP_HEADERS"] = ",".join(
                f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in headers.items()
            )
        return env

    def apply_env(self, monkeypatch: Any, headers: dict[str, str] | None = None) -> dict[str, str]:
        """Set :meth:`env` with pytest's ``monkeypatch``, first removing every other
        OTEL_EXPORTER_OTLP_* variable (signal-specific ones would take precedence)."""
        env = self.env(headers)
        set_otel_env(monkeypatch, env)
        return env

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> OTLPReceiver:
        """Start serving (again, on the same port after a stop())."""
        if self.running:
            return self
        if oracle.current is not None:  # the oracle reads what it received
            oracle.current.receivers.append(self)
        self._stopping.clear()
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def stop(self) -> None:
        """Stop serving and drop all client connections; recorded data is kept."""
        self._stopping.set()
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=0).wait(5)
            self._grpc_server = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._http_thread is not None:
            self._http_thread.join(5)
            self._http_thread = None
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.endpoint if self._port else "unstarted"
        return f"<OTLPReceiver {self.protocol} {where} mode={self.mode} requests={self._requests}>"

    def _start_grpc(self) -> None:
        self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-receiver-grpc")
        server = grpc.server(
            self._executor,
            options=[
                ("grpc.so_reuseport", 0),  # a second live server must not share our port
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ],
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsServicer(self), server)
        address = f"{HOST}:{self._port}"

        def bind() -> int:
            try:
                if self._tls_files is None:
                    return server.add_insecure_port(address)
                with open(self._tls_files.server_key, "rb") as k, open(self._tls_files.server_cert, "rb") as c:
                    credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
                return server.add_secure_port(address, credentials)
            except RuntimeError:  # newer grpcio raise instead of returning 0
                return 0

        port = _retry_bind(bind, restarting=bool(self._port))
        if not port:
            self._executor.shutdown(wait=False)
            raise OSError(f"gRPC OTLP receiver could not bind {address}")
        self._port = port
        server.start()
        self._grpc_server = server

    def _start_http(self) -> None:
        context = None
        if self._tls_files is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self._tls_files.server_cert, self._tls_files.server_key)

        def bind() -> _HTTPServer | None:
            try:
                return _HTTPServer((HOST, self._port), self, context)
            except OSError:
                return None

        server = _retry_bind(bind, restarting=bool(self._port))
        if server is None:
            raise OSError(f"HTTP OTLP receiver could not bind {HOST}:{self._port}")
        self._port = server.server_address[1]
        self._http = server
        self._http_thread = threading.Thread(
            target=server.serve, name=f"otlp-receiver-http-{self._port}", daemon=True
        )
        self._http_thread.start()

    # -- request handling (called from transport threads) -----------------

    def _handle(self, signal: str, headers: dict[str, str], request: Any) -> _Reply:
        """Record one decoded Export request and decide the answer."""
        if self.delay:
            self._stopping.wait(self.delay)
        mode = "refuse" if signal in self.refuse else self._mode
        with self._cond:
            self._requests += 1
            self._headers.append(headers)
            if mode == "ok":
                self._raw.append((signal, request))
                if signal == "traces":
                    self._spans.extend(decode_trace_request(request))
                elif signal == "logs":
                    self._logs.extend(decode_logs_request(request))
                else:
                    self._points.extend(decode_metrics_request(request))
            else:
                self._rejected += 1
            self._generation += 1
            self._cond.notify_all()
        if mode == "ok":
            return _Reply(ok=True)
        if mode == "refuse":
            return _Reply(
                ok=False,
                grpc_code=grpc.StatusCode.UNIMPLEMENTED,
                http_status=self.refuse_status,
                message=f"OTLPReceiver does not serve {signal}",
            )
        if mode == "unavailable":
            return _Reply(
                ok=False,
                grpc_code=grpc.StatusCode.UNAVAILABLE,
                http_status=503,
                message="OTLPReceiver is in mode 'unavailable'",
                retry_after=self.retry_after,
            )
        return _Reply(
            ok=False,
            grpc_code=grpc.StatusCode.INVALID_ARGUMENT,
            http_status=400,
            message="OTLPReceiver is in mode 'reject'",
        )

    def _note_bad_request(self, headers: dict[str, str]) -> None:
        with self._cond:
            self._requests += 1
            self._rejected += 1
            self._headers.append(headers)
            self._generation += 1
            self._cond.notify_all()

    # -- received data -----------------------------------------------------

    def spans(self, name: str | None = None) -> list[ReceivedSpan]:
        """All spans received so far, in arrival order (optionally only those called ``name``)."""
        with self._cond:
            return [s for s in self._spans if name is None or s.name == name]

    def metric_points(self, name: str | None = None) -> list[ReceivedPoint]:
        """All metric points from every accepted Export request, in arrival order."""
        with self._cond:
            return [p for p in self._points if name is None or p.name == name]

    def logs(self) -> list[ReceivedLog]:
        """All log records received so far, in arrival order."""
        with self._cond:
            return list(self._logs)

    def span_names(self) -> list[str]:
        """Distinct span names, in order of first arrival."""
        return list(dict.fromkeys(s.name for s in self.spans()))

    def metric_names(self) -> list[str]:
        """Distinct metric names, in order of first arrival."""
        return list(dict.fromkeys(p.name for p in self.metric_points()))

    @property
    def requests(self) -> int:
        """Number of Export requests that reached the receiver, including rejected ones."""
        with self._cond:
            return self._requests

    @property
    def rejected(self) -> int:
        """Number of Export requests answered with an error (fault modes, undecodable bodies)."""
        with self._cond:
            return self._rejected

    @property
    def headers(self) -> list[dict[str, str]]:
        """gRPC metadata / HTTP headers of every request (keys lower-cased), in arrival order."""
        with self._cond:
            return list(self._headers)

    @property
    def raw_requests(self) -> list[tuple[str, Any]]:
        """``("traces" | "metrics", Export*ServiceRequest)`` of every accepted request."""
        with self._cond:
            return list(self._raw)

    def clear(self) -> None:
        """Forget everything received so far (counters included)."""
        with self._cond:
            self._spans.clear()
            self._points.clear()
            self._logs.clear()
            self._raw.clear()
            self._headers.clear()
            self._requests = 0
            self._rejected = 0

    def wait_for(self, predicate: Callable[[OTLPReceiver], T], timeout: float = 30) -> T:
        """Wait until ``predicate(self)`` is truthy and return that value.

        The predicate is re-evaluated whenever a request arrives (and at least
        every 0.25 s). Raises AssertionError with a summary of what was
        received if ``timeout`` seconds pass first.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                generation = self._generation
            value = predicate(self)
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {_describe(predicate)}; {self.summary()}")
            with self._cond:
                self._cond.wait_for(lambda: self._generation != generation, timeout=min(remaining, 0.25))

    def summary(self) -> str:
        """One-line description of what has been received, for failure messages."""
        return (
            f"{self!r} received {len(self.spans())} spans {self.span_names()} and "
            f"{len(self.metric_points())} metric points {self.metric_names()}; "
            f"{self.rejected} requests rejected"
        )


def _describe(predicate: Callable[..., Any]) -> str:
    name = getattr(predicate, "__qualname__", repr(predicate))
    code = getattr(predicate, "__code__", None)
    if code is not None:
        name += f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return name


def _retry_bind(bind: Callable[[], T], restarting: bool) -> T:
    """Call ``bind`` until it succeeds; on a restart, allow the old listener a few seconds to go."""
    deadline = time.monotonic() + (5 if restarting else 0)
    delay = 0.02
    while True:
        result = bind()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


# -- gRPC ------------------------------------------------------------------


def _grpc_answer(reply: _Reply, context: grpc.ServicerContext) -> None:
    if reply.ok:
        return
    if reply.retry_after is not None:
        info = RetryInfo()
        info.retry_delay.FromNanoseconds(int(reply.retry_after * 1e9))
        context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
    context.set_code(reply.grpc_code)
    context.set_details(reply.message)


def _grpc_metadata(context: grpc.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in context.invocation_metadata()}


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        _grpc_answer(self._receiver._handle("traces", _grpc_metadata(context), request), context)
        return trace_service_pb2.ExportTraceServiceResponse()


class _LogsServicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802
        _grpc_answer(self._receiver._handle("logs", _grpc_metadata(context), request), context)
        return logs_service_pb2.ExportLogsServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802
        _grpc_answer(self._receiver._handle("metrics", _grpc_metadata(context), request), context)
        return metrics_service_pb2.ExportMetricsServiceResponse()


# -- HTTP --------------------------------------------------------------------

_HTTP_SIGNALS = {
    "/v1/traces": (
        "traces",
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "/v1/metrics": (
        "metrics",
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
    "/v1/logs": (
        "logs",
        logs_service_pb2.ExportLogsServiceRequest,
        logs_service_pb2.ExportLogsServiceResponse,
    ),
}


class _HTTPHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real collector
    timeout = 30  # bounds idle keep-alive connections
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # silence per-request logging
        pass

    def do_POST(self) -> None:  # noqa: N802
        headers = {k.lower(): v for k, v in self.headers.items()}
        target = _HTTP_SIGNALS.get(self.path.split("?", 1)[0])
        if target is None:
            self._send(404, b"unknown path", "text/plain")
            return
        signal, request_type, response_type = target
        body = self._read_body()
        try:
            request = request_type.FromString(_decompress(body, self.headers.get("Content-Encoding", "")))
        except (ValueError, DecodeError, zlib.error, EOFError, OSError) as error:
            self.server.receiver._note_bad_request(headers)
            self._send(400, f"bad request: {error}".encode(), "text/plain")
            return
        reply = self.server.receiver._handle(signal, headers, request)
        if reply.ok:
            self._send(200, response_type().SerializeToString(), "application/x-protobuf")
        else:
            extra = {} if reply.retry_after is None else {"Retry-After": f"{reply.retry_after:g}"}
            self._send(reply.http_status, reply.message.encode(), "text/plain", extra)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []
        while size := int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()  # CRLF after the chunk
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


def _decompress(body: bytes, content_encoding: str) -> bytes:
    encoding = content_encoding.lower().strip()
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding in ("", "identity"):
        return body
    raise ValueError(f"unsupported Content-Encoding {encoding!r}")


class _HTTPServer:
    """Accept loop plus one daemon thread per connection; close() drops everything at once.

    (socketserver's serve_forever polls for shutdown and cannot drop
    kept-alive connections, which a "collector went away" test needs.)
    """

    def __init__(self, address: tuple[str, int], receiver: OTLPReceiver, ssl_context: ssl.SSLContext | None):
        self.receiver = receiver
        self.ssl_context = ssl_context
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self.server_address = self._listener.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False

    def serve(self) -> None:
        """Run the accept loop until close(); closes the listening socket on exit."""
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._listener, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not self._closed:
                    for key, _ in selector.select():
                        if key.fileobj is self._listener:
                            self._accept()
        finally:
            self._listener.close()
            self._wake_r.close()

    def _accept(self) -> None:
        try:
            conn, client_address = self._listener.accept()
        except OSError:
            return
        if not self._track(conn):
            return
        threading.Thread(
            target=self._serve_connection,
            args=(conn, client_address),
            name=f"otlp-receiver-http-{client_address[1]}",
            daemon=True,
        ).start()

    def _serve_connection(self, conn: socket.socket, client_address: tuple[str, int]) -> None:
        sock = conn
        try:
            conn.settimeout(_HTTPHandler.timeout)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                self._forget(conn)  # detached by wrap_socket; track its replacement
                if not self._track(sock):
                    return
                sock.do_handshake()
            _HTTPHandler(sock, client_address, self)
        except (OSError, ValueError):
            pass  # client went away, TLS failure, or close()
        finally:
            self._forget(sock)
            sock.close()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                sock.close()
                return False
            self._connections.add(sock)
            return True

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

    def close(self) -> None:
        """Stop accepting and shut down every open connection (serve() then returns)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            self._connections.clear()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # serve() saw _closed on its own (an accept woke it) and closed _wake_r
        self._wake_w.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# --------------------------------------------------------------------------
# Black hole
# --------------------------------------------------------------------------


def set_otel_env(monkeypatch: Any, env: dict[str, str]) -> None:
    """Set ``env`` with pytest's ``monkeypatch``, first removing every
    OTEL_EXPORTER_OTLP_* variable (signal-specific ones would take precedence)."""
    for key in list(os.environ):
        if key.startswith("OTEL_EXPORTER_OTLP_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed): a
    collector that is down and refuses connections"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BlackHole:
    """Accepts TCP connections on 127.0.0.1 and never reads or answers: a hung collector.

    Use ``.endpoint`` (or ``.env(protocol)``) as an exporter's endpoint.
    """

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def connections(self) -> int:
        """Number of connections accepted so far."""
        with self._lock:
            return len(self._connections)

    def env(self, protocol: str = "grpc") -> dict[str, str]:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        if protocol == "grpc":
            env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
        return env

    def start(self) -> BlackHole:
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept_loop, name="otlp-black-hole", daemon=True)
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake_r is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    with self._lock:
                        self._connections.append(conn)  # held open, never read

    def stop(self) -> None:
        if self._listener is None:
            return
        assert self._wake_w is not None and self._thread is not None
        self._wake_w.send(b"x")
        self._thread.join(5)
        with self._lock:
            connections, self._connections = self._connections, []
        for sock in [*connections, self._listener, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self._listener = self._wake_r = self._wake_w = self._thread = None

    def __enter__(self) -> BlackHole:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
