"""The ``otel:`` dask config namespace, and the one place that builds SDK objects.

Everything about *where* telemetry goes (endpoint, protocol, headers, certificate,
timeouts, batching, resource attributes, service name) is read by the OpenTelemetry
SDK itself from the standard ``OTEL_*`` environment variables. This module only
chooses exporters by name, the way ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
name them, and validates the handful of Dask-specific knobs under ``otel:``.

One :class:`Telemetry` exists per process at a time: a LocalCluster with
``processes=False`` runs a scheduler and several workers in one process, and they
share one TracerProvider and one MeterProvider (a Prometheus registry can hold the
bridge's collector only once). It is created by the first Dask server that attaches
and shut down, flushing, when the last one detaches. The bridge never touches the
global OpenTelemetry providers, so it does not interfere with the application's own
instrumentation.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask.config
import yaml
from dask.utils import parse_timedelta
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger("dask_otel")

with open(Path(__file__).with_name("otel.yaml")) as f:
    DEFAULTS: dict = yaml.safe_load(f)
dask.config.update_defaults(DEFAULTS)

TRACES_EXPORTERS = ("otlp", "console", "memory", "none")
METRICS_EXPORTERS = ("otlp", "prometheus", "console", "memory", "none")
#: Protocols of ``OTEL_EXPORTER_OTLP_PROTOCOL`` that the Python SDK implements
OTLP_PROTOCOLS = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
#: service.name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES sets one
DEFAULT_SERVICE_NAME = "dask"
#: Span attribute value length when no OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT is set:
#: span tags are user data, and a 1 MB tag must not become a 1 MB attribute.
DEFAULT_ATTRIBUTE_LENGTH = 4096


class ConfigError(ValueError):
    """A value under ``otel:`` or in an ``OTEL_*`` variable that the bridge cannot use.

    The message names the key and the value at fault.
    """

    def __init__(self, key: str, value: Any, expected: str):
        self.key = key
        self.value = value
        super().__init__(f"{key}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class OtelConfig:
    """A validated snapshot of the ``otel:`` dask config namespace"""

    #: otel.enabled
    enabled: bool
    #: otel.flush-timeout, seconds
    flush_timeout: float
    #: otel.traces.exporter, resolved against OTEL_TRACES_EXPORTER
    traces_exporters: tuple[str, ...]
    #: otel.spans.poll-interval, seconds
    poll_interval: float
    #: otel.spans.export-delay, seconds
    export_delay: float
    #: otel.spans.metrics-timeout, seconds
    metrics_timeout: float
    #: otel.spans.totals: "subtree" or "own"
    span_totals: str
    #: otel.spans.code
    export_code: bool
    #: otel.metrics.exporter, resolved against OTEL_METRICS_EXPORTER
    metrics_exporters: tuple[str, ...]
    #: otel.metrics.span-label
    span_label: bool


def read_config() -> OtelConfig:
    """Read and validate ``otel.*`` from dask config.

    Raises
    ------
    ConfigError
        naming the first key (or ``OTEL_*`` variable) whose value is unusable.
    """
    _warn_unknown_keys(dask.config.get("otel", default={}), DEFAULTS["otel"], "otel")
    return OtelConfig(
        enabled=_bool("otel.enabled"),
        flush_timeout=_seconds("otel.flush-timeout"),
        traces_exporters=_exporters("otel.traces.exporter", "TRACES", TRACES_EXPORTERS),
        poll_interval=_seconds("otel.spans.poll-interval", positive=True),
        export_delay=_seconds("otel.spans.export-delay"),
        metrics_timeout=_seconds("otel.spans.metrics-timeout"),
        span_totals=_choice("otel.spans.totals", ("subtree", "own")),
        export_code=_bool("otel.spans.code"),
        metrics_exporters=_exporters("otel.metrics.exporter", "METRICS", METRICS_EXPORTERS),
        span_label=_bool("otel.metrics.span-label"),
    )


def _warn_unknown_keys(given: Any, defaults: dict, prefix: str) -> None:
    if not isinstance(given, dict):
        raise ConfigError(prefix, given, "a mapping")
    for key, value in given.items():
        canonical = key.replace("_", "-")
        if canonical not in defaults:
            logger.warning("Unknown dask config key %s.%s; ignored", prefix, key)
        elif isinstance(defaults[canonical], dict):
            _warn_unknown_keys(value, defaults[canonical], f"{prefix}.{canonical}")


def _bool(key: str) -> bool:
    value = dask.config.get(key)
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")
    return value


def _choice(key: str, choices: Sequence[str]) -> str:
    value = dask.config.get(key)
    if value not in choices:
        raise ConfigError(key, value, " or ".join(map(repr, choices)))
    return value


def _seconds(key: str, positive: bool = False) -> float:
    value = dask.config.get(key)
    try:
        out = parse_timedelta(value)
    except Exception:
        out = None
    if isinstance(value, bool) or out is None or out < 0 or (positive and out == 0):
        raise ConfigError(key, value, "a positive duration like '500ms' or '2s'")
    return out


def _exporters(key: str, signal: str, known: Sequence[str]) -> tuple[str, ...]:
    """Exporter names from dask config, falling back to OTEL_<signal>_EXPORTER"""
    env = f"OTEL_{signal}_EXPORTER"
    group = f"opentelemetry_{signal.lower()}_exporter"
    value = dask.config.get(key)
    source = key
    if value is None:
        value, source = os.environ.get(env, "otlp"), env
    if isinstance(value, str):
        value = [v for v in (v.strip() for v in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(source, value, "a list of exporter names")
    installed = {ep.name for ep in entry_points(group=group)}
    for name in value:
        if name not in known and name not in installed:
            raise ConfigError(source, name, f"one of {', '.join(known)}")
    names = tuple(dict.fromkeys(value))
    if "otlp" in names:
        _otlp_entry_point(signal)  # validates OTEL_EXPORTER_OTLP_*PROTOCOL now
    return tuple(n for n in names if n != "none")


def _otlp_entry_point(signal: str) -> str:
    """The exporter entry point for ``otlp``, by OTEL_EXPORTER_OTLP_[signal_]PROTOCOL.

    The SDK's exporters read endpoint, headers, certificate, compression and
    timeout themselves; only the choice between gRPC and HTTP is made here.
    """
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if protocol := os.environ.get(var, "").strip():
            if protocol not in OTLP_PROTOCOLS:
                raise ConfigError(var, protocol, " or ".join(OTLP_PROTOCOLS))
            return OTLP_PROTOCOLS[protocol]
    return OTLP_PROTOCOLS["grpc"]


def _build_exporter(group: str, name: str, **kwargs: Any) -> Any:
    """An exporter from its entry point; it reads its own OTEL_* variables.

    The SDK's errors for a malformed variable do not always name it ("could not
    convert string to float: 'forever'"): name the variable holding that value.
    """
    (ep,) = (ep for ep in entry_points(group=group) if ep.name == name)
    try:
        cls = ep.load()
        try:
            return cls(**kwargs)
        except TypeError:
            if not kwargs:
                raise
            return cls()  # an exporter without SDK metrics (older, third-party)
    except Exception as e:
        culprits = [
            k for k, v in os.environ.items()
            if k.startswith("OTEL_") and v.strip() and v.strip() in str(e)
        ]
        raise ConfigError(
            ", ".join(culprits) or f"the {name} exporter's OTEL_* settings",
            os.environ[culprits[0]] if culprits else str(e),
            f"a value the OpenTelemetry SDK accepts ({type(e).__name__}: {e})",
        ) from e


def build_resource(**attributes: Any):
    """Resource of this process: the caller's attributes, ``service.name=dask``,
    overridden by OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME as the SDK reads them.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    ours = {
        "service.name": DEFAULT_SERVICE_NAME,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        **attributes,
    }
    return Resource.create(ours).merge(OTELResourceDetector().detect())


