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

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from opentelemetry.attributes import BoundedAttributes

from dask_otel.config import ConfigError, OtelConfig
from dask_otel.exporters import metric_readers, span_exporters
from dask_otel.outage import HELD_EXPORTER_LOGS, GatedSpanExporter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger("dask_otel")

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


#: The attributes of an event or link that has none. Events and links always get
#: a ``BoundedAttributes``, as the SDK's own spans give them: an exporter may read
#: ``.attributes.dropped`` off each (the OTLP encoder did, up to at least
#: opentelemetry-sdk 1.25).
NO_ATTRIBUTES = BoundedAttributes(immutable=True)

#: Attribute value types that need no cleaning: OTel's primitive types, exactly
#: (a subclass of str or int might be anything)
_PRIMITIVES = frozenset((str, bool, int, float))


def within_limits(values: Any, max_len: int | None) -> bool:
    """Whether attribute values are of OTel attribute types, exactly (primitives,
    tuples of one primitive type), with no string longer than ``max_len``"""
    for value in values:
        kind = type(value)
        if kind is tuple and value:
            kind = type(value[0])
            if kind not in _PRIMITIVES or any(type(v) is not kind for v in value):
                return False
            if kind is str and max_len is not None and max(map(len, value)) > max_len:
                return False
        elif kind is str:
            if max_len is not None and len(value) > max_len:
                return False
        elif kind not in _PRIMITIVES and kind is not tuple:
            return False
    return True


class SpanSink:
    """Where the mirror hands the spans it builds: already finished, so they go
    straight to the SDK's span processors as ``ReadableSpan``s, with what a Tracer
    would add (resource, instrumentation scope; the mirror asks :attr:`sampler`
    and applies :attr:`limits` with the SDK's ``BoundedAttributes``, as the SDK's
    spans do) and without what only live spans need (locks, contexts, ids from an
    IdGenerator: the mirror's ids come from Dask).
    """

    def __init__(self, provider: TracerProvider, processors: list, limits: Any):
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from dask_otel import __version__

        self.provider = provider
        self.processors = processors
        self.resource = provider.resource
        self.scope = InstrumentationScope("dask_otel", __version__)
        #: The SDK's SpanLimits: attribute count (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT)
        #: and value length (OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, or ours)
        self.limits = limits

    @property
    def sampler(self):
        """The provider's sampler (OTEL_TRACES_SAMPLER); ask it through
        :func:`dask_otel.sampling.trace_sampled`, one decision per trace"""
        return self.provider.sampler

    def bounded(self, attributes: dict[str, Any], count: int | None = None) -> Any:
        """``attributes`` within the SDK's limits, as its own spans apply them: at
        most ``count`` (default: the span attribute count limit) attributes, each
        value cut to the attribute value length limit.

        ``attributes`` is a new dict the caller hands over. When every value is
        already of an OTel attribute type and within the limits (the mirror's
        usually are) it is returned as it is: ``BoundedAttributes`` would copy
        and re-check each value, which costs more than building the span (~2 us
        per attribute). Otherwise ``BoundedAttributes`` applies the limits, and
        counts what it drops, exactly as for the SDK's own spans.
        """
        limit = self.limits.max_span_attributes if count is None else count
        max_len = self.limits.max_span_attribute_length
        if (limit is None or len(attributes) <= limit) and within_limits(
            attributes.values(), max_len
        ):
            return attributes
        return BoundedAttributes(limit, attributes, immutable=True, max_value_len=max_len)

    def event_attributes(self, attributes: dict[str, Any], count: int | None) -> BoundedAttributes:
        """The attributes of an event or a link, within the SDK's limits (``count``:
        the event or link attribute count limit), always as ``BoundedAttributes``
        (see :data:`NO_ATTRIBUTES`). Events and links are few: no fast path."""
        max_len = self.limits.max_span_attribute_length
        return BoundedAttributes(count, attributes, immutable=True, max_value_len=max_len)

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
        if variable is None:  # a message that names none (opentelemetry-sdk 1.25's)
            variable = next((
                v for v, value in os.environ.items()
                if v.startswith("OTEL_") and v.endswith("_LIMIT") and not value.strip().isdigit()
            ), None)
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
        #: one per pushing metric exporter, wrapped with outage accounting: for the
        #: self-metrics and for shutdown
        self.metric_export_stats: list = []
        self.metric_readers = metric_readers(
            config.metrics_exporters, self.metric_export_stats
        )
        self._shut_down = False
        #: :class:`dask_otel.logs.LogExport`, only when logs are exported
        self.logs: Any = None
        self.meter_provider = None
        if self.metric_readers:
            self.meter_provider = MeterProvider(
                metric_readers=self.metric_readers,
                resource=self.resource,
                shutdown_on_exit=False,
            )
        if config.logs_exporters:
            from dask_otel.logs import LogExport

            self.logs = LogExport(config, self.resource)

    @property
    def spans(self) -> SpanSink | None:
        """Where this process's spans go (the scheduler's mirrored spans, the
        workers' task spans and, through the global provider, spans made inside
        tasks), built on first use; None when ``otel.traces.exporter`` is none."""
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
        duration), opt-in with OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true (always
        on in opentelemetry-sdk 1.41), go to this MeterProvider rather than the
        application's global one."""
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
    def detach(cls, telemetry: Telemetry) -> bool:
        """Detach one user; True if it was the last, which must then
        :meth:`force_flush` and :meth:`shutdown`"""
        with cls._lock:
            if cls._current is not telemetry:
                return False
            cls._users -= 1
            if cls._users > 0:
                return False
            cls._current = None
            return True

    @property
    def exporters(self) -> list:
        """The batched exporters (OTLP and others): the ones that can wait on a
        collector, with their :class:`~dask_otel.outage.ExportOutage`"""
        logs = self.logs.export_stats if self.logs else []
        return [*self.export_stats, *self.metric_export_stats, *logs]

    @property
    def outage(self) -> bool:
        """True while some exporter's collector is not answering (see
        :attr:`~dask_otel.outage.ExportOutage.in_outage`): flushing would only wait"""
        return any(e.outage.in_outage for e in self.exporters)

    def force_flush(self) -> None:
        """Export what is queued. Blocks while a collector hangs (the SDK's batch
        processor ignores a flush timeout): :meth:`shutdown` from another thread
        ends it."""
        timeout_ms = int(self.config.flush_timeout * 1000)
        if self.tracer_provider:
            self.tracer_provider.force_flush(timeout_ms)
        if self.meter_provider:
            self.meter_provider.force_flush(timeout_ms)
        if self.logs:
            self.logs.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Stop the SDK's threads now, whatever the collector does.

        The exporters are shut down first: that interrupts a retry back-off and
        cancels a gRPC call waiting on a hung collector, so that what is still
        queued fails at once (dropped and counted) and the span processors',
        metric readers' and log processors' threads, joined next, end. Runs once.
        """
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception:
                logger.debug("dask_otel: exporter shutdown failed", exc_info=True)
        timeout_ms = self.config.flush_timeout * 1000
        if self.tracer_provider:
            self.tracer_provider.shutdown()
        if self.meter_provider:
            self.meter_provider.shutdown(timeout_millis=timeout_ms)
        if self.logs:
            self.logs.shutdown()
