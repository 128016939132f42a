"""The ``OTEL_*`` recipe (:class:`EnvRecipe`): the providers' processors and readers
from ``otel.*.exporter`` names, each exporter built from its entry point and reading
its own ``OTEL_*`` variables; the only choices made here are which exporter, and gRPC
or HTTP for ``otlp``. A header variable's value (a credential) never reaches a log
line or an error. docs/traces.md, docs/metrics.md, docs/logs.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from dask_otel.config import ConfigError, OtelConfig, installed_entry_points, otlp_entry_point
from dask_otel.log import logger


def otel_environment() -> dict[str, str]:
    """The ``OTEL_*`` variables, which the providers' exporters read once"""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


#: What is shown instead of the value of a variable that may hold credentials
SECRET_NOT_SHOWN = "(value not shown: it may hold credentials)"


def _secret_variables() -> list[str]:
    return sorted(k for k in otel_environment() if "HEADERS" in k)


def _redacted(text: str) -> str:
    """``text`` with every header variable's value, and each of its parts, cut out"""
    for variable in _secret_variables():
        value = os.environ[variable]
        for part in sorted({value, *value.split(","), *value.split("=")}, key=len, reverse=True):
            if part.strip():
                text = text.replace(part.strip(), "***")
    return text


class _HeaderWarningNamed(logging.Filter):
    """Replaces the SDK's "Header format invalid! ...: <the header>" warning, which
    quotes a credential, with one that names the variables instead: once per process
    and values, however many exporters read them and parts are malformed"""

    #: the header variables' values warned about
    warned: frozenset = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        if "Header format invalid" not in str(record.msg):
            return True
        values = frozenset((k, os.environ[k]) for k in _secret_variables())
        if self.warned == values:
            return False
        self.warned = values
        named = " or ".join(_secret_variables()) or "an OTEL_EXPORTER_OTLP_*HEADERS variable"
        logger.warning("dask_otel: %s is malformed (expected comma-separated name=value pairs, "
                       "URL-encoded); the OpenTelemetry SDK ignores the malformed part. %s",
                       named, SECRET_NOT_SHOWN)
        return False


logging.getLogger("opentelemetry.util.re").addFilter(_HeaderWarningNamed())


#: Each signal's exporters: entry point group, ``OTEL_EXPORTER_OTLP_<signal>_*``,
#: and the SDK's variable of the time between its scheduled exports, with its
#: default in milliseconds
SIGNALS = {
    "spans": ("opentelemetry_traces_exporter", "TRACES", "OTEL_BSP_SCHEDULE_DELAY", 5000),
    "metrics": ("opentelemetry_metrics_exporter", "METRICS", "OTEL_METRIC_EXPORT_INTERVAL", 60000),
    "logs": ("opentelemetry_logs_exporter", "LOGS", "OTEL_BLRP_SCHEDULE_DELAY", 1000),
}

#: ``account(signal, exporter, interval)``: :meth:`Telemetry.account`, the one place
#: every exporter a recipe builds passes
Account = Callable[[str, Any, "float | None"], Any]


def export_interval(signal: str) -> float:
    """Seconds between the SDK's scheduled exports of ``signal``, as it reads them"""
    *_, variable, default = SIGNALS[signal]
    try:
        milliseconds = float(os.environ.get(variable, "").strip() or default)
    except ValueError:  # the SDK warns about it and uses its default
        milliseconds = default
    return max(milliseconds, 0.0) / 1000


def _exporter(signal: str, name: str, **kwargs: Any) -> Any:
    """The exporter ``name`` (``console``, ``otlp``, an entry point) of ``signal``; an
    error names the variable holding the bad value (the SDK's do not always), but
    never a header variable's value"""
    if name == "console":
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return {"spans": ConsoleSpanExporter, "metrics": ConsoleMetricExporter,
                "logs": ConsoleLogRecordExporter}[signal]()
    group, otlp, *_ = SIGNALS[signal]
    ep = installed_entry_points(group)[otlp_entry_point(otlp) if name == "otlp" else name]
    try:
        cls = ep.load()
        try:
            return cls(**kwargs)
        except TypeError:
            if not kwargs:
                raise
            return cls()  # an exporter without SDK metrics (older, third-party)
    except Exception as e:
        text = _redacted(f"{type(e).__name__}: {e}")
        culprits = [k for k, v in otel_environment().items() if v.strip() and v.strip() in str(e)]
        value = os.environ[culprits[0]] if culprits else text
        if culprits and culprits[0] in _secret_variables():
            value = SECRET_NOT_SHOWN
        raise ConfigError(", ".join(culprits) or f"the {ep.name} exporter's OTEL_* settings",
                          value, f"a value the OpenTelemetry SDK accepts ({text})") from e


