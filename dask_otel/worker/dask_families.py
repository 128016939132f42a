"""A worker's share of Dask's own families (``otel.metrics.dask``): the collector
its ``/metrics`` serves from, through :mod:`dask_otel.export.dask_families`, but
for the SpillBuffer's families (:mod:`dask_otel.spill` exports the same counters).
docs/metrics.md#dasks-own-families
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from distributed.http.worker.prometheus.core import WorkerMetricCollector

from dask_otel.attributes import WORKER_ADDRESS
from dask_otel.export.dask_families import DaskFamilies

if TYPE_CHECKING:
    from distributed import Worker
    from prometheus_client import Metric

    from dask_otel.export.telemetry import ServerTelemetry


class WorkerCollector(WorkerMetricCollector):
    """Dask's worker collector, but for the SpillBuffer's families"""

    def collect_spillbuffer(self) -> Iterator[Metric]:
        return iter(())


class WorkerFamilies(DaskFamilies):
    """Exports one worker's Dask families until :meth:`close`"""

    def __init__(self, worker: Worker, own: ServerTelemetry):
        # over OTLP every worker shares its scheduler's resource, where Prometheus
        # tells the endpoints apart by ``instance``
        attributes = {**own.metric_attributes, WORKER_ADDRESS: worker.address}
        super().__init__(worker, [WorkerCollector], attributes, own)