# --- traces ---------------------------------------------------------------------


def span_exporters(names: Sequence[str], meter_provider: Any = None) -> list:
    """SpanExporters for ``otel.traces.exporter`` names; each reads its own OTEL_*.

    OTLP exporters report their own SDK metrics to ``meter_provider``.
    """
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    out = []
    for name in names:
        if name == "memory":
            out.append(InMemorySpanExporter())
        elif name == "console":
            out.append(ConsoleSpanExporter())
        else:
            if name == "otlp":
                name = _otlp_entry_point("TRACES")
            kwargs = {"meter_provider": meter_provider} if meter_provider else {}
            out.append(_build_exporter("opentelemetry_traces_exporter", name, **kwargs))
    return out


class _HeldExporterLogs(logging.Filter):
    """Holds back the log records that the SDK's exporters emit while a dask_otel
    export runs in the current thread (one WARNING and one ERROR per failed batch,
    per retry), so that :class:`ExportOutage` can log once per outage instead."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        held = getattr(self.local, "held", None)
        if held is None:
            return True
        held.append(record)
        return False

    def attach(self) -> None:
        # Filters apply to the logger a record is logged on, not its ancestors:
        # attach to every exporter module's logger (imported by now)
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("opentelemetry.exporter"):
                logging.getLogger(name).addFilter(self)


_HELD_LOGS = _HeldExporterLogs()


class ExportOutage:
    """Counts what one exporter shipped and lost, and logs an outage once: a WARNING
    with the exporter's reason when exports start failing, one when they recover.
    Runs in the SDK's export thread."""

    def __init__(self, signal: str):
        self.signal = signal
        #: items the collector accepted
        self.exported = 0
        #: items lost because an export failed after the SDK's retries
        self.failed = 0
        #: failed export calls
        self.export_failures = 0
        #: failed export calls since the last success
        self.failing = 0

    def export(self, export: Callable[[], Any], items: int) -> bool:
        _HELD_LOGS.local.held = held = []
        try:
            ok = bool(export())
        except Exception as e:
            held.append(logging.makeLogRecord({"msg": f"{type(e).__name__}: {e}"}))
            ok = False
        finally:
            _HELD_LOGS.local.held = None
        if ok:
            self.exported += items
            if self.failing:
                logger.warning(
                    "dask_otel: %s export recovered after %d failed exports",
                    self.signal, self.failing,
                )
                self.failing = 0
            return True
        self.failed += items
        self.export_failures += 1
        reason = held[-1].getMessage() if held else "the exporter returned FAILURE"
        logger.debug("dask_otel: %s export failed: %s", self.signal, reason)
        if not self.failing:
            logger.warning(
                "dask_otel: cannot export %s (%s); dropping them until the collector "
                "answers again (counted in the self-metrics, logged once per outage)",
                self.signal, reason,
            )
        self.failing += 1
        return False


