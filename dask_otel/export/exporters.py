"""Exporters and metric readers, built by name from their entry points.

Each reads its own ``OTEL_*`` variables (endpoint, headers, certificate, timeout,
compression); the only choices made here are which exporter, and gRPC or HTTP for
``otlp``. Invariant: a header variable's value (a credential) never reaches a log
line or an error. Batched exporters are wrapped with
:mod:`dask_otel.export.accounting`, which may build one again after a failed
export (docs/deploy.md, "When telemetry fails").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dask_otel.config import ConfigError, installed_entry_points, otlp_entry_point
from dask_otel.export.accounting import BUILDS, HELD_EXPORTER_LOGS, accounted_metric_exporter

logger = logging.getLogger("dask_otel")


def _build_exporter(group: str, name: str, **kwargs: Any) -> Any:
    """An exporter from its entry point; it reads its own OTEL_* variables.

    The SDK's errors for a malformed variable do not always name it ("could not
    convert string to float: 'forever'"): name the variable holding that value.
    Header variables hold credentials: their values are never shown, and the
    SDK's own warning about a malformed one (which quotes it) is replaced by one
    that names the variable.
    """
    ep = installed_entry_points(group)[name]
    try:
        cls = ep.load()
        with _header_warnings_named():
            try:
                exporter = cls(**kwargs)
            except TypeError:
                if not kwargs:
                    raise
                kwargs = {}
                exporter = cls()  # an exporter without SDK metrics (older, third-party)
    except Exception as e:
        text = _redacted(f"{type(e).__name__}: {e}")
        culprits = [
            k for k, v in os.environ.items()
            if k.startswith("OTEL_") and v.strip() and v.strip() in str(e)
        ]
        value = os.environ[culprits[0]] if culprits else text
        if culprits and _is_secret(culprits[0]):
            value = SECRET_NOT_SHOWN
        raise ConfigError(
            ", ".join(culprits) or f"the {name} exporter's OTEL_* settings",
            value,
            f"a value the OpenTelemetry SDK accepts ({text})",
        ) from e

    def build() -> Any:
        # The same variables again: their complaints were logged once, above
        with _header_warnings_named(again=True):
            return cls(**kwargs)

    BUILDS[exporter] = build
    return exporter


#: What is shown instead of the value of a variable that may hold credentials
SECRET_NOT_SHOWN = "(value not shown: it may hold credentials)"


def _is_secret(variable: str) -> bool:
    return "HEADERS" in variable


def _secret_variables() -> list[str]:
    return sorted(k for k in os.environ if k.startswith("OTEL_") and _is_secret(k))


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
    quotes a credential, with one that names the variables instead (once per
    exporter built, however many parts are malformed)"""

    warned = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Header format invalid" not in str(record.msg):
            return True
        if self.warned:
            return False
        self.warned = True
        logger.warning(
            "dask_otel: %s is malformed (expected comma-separated name=value pairs, "
            "URL-encoded); the OpenTelemetry SDK ignores the malformed part. %s",
            " or ".join(_secret_variables()) or "an OTEL_EXPORTER_OTLP_*HEADERS variable",
            SECRET_NOT_SHOWN,
        )
        return False


_HEADER_WARNING = _HeaderWarningNamed()


@contextmanager
def _header_warnings_named(again: bool = False) -> Iterator[None]:
    sdk_logger = logging.getLogger("opentelemetry.util.re")
    _HEADER_WARNING.warned = again
    sdk_logger.addFilter(_HEADER_WARNING)
    try:
        yield
    finally:
        sdk_logger.removeFilter(_HEADER_WARNING)


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
                name = otlp_entry_point("TRACES")
            kwargs = {"meter_provider": meter_provider} if meter_provider else {}
            out.append(_build_exporter("opentelemetry_traces_exporter", name, **kwargs))
    return out


def metric_readers(
    names: Sequence[str], accounted: list | None = None, retry_during_outage: bool = False
) -> list:
    """MetricReaders for ``otel.metrics.exporter`` names; each reads its own OTEL_*.
    The pushing exporters are wrapped with export accounting and the outage policy
    (``otel.export.retry-during-outage``) and appended to ``accounted``, for the
    self-metrics and for shutdown.

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
                name = otlp_entry_point("METRICS")
            exporter = accounted_metric_exporter(
                _build_exporter("opentelemetry_metrics_exporter", name),
                retry_during_outage,
            )
            if accounted is not None:
                accounted.append(exporter)
            out.append(PeriodicExportingMetricReader(exporter))
            HELD_EXPORTER_LOGS.attach()
    return out


def log_exporters(names: Sequence[str]) -> list:
    """LogRecordExporters for ``otel.logs.exporter`` names; each reads its own OTEL_*"""
    from opentelemetry.sdk._logs.export import (
        ConsoleLogRecordExporter,
        InMemoryLogRecordExporter,
    )

    out = []
    for name in names:
        if name == "memory":
            out.append(InMemoryLogRecordExporter())
        elif name == "console":
            out.append(ConsoleLogRecordExporter())
        else:
            if name == "otlp":
                name = otlp_entry_point("LOGS")
            out.append(_build_exporter("opentelemetry_logs_exporter", name))
            HELD_EXPORTER_LOGS.attach()
    return out
