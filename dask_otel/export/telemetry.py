"""The per-process :class:`Telemetry` (the SDK providers every Dask server of a
process shares, built by one recipe: ``OTEL_*`` or ``OTEL_CONFIG_FILE``) and
:class:`ServerTelemetry`, one server's view of it (docs/traces.md, "Two clusters in
one process"). The last server to detach flushes and shuts it down (:mod:`.lifecycle`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from dask_otel.attributes import SCHEDULER_ADDRESS
from dask_otel.config import OtelConfig
from dask_otel.export.accounting import (COUNTS, HELD_EXPORTER_LOGS, AccountedExporter,
                                         ExportHealth, ExportInstruments)
from dask_otel.export.declarative import ConfigFile, config_file
from dask_otel.export.exporters import SIGNALS, EnvRecipe, otel_environment
from dask_otel.export.instruments import EXEMPLAR_VIEWS
from dask_otel.export.sink import DEFAULT_ATTRIBUTE_LENGTH, SpanSink
from dask_otel.log import logger

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

#: service.name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES sets one
DEFAULT_SERVICE_NAME = "dask"
#: The ``OtelConfig`` fields the process's providers are built with: one value per
#: process, the first server's
PROCESS_WIDE = ("traces_exporters", "metrics_exporters", "logs_exporters", "logs_level",
                "flush_timeout")


def recipe(config: OtelConfig | None = None) -> ConfigFile | EnvRecipe:
    """What the providers and the resource are built from: ``OTEL_CONFIG_FILE``'s
    file, else ``otel.*`` and the ``OTEL_*`` variables"""
    return config_file() or EnvRecipe(config)


def service_name() -> tuple[str, str]:
    """The bridge's ``service.name``, and where it comes from: the first rule of
    docs/zero-code.md, "One ``service.name``" that applies"""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    if named := recipe().service_name():
        return named
    # imported only where DaskInstrumentor is (it needs opentelemetry-instrumentation)
    instrumentor = sys.modules.get("dask_otel.instrumentor")
    given = instrumentor.SERVICE_NAME_FROM["tracer_provider"] if instrumentor else None
    for provider, source in (
        (given, "DaskInstrumentor.instrument(tracer_provider=)"),
        (trace.get_tracer_provider(), "the global TracerProvider"),
    ):
        if isinstance(provider, TracerProvider):
            name = provider.resource.attributes.get("service.name")
            if name:
                return str(name), source
    return DEFAULT_SERVICE_NAME, "default"


def build_resource(**attributes: Any):
    """Resource of this process: the recipe's, over :func:`service_name`, with the
    caller's attributes, host and process"""
    from opentelemetry.sdk.resources import Resource

    ours = {"host.name": socket.gethostname(), "process.pid": os.getpid(), **attributes}
    resource = recipe().resource(ours, service_name()[0])
    if "service.instance.id" not in resource.attributes:
        # opentelemetry-sdk 1.45+ sets one per process (the global provider's
        # too); before, this process's own, so every signal still names its process
        resource = resource.merge(Resource({"service.instance.id": _instance_id(os.getpid())}))
    return resource


@lru_cache(maxsize=1)
def _instance_id(pid: int) -> str:
    """A random UUID per process (a forked child gets its own), as the SDK's"""
    return str(uuid.uuid4())


