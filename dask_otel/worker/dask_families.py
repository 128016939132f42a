"""A worker's share of Dask's own families (``otel.metrics.dask``): the
collector its ``/metrics`` serves from, exported by the adapter
:mod:`dask_otel.export.dask_families`, each series with ``dask.worker.address``
beside Dask's labels.

Dask's SpillBuffer families (what the collector's ``collect_spillbuffer``
yields) are left out, not even built: the bridge's spill instruments
(:mod:`dask_otel.spill`) export the same counters, always on.
Imported only where prometheus_client is installed, as Dask's ``/metrics``
handler is. docs/metrics.md#dasks-own-families
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
    """Exports one worker's Dask families from now until :meth:`close`.

    Prometheus tells the workers' series apart by the ``instance`` label of the
    endpoint it scraped, while over OTLP every worker of a cluster shares one
    resource (its scheduler's): hence ``dask.worker.address``.
    """

    def __init__(self, worker: Worker, own: ServerTelemetry):
        attributes = {**own.metric_attributes, WORKER_ADDRESS: worker.address}
        super().__init__(worker, [WorkerCollector], attributes, own)
