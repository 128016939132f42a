"""Reading the bridge's InMemoryMetricReader: its points by metric name, summed
over attributes or per worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


@dataclass
class Point:
    attributes: dict[str, Any]
    value: float
    start_time_unix_nano: int


def metric_reader(cluster: Any) -> InMemoryMetricReader:
    """The in-memory reader of the process Telemetry a LocalCluster's scheduler uses"""
    telemetry = cluster.scheduler.plugins["dask-otel"].telemetry
    (reader,) = [
        r for r in telemetry.metric_readers if isinstance(r, InMemoryMetricReader)
    ]
    return reader


def collect(reader: InMemoryMetricReader) -> dict[str, list[Point]]:
    """One collection: ``{metric name: [Point]}``"""
    out: dict[str, list[Point]] = {}
    data = reader.get_metrics_data()
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            if sm.scope.name != "dask_otel":
                continue  # the SDK's own metrics (opentelemetry-sdk 1.41 reports them unasked)
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(
                    Point(
                        dict(p.attributes),
                        p.value if hasattr(p, "value") else p.sum,  # a histogram: its sum
                        getattr(p, "start_time_unix_nano", 0),
                    )
                    for p in metric.data.data_points
                )
    return out


def value(points: dict[str, list[Point]], name: str, **attributes: Any) -> float:
    """Sum of the points of ``name`` whose attributes include ``attributes``
    (keyword ``dask_worker_address`` means attribute ``dask.worker.address``)"""
    wanted = {k.replace("_", "."): v for k, v in attributes.items()}
    return sum(
        p.value
        for p in points.get(name, [])
        if all(p.attributes.get(k) == v for k, v in wanted.items())
    )


def by_worker(points: dict[str, list[Point]], name: str) -> dict[str, float]:
    """``{worker address: value}`` of a worker metric, summed over other attributes"""
    out: dict[str, float] = {}
    for p in points.get(name, []):
        address = p.attributes["dask.worker.address"]
        out[address] = out.get(address, 0) + p.value
    return out