def prometheus_reader() -> Any:
    """The Prometheus pull reader: it registers with prometheus_client's default
    registry, which Dask's own ``/metrics`` endpoint serves on every server"""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
    except ImportError:
        raise ConfigError("otel.metrics.exporter", "prometheus",
                          "opentelemetry-exporter-prometheus to be installed "
                          "(pip install 'dask-otel[prometheus]')") from None
    return PrometheusMetricReader()


def sdk_processors(signal: str) -> tuple[type, type, type]:
    """The SDK's batch and simple processors of spans or logs, and its in-memory exporter"""
    if signal == "spans":
        from opentelemetry.sdk.trace import export
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        return export.BatchSpanProcessor, export.SimpleSpanProcessor, InMemorySpanExporter
    from opentelemetry.sdk._logs import export as logs

    return (logs.BatchLogRecordProcessor, logs.SimpleLogRecordProcessor,
            logs.InMemoryLogRecordExporter)


@lru_cache(maxsize=1)
def detected_resource(pid: int, otel_variables: tuple) -> Any:
    """``Resource.create({})`` (a few ms and a thread pool per call), once per process
    and ``OTEL_*`` variables, its arguments: what it detects does not change while they do not"""
    from opentelemetry.sdk.resources import Resource

    return Resource.create({})


@dataclass(slots=True)
class EnvRecipe:
    """The providers' parts from ``otel.*.exporter`` and ``OTEL_*``, answering what
    ``ConfigFile`` answers from a file; ``memory`` exporters are not batched."""

    config: OtelConfig | None = None

    def service_name(self) -> tuple[str, str] | None:
        """``OTEL_SERVICE_NAME``, else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``,
        and which of them says it"""
        from opentelemetry.sdk.resources import OTELResourceDetector

        name = OTELResourceDetector().detect().attributes.get("service.name")
        if not name:
            return None
        return str(name), ("OTEL_SERVICE_NAME" if os.environ.get("OTEL_SERVICE_NAME")
                           else "OTEL_RESOURCE_ATTRIBUTES")

    def resource(self, ours: dict[str, Any], service_name: str) -> Any:
        """The SDK's detected resource, ``ours`` and ``service_name`` on it (so the
        SDK's unknown_service never shows), ``OTEL_*``'s on top"""
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource

        detected = detected_resource(os.getpid(), tuple(sorted(otel_environment().items())))
        return detected.merge(Resource({"service.name": service_name, **ours})).merge(
            OTELResourceDetector().detect())

    @property
    def signals(self) -> set[str]:
        names = {"spans": self.config.traces_exporters, "metrics": self.config.metrics_exporters,
                 "logs": self.config.logs_exporters}
        return {signal for signal, exporters in names.items() if exporters}

    def tracer_provider(self, resource: Any, default_length: int) -> tuple[Any, Any]:
        """A TracerProvider (it reads ``OTEL_TRACES_SAMPLER``) and its SpanLimits"""
        from opentelemetry.sdk.trace import TracerProvider

        from dask_otel.export.sink import span_limits

        limits = span_limits()
        return TracerProvider(resource=resource, span_limits=limits, shutdown_on_exit=False), limits

    def metric_readers(self, account: Account) -> list:
        from opentelemetry.sdk.metrics import export

        readers = {"memory": export.InMemoryMetricReader, "prometheus": prometheus_reader}
        return [
            readers[name]() if name in readers else export.PeriodicExportingMetricReader(
                account("metrics", _exporter("metrics", name), export_interval("metrics")))
            for name in self.config.metrics_exporters
        ]

    def meter_options(self) -> dict[str, Any]:
        return {"views": []}

    def logger_provider(self, resource: Any) -> Any:
        from opentelemetry.sdk._logs import LoggerProvider

        return LoggerProvider(resource=resource, shutdown_on_exit=False)

    def processors(self, signal: str, account: Account, meter_provider: Any = None) -> list:
        """The span or log processors; OTLP exporters and processors report their SDK
        metrics to ``meter_provider``"""
        batch, simple, memory = sdk_processors(signal)
        sdk_metrics = {"meter_provider": meter_provider} if meter_provider else {}
        out = []
        config = self.config
        for name in config.traces_exporters if signal == "spans" else config.logs_exporters:
            if name == "memory":
                out.append(simple(account(signal, memory(), None)))
            else:
                kwargs = sdk_metrics if sdk_metrics and name != "console" else {}
                exporter = account(signal, _exporter(signal, name, **kwargs), export_interval(signal))
                out.append(batch(exporter, **(sdk_metrics or {})))
        return out
