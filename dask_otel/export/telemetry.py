"""The per-process :class:`Telemetry`: the SDK providers every Dask server of a
process shares, and the :class:`~dask_otel.export.sink.SpanSink` the bridge hands
its spans to.

One Telemetry exists per process at a time: a LocalCluster with
``processes=False`` runs a scheduler and several workers in one process, and they
share one TracerProvider and one MeterProvider (a Prometheus registry can hold the
bridge's collector only once). It is created by the first Dask server that attaches
and shut down, flushing, when the last one detaches.

The bridge never replaces an application's global OpenTelemetry providers (see
:mod:`dask_otel.export.global_provider` for the one exception).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from dask_otel.config import OtelConfig
from dask_otel.export.accounting import HELD_EXPORTER_LOGS, AccountedSpanExporter
from dask_otel.export.exporters import metric_readers, span_exporters
from dask_otel.export.sink import SpanSink, span_limits

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger("dask_otel")

#: service.name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES sets one
DEFAULT_SERVICE_NAME = "dask"


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


class Telemetry:
    """The SDK providers of this process, shared by every Dask server in it.

    ``span_sink`` and ``tracer_provider`` exist only when traces are exported,
    ``meter_provider`` only when metrics are, ``logs`` only when logs are.
    ``span_exporters`` are kept so that tests and the demo can read an in-memory
    exporter.
    """

    _lock = threading.Lock()
    _current: Telemetry | None = None
    _users: int = 0

    config: OtelConfig
    tracer_provider: TracerProvider | None
    #: Where this process's spans go: the scheduler's mirrored spans, the
    #: workers' task spans (spans made inside tasks go through the tracer provider)
    span_sink: SpanSink | None
    span_exporters: list
    #: The batched span, metric exporters wrapped with export accounting, for
    #: the self-metrics and for shutdown
    accounted_span_exporters: list[AccountedSpanExporter]
    accounted_metric_exporters: list
    meter_provider: Any
    #: :class:`dask_otel.export.logs.LogExport`
    logs: Any

    def __init__(self, config: OtelConfig, resource_attributes: dict[str, Any]):
        from opentelemetry.sdk.metrics import MeterProvider

        self.config = config
        self.resource = build_resource(**resource_attributes)
        self.span_exporters = []
        self.accounted_span_exporters = []
        self.accounted_metric_exporters = []
        self.tracer_provider = None
        self.span_sink = None
        self.meter_provider = None
        self.logs = None
        self._shut_down = False
        self.metric_readers = metric_readers(
            config.metrics_exporters, self.accounted_metric_exporters
        )
        if self.metric_readers:
            self.meter_provider = MeterProvider(
                metric_readers=self.metric_readers,
                resource=self.resource,
                shutdown_on_exit=False,
            )
        if config.traces_exporters:
            self.span_sink = self._build_span_sink()
        if config.logs_exporters:
            from dask_otel.export.logs import LogExport

            self.logs = LogExport(config, self.resource)

    def _build_span_sink(self) -> SpanSink:
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
        limits = span_limits()
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
                accounted = AccountedSpanExporter(exporter)
                self.accounted_span_exporters.append(accounted)
                processor = BatchSpanProcessor(accounted, **self._sdk_metrics)
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
    def accounted_exporters(self) -> list:
        """The batched exporters (OTLP and others): the ones that can wait on a
        collector, with their :class:`~dask_otel.export.accounting.ExportOutage`"""
        logs = self.logs.accounted_exporters if self.logs else []
        return [*self.accounted_span_exporters, *self.accounted_metric_exporters, *logs]

    @property
    def outage(self) -> bool:
        """True while some exporter's collector is not answering (see
        :attr:`~dask_otel.export.accounting.ExportOutage.in_outage`): flushing
        would only wait"""
        return any(e.outage.in_outage for e in self.accounted_exporters)

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
        for exporter in self.accounted_exporters:
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
