"""A worker's share of Dask's own families (``otel.metrics.dask``): the
collector its ``/metrics`` serves from, exported by the adapter
:mod:`dask_otel.export.dask_families`, each series with ``dask.worker.address``
beside Dask's labels.

Dask's SpillBuffer families (what the collector's ``collect_spillbuffer``
yields) are left out: the bridge's spill instruments (:mod:`dask_otel.spill`)
export the same counters, always on. docs/metrics.md#dasks-own-families
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_otel.export.dask_families import DaskFamilies, ServerView

#: The attribute that names the worker (as on the spill metrics)
WORKER_ADDRESS = "dask.worker.address"

if TYPE_CHECKING:
    from distributed import Worker

    from dask_otel.export.telemetry import ServerTelemetry


class WorkerFamilies(DaskFamilies):
    """Exports one worker's Dask families from now until :meth:`close`.

    Prometheus tells the workers' series apart by the ``instance`` label of the
    endpoint it scraped, while over OTLP every worker of a cluster shares one
    resource (its scheduler's): hence ``dask.worker.address``.
    """

    def __init__(self, worker: Worker, own: ServerTelemetry):
        # needs prometheus_client, as Dask's /metrics does
        from distributed.http.worker.prometheus.core import WorkerMetricCollector

        spill = WorkerMetricCollector(ServerView(worker)).collect_spillbuffer()
        super().__init__(
            worker, [WorkerMetricCollector],
            {**own.metric_attributes, WORKER_ADDRESS: worker.address}, own,
            excluded={family.name for family in spill},
        )