class Telemetry:
    """The SDK providers of this process, shared by its Dask servers, built by one
    recipe (:func:`recipe`); each exists only when its signal is exported."""

    _lock = threading.Lock()
    _current: Telemetry | None = None
    _users: int = 0

    config: OtelConfig
    tracer_provider: TracerProvider | None
    #: Where this process's spans go: the scheduler's mirrored spans, the
    #: workers' task spans (spans made inside tasks go through the tracer provider)
    span_sink: SpanSink | None
    #: signal -> every exporter the recipe built, unwrapped (tests and the demo
    #: read an in-memory one)
    exporters: dict[str, list]
    #: The batched exporters, wrapped with export accounting: the self-metrics
    #: read them, shutdown interrupts them
    accounted: list[AccountedExporter]
    metric_readers: list
    meter_provider: Any
    #: :class:`dask_otel.export.logs.LogExport`
    logs: Any
    #: What the export-health instruments read (None without a MeterProvider)
    health: ExportHealth | None

    #: The first server's resource: the MeterProvider's and the LoggerProvider's
    resource: Any
    #: The scheduler of the first server (None if it named none): servers of
    #: another one share what :data:`PROCESS_WIDE` lists and the metric resource
    scheduler_address: str | None
    #: The ``OTEL_*`` variables when the providers were built
    environment: dict[str, str]
    #: ``OTEL_CONFIG_FILE`` read, which the providers follow instead of the
    #: ``otel.*.exporter`` keys and the ``OTEL_*`` variables; None without one
    config_file: ConfigFile | None

    def __init__(self, config: OtelConfig, resource: Any, scheduler_address: str | None = None):
        from opentelemetry.sdk.metrics import MeterProvider

        self.config = config
        self.resource = resource
        self.scheduler_address = scheduler_address
        self.environment = otel_environment()
        self.config_file = config_file()
        built = recipe(config)
        #: Schedulers whose servers were told they share this Telemetry
        self.warned: set[str] = set()
        self.exporters = {"spans": [], "metrics": [], "logs": []}
        self.accounted = []
        self.tracer_provider = self.span_sink = self.meter_provider = self.logs = self.health = None
        self._shut_down = False
        signals = built.signals
        self.metric_readers = built.metric_readers(self.account) if "metrics" in signals else []
        if self.metric_readers:
            options = built.meter_options()
            self.meter_provider = MeterProvider(
                metric_readers=self.metric_readers,
                resource=self.resource,
                shutdown_on_exit=False,
                # the file's views after the bridge's
                views=[*EXEMPLAR_VIEWS, *options.pop("views")],
                **options,
            )
            self.health = ExportHealth({}, telemetry=self)
            ExportInstruments.of(self.meter_provider).attach(self.health)
            for accounted in self.accounted:  # a metric exporter's own SDK metrics (OTLP's)
                getattr(accounted.exporter, "set_meter_provider", lambda _: None)(self.meter_provider)
        if "spans" in signals:
            self.tracer_provider, limits = built.tracer_provider(self.resource,
                                                                 DEFAULT_ATTRIBUTE_LENGTH)
            processors = built.processors("spans", self.account, self.meter_provider)
            for processor in processors:
                self.tracer_provider.add_span_processor(processor)
            self.span_sink = SpanSink(self.tracer_provider, processors, limits)
        if "logs" in signals:
            from dask_otel.export.logs import LogExport

            self.logs = LogExport(config, built, self.resource, self.account)

    def account(self, signal: str, exporter: Any, interval: float | None) -> Any:
        """The one place every exporter a recipe builds passes: kept, and when
        batched (``interval``: seconds between the SDK's scheduled exports, as the
        recipe configured them) wrapped in export accounting and the outage policy"""
        self.exporters[signal].append(exporter)
        if interval is None:
            return exporter
        accounted = AccountedExporter(signal, exporter, interval, self.config.retry_during_outage)
        self.accounted.append(accounted)
        HELD_EXPORTER_LOGS.attach()
        return accounted

    def accounted_of(self, signal: str) -> list[AccountedExporter]:
        return [e for e in self.accounted if e.health.signal == signal]

    def export_status(self) -> dict[str, dict[str, int] | None]:
        """``status()``'s ``export``: per signal, the :data:`COUNTS` of its batched
        exporters, summed (docs/deploy.md, "Volume"); None: none exports it"""
        out: dict[str, dict[str, int] | None] = dict.fromkeys(SIGNALS)
        for exporter in self.accounted:
            row = out[exporter.health.signal] = out[exporter.health.signal] or dict.fromkeys(COUNTS, 0)
            for key in COUNTS:
                row[key] += getattr(exporter.health, key)
        return out

    span_exporters = property(lambda self: self.exporters["spans"])  # tests and the demo

    @classmethod
    def acquire(cls, config: OtelConfig, **resource_attributes: Any) -> ServerTelemetry:
        """Attach one server to the process's Telemetry, created on first use"""
        resource = build_resource(**resource_attributes)
        address = resource_attributes.get(SCHEDULER_ADDRESS)
        with cls._lock:
            if cls._current is None:
                cls._current = Telemetry(config, resource, address)
            cls._users += 1
            telemetry = cls._current
        return ServerTelemetry.of(telemetry, config, resource, address)

    @classmethod
    def detach(cls, telemetry: Telemetry) -> bool:
        """Detach one user; True if it was the last (which flushes and shuts down)"""
        with cls._lock:
            if cls._current is not telemetry:
                return False
            cls._users -= 1
            if cls._users == 0:
                cls._current = None
            return cls._users == 0

    def warn_shared(self, address: str, config: OtelConfig) -> None:
        """One WARNING per scheduler whose servers share this Telemetry with the
        first scheduler's, naming the settings of its own that cannot hold"""
        with Telemetry._lock:
            if address in self.warned:
                return
            self.warned.add(address)
        keys = {f.name: f.metadata["key"] for f in fields(OtelConfig)}
        ignored = [keys[name] for name in PROCESS_WIDE
                   if getattr(config, name) != getattr(self.config, name)]
        now, then = otel_environment(), self.environment
        ignored += sorted(k for k in {*now, *then} if now.get(k) != then.get(k))
        first = self.scheduler_address
        logger.warning(
            "dask_otel: scheduler %s shares this process's OpenTelemetry providers with "
            "scheduler %s: its spans carry its own resource and span settings, but its "
            "exporters, otel.flush-timeout and OTEL_* variables are %s's%s, and its "
            "metrics carry %s's resource, with %s=%s as an attribute",
            address, first, first,
            f" (its own {', '.join(ignored)} ignored)" if ignored else "",
            first, SCHEDULER_ADDRESS, address,
        )

    @property
    def outage(self) -> bool:
        """True while some exporter waits on a collector that is not answering
        (``ExporterHealth.stalled``): flushing would only wait"""
        return any(e.health.stalled for e in self.accounted)

    def force_flush(self) -> None:
        """Export what is queued (a failing exporter's is dropped and counted, not
        probed); blocks while a collector hangs: :meth:`shutdown` ends it"""
        for exporter in self.accounted:
            exporter.health.closing = True
        timeout_ms = int(self.config.flush_timeout * 1000)
        # A provider whose every exporter is failing has nothing to flush to (and a
        # metric collection would cost CPU for nothing)
        for signal, provider in (("spans", self.tracer_provider),
                                 ("metrics", self.meter_provider),
                                 ("logs", self.logs and self.logs.provider)):
            accounted = self.accounted_of(signal)
            if provider and not (accounted and all(e.health.failing for e in accounted)):
                provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Stop the SDK's threads now, whatever the collector does, once: the
        exporters first (that ends a retry backoff and cancels a gRPC call waiting
        on a hung collector), so that the threads joined next end at once"""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        for exporter in self.accounted:
            try:
                exporter.shutdown()
            except Exception:
                logger.debug("dask_otel: exporter shutdown failed", exc_info=True)
        if self.tracer_provider:
            self.tracer_provider.shutdown()
        if self.meter_provider:
            self.meter_provider.shutdown(timeout_millis=self.config.flush_timeout * 1000)
        if self.logs:
            self.logs.shutdown()


@dataclass
class ServerTelemetry:
    """One Dask server's share of its process's :class:`Telemetry`
    (docs/traces.md, "Two clusters in one process")"""

    telemetry: Telemetry
    #: This server's ``otel.*`` values
    config: OtelConfig
    #: The process's span processors, with this server's resource; None when
    #: traces are not exported
    span_sink: SpanSink | None
    #: Added to this server's metric observations: ``{}``, or its scheduler's
    #: address when the MeterProvider's resource names another
    metric_attributes: dict[str, Any] = field(default_factory=dict)
    #: The scheduler whose process-wide settings and metric resource this
    #: server uses, when not its own
    shared_with: str | None = None

    @classmethod
    def of(cls, telemetry: Telemetry, config: OtelConfig, resource: Any,
           address: str | None) -> ServerTelemetry:
        sink = telemetry.span_sink
        if sink is not None and resource != sink.resource:
            # a second cluster in the process: the same processors and limits, nothing copied
            sink = SpanSink(sink.provider, sink.processors, sink.limits, resource)
        first = telemetry.scheduler_address
        if address is None or first is None or address == first:
            return cls(telemetry, config, sink)
        telemetry.warn_shared(address, config)
        return cls(telemetry, config, sink, {SCHEDULER_ADDRESS: address}, first)