class GatedSpanExporter(SpanExporter):
    """A SpanExporter with :class:`ExportOutage` accounting"""

    def __init__(self, exporter: SpanExporter):
        self.exporter = exporter
        self.outage = ExportOutage("spans")

    def export(self, spans):
        ok = self.outage.export(
            lambda: self.exporter.export(spans) is SpanExportResult.SUCCESS, len(spans)
        )
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    # The self-metrics read these
    spans_exported = property(lambda self: self.outage.exported)
    spans_failed = property(lambda self: self.outage.failed)
    export_failures = property(lambda self: self.outage.export_failures)


def _gated_metric_exporter(exporter: Any) -> Any:
    """The metric exporter wrapped with :class:`ExportOutage` accounting"""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class GatedMetricExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=exporter._preferred_temporality,
                preferred_aggregation=exporter._preferred_aggregation,
            )
            self.exporter = exporter
            self.outage = ExportOutage("metrics")

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            ok = self.outage.export(
                lambda: self.exporter.export(metrics_data, timeout_millis=timeout_millis)
                is MetricExportResult.SUCCESS,
                1,
            )
            return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return self.exporter.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            self.exporter.shutdown(timeout_millis=timeout_millis)

    return GatedMetricExporter()


class SpanSink:
    """Where the mirror hands the spans it builds: already finished, so they go
    straight to the SDK's span processors as ``ReadableSpan``s, with what a Tracer
    would add (resource, instrumentation scope, the sampler's decision, attribute
    length limits) and without what only live spans need (locks, contexts, ids from
    an IdGenerator: the mirror's ids come from Dask).
    """

    def __init__(self, provider: TracerProvider, processors: list, limits: Any):
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from dask_otel import __version__

        self.provider = provider
        self.processors = processors
        self.resource = provider.resource
        self.scope = InstrumentationScope("dask_otel", __version__)
        #: OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, or ours; None: no limit
        self.max_length: int | None = limits.max_span_attribute_length

    def sampled(self, trace_id: int, root_name: str) -> bool:
        """The sampler's decision for a whole trace (OTEL_TRACES_SAMPLER).

        Asked as for the root, whichever span of the trace is exported first, so
        that a trace-id ratio sampler keeps or drops whole traces.
        """
        result = self.provider.sampler.should_sample(None, trace_id, root_name)
        return result.decision.is_sampled()

    def emit(self, span: Any) -> None:
        for processor in self.processors:
            processor.on_end(span)


