"""Exporters and metric readers, built by name from their entry points.

Each reads its own ``OTEL_*`` variables (endpoint, headers, certificate, timeout,
compression); the only choice made here is which exporter, and gRPC or HTTP for
``otlp``. Batched exporters are wrapped with :mod:`dask_otel.outage` accounting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from dask_otel.config import ConfigError, otlp_entry_point
from dask_otel.outage import HELD_EXPORTER_LOGS, gated_metric_exporter


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


def metric_readers(names: Sequence[str], gated: list | None = None) -> list:
    """MetricReaders for ``otel.metrics.exporter`` names; each reads its own OTEL_*.

    The pushing exporters are wrapped with export accounting and appended to
    ``gated``, for the self-metrics.

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
            exporter = gated_metric_exporter(
                _build_exporter("opentelemetry_metrics_exporter", name)
            )
            if gated is not None:
                gated.append(exporter)
            out.append(PeriodicExportingMetricReader(exporter))
            HELD_EXPORTER_LOGS.attach()
    return out
