"""The per-process :class:`Telemetry`: the SDK providers every Dask server of a
process shares, and the :class:`SpanSink` the span mirror hands its spans to.

One Telemetry exists per process at a time: a LocalCluster with
``processes=False`` runs a scheduler and several workers in one process, and they
share one TracerProvider and one MeterProvider (a Prometheus registry can hold the
bridge's collector only once). It is created by the first Dask server that attaches
and shut down, flushing, when the last one detaches.

The bridge never replaces an application's global OpenTelemetry providers. Only
on a worker process that has no global TracerProvider (``dask worker`` usually
has none) does :func:`adopt_global_tracer_provider` make the bridge's the global
one, so that spans made with the OTel API inside tasks are exported.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from dask_otel.config import ConfigError, OtelConfig
from dask_otel.exporters import metric_readers, span_exporters
from dask_otel.outage import HELD_EXPORTER_LOGS, GatedSpanExporter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

#: service.name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES sets one
DEFAULT_SERVICE_NAME = "dask"
#: Span attribute value length when no OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT is set:
#: span tags are user data, and a 1 MB tag must not become a 1 MB attribute.
DEFAULT_ATTRIBUTE_LENGTH = 4096


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


class TelemetryTracerProvider(trace.TracerProvider):
    """The process's global TracerProvider once the bridge has adopted that role:
    its tracers start spans on the TracerProvider of whichever :class:`Telemetry`
    is current, and do nothing while there is none.

    The OTel API lets a process set its global provider once, while Telemetry
    objects come and go (a LocalCluster with ``processes=False`` closed and
    started again): this level of indirection makes "set once" hold. Tracers
    that code got before (``trace.get_tracer`` at import) resolve through it too.
    """

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> trace.Tracer:
        return TelemetryTracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )


class TelemetryTracer(trace.ProxyTracer):
    """A ProxyTracer that follows the current Telemetry's TracerProvider"""

    #: the provider ``_real_tracer`` came from
    _provider: Any = None

    @property
    def _tracer(self) -> trace.Tracer:
        telemetry = Telemetry._current
        provider = telemetry.tracer_provider if telemetry is not None else None
        if provider is None:
            return self._noop_tracer
        if provider is not self._provider:
            self._real_tracer = provider.get_tracer(
                self._instrumenting_module_name,
                self._instrumenting_library_version,
                self._schema_url,
                self._attributes,
            )
            self._provider = provider
        return self._real_tracer  # type: ignore[return-value]


def adopt_global_tracer_provider() -> bool:
    """Make the bridge's TracerProvider the process's global one, if the process
    has none; True if the bridge's is the global one (now or since before).

    "None" means ``trace.get_tracer_provider()`` is still the API's proxy: no
    ``trace.set_tracer_provider`` call and no OTEL_PYTHON_TRACER_PROVIDER. An
    application's provider, even a NoOpTracerProvider, is never replaced; and an
    application that sets its own *after* the bridge did is refused by the OTel
    API ("Overriding of current TracerProvider is not allowed"): set it before
    the worker starts (a worker preload, or at import).
    """
    global _ADOPTED
    with Telemetry._lock:
        current = trace.get_tracer_provider()
        if _ADOPTED is not None and current is _ADOPTED:
            return True
        if not isinstance(current, trace.ProxyTracerProvider):
            return False
        provider = TelemetryTracerProvider()
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is provider:  # another thread may have won
            _ADOPTED = provider
            return True
        return False


#: The global TracerProvider this process got from the bridge, if it did
_ADOPTED: Any = None


def _span_limits():
    from opentelemetry.sdk.trace import SpanLimits

    set_by_env = any(
        v in os.environ
        for v in (
            "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
            "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        )
    )
    try:
        return SpanLimits(
            max_span_attribute_length=None if set_by_env else DEFAULT_ATTRIBUTE_LENGTH
        )
    except ValueError as e:  # "OTEL_..._LIMIT must be a non-negative integer but got -5"
        variable = next((v for v in os.environ if v.startswith("OTEL_") and v in str(e)), None)
        if variable is None:
            raise
        raise ConfigError(variable, os.environ[variable], "a non-negative integer") from e


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
        HELD_EXPORTER_LOGS.attach()
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