def _span_limits():
    from opentelemetry.sdk.trace import SpanLimits

    set_by_env = any(
        v in os.environ
        for v in (
            "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        )
    )
    return SpanLimits(
        max_span_attribute_length=None if set_by_env else DEFAULT_ATTRIBUTE_LENGTH
    )


# --- the per-process telemetry ----------------------------------------------------


class Telemetry:
    """The SDK providers of this process, shared by every Dask server in it.

    ``spans`` exists only when traces are exported;
    ``meter_provider`` only when metrics are. ``span_exporters`` are kept so that
    tests and the demo can read an in-memory exporter.
    """

    _lock = threading.Lock()
    _current: Telemetry | None = None
    _users: int = 0

    def __init__(self, config: OtelConfig, resource_attributes: dict[str, Any]):
        from opentelemetry.sdk.metrics import MeterProvider

        self.config = config
        self.resource = build_resource(**resource_attributes)
        self.span_exporters: list = []
        #: one per batched exporter, for the self-metrics
        self.export_stats: list[GatedSpanExporter] = []
        self.tracer_provider: TracerProvider | None = None
        self._spans: SpanSink | None = None
        self.metric_readers = metric_readers(config.metrics_exporters)
        self.meter_provider = None
        if self.metric_readers:
            self.meter_provider = MeterProvider(
                metric_readers=self.metric_readers,
                resource=self.resource,
                shutdown_on_exit=False,
            )

    @property
    def spans(self) -> SpanSink | None:
        """Where this process's mirrored spans go, built on first use (only
        schedulers mirror spans, so workers never start a span processor thread);
        None when ``otel.traces.exporter`` is none."""
        with self._lock:
            if self._spans is None and self.config.traces_exporters:
                self._spans = self._build_spans()
        return self._spans

    def _build_spans(self) -> SpanSink:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SimpleSpanProcessor,
        )
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        self.span_exporters = span_exporters(
            self.config.traces_exporters, self.meter_provider
        )
        limits = _span_limits()
        # The provider reads OTEL_TRACES_SAMPLER and owns flush and shutdown
        self.tracer_provider = TracerProvider(
            resource=self.resource,
            span_limits=limits,
            # We own the lifecycle (flush on close, bounded by otel.flush-timeout);
            # an atexit shutdown could hold a dying process on a dead collector.
            shutdown_on_exit=False,
        )
        processors = []
        for exporter in self.span_exporters:
            # The in-memory exporter is for tests and the demo: no batching delay
            if isinstance(exporter, InMemorySpanExporter):
                processor = SimpleSpanProcessor(exporter)
            else:
                gated = GatedSpanExporter(exporter)
                self.export_stats.append(gated)
                processor = BatchSpanProcessor(gated, **self._sdk_metrics)
            self.tracer_provider.add_span_processor(processor)
            processors.append(processor)
        _HELD_LOGS.attach()
        return SpanSink(self.tracer_provider, processors, limits)

    @property
    def _sdk_metrics(self) -> dict[str, Any]:
        """The SDK's own metrics (queue size, spans dropped by a full queue, export
        duration), opt-in with OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true, go to
        this MeterProvider rather than the application's global one."""
        return {"meter_provider": self.meter_provider} if self.meter_provider else {}

    @classmethod
    def acquire(cls, config: OtelConfig, **resource_attributes: Any) -> Telemetry:
        """The process's Telemetry, created on first use"""
        with cls._lock:
            if cls._current is None:
                cls._current = Telemetry(config, resource_attributes)
            cls._users += 1
            return cls._current

    @classmethod
    def release(cls, telemetry: Telemetry) -> None:
        """Detach one user; the last one flushes and shuts the providers down"""
        with cls._lock:
            if cls._current is not telemetry:
                return
            cls._users -= 1
            if cls._users > 0:
                return
            cls._current = None
        telemetry.shutdown()

    def force_flush(self) -> None:
        timeout_ms = int(self.config.flush_timeout * 1000)
        if self.tracer_provider:
            self.tracer_provider.force_flush(timeout_ms)
        if self.meter_provider:
            self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush within otel.flush-timeout, then stop the SDK's threads"""
        try:
            self.force_flush()
        finally:
            if self.tracer_provider:
                self.tracer_provider.shutdown()
            if self.meter_provider:
                self.meter_provider.shutdown(
                    timeout_millis=self.config.flush_timeout * 1000
                )


# --- metrics --------------------------------------------------------------------


def metric_readers(names: Sequence[str]) -> list:
    """MetricReaders for ``otel.metrics.exporter`` names; each reads its own OTEL_*.

    ``prometheus`` registers with prometheus_client's default registry, which is
    what Dask's own ``/metrics`` endpoint serves on every scheduler and worker.
    """
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        InMemoryMetricReader,
        PeriodicExportingMetricReader,
    )

    out = []
    for name in names:
        if name == "memory":
            out.append(InMemoryMetricReader())
        elif name == "prometheus":
            try:
                from opentelemetry.exporter.prometheus import PrometheusMetricReader
            except ImportError:
                raise ConfigError(
                    "otel.metrics.exporter",
                    name,
                    "opentelemetry-exporter-prometheus to be installed "
                    "(pip install 'dask-otel[prometheus]')",
                ) from None
            out.append(PrometheusMetricReader())
        elif name == "console":
            out.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        else:
            if name == "otlp":
                name = _otlp_entry_point("METRICS")
            exporter = _build_exporter("opentelemetry_metrics_exporter", name)
            out.append(PeriodicExportingMetricReader(_gated_metric_exporter(exporter)))
            _HELD_LOGS.attach()
    return out
