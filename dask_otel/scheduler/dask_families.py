"""The scheduler's share of Dask's own families (``otel.metrics.dask``): Dask's
``COLLECTORS`` through the adapter :mod:`dask_otel.export.dask_families`. Imported
only where prometheus_client is installed. docs/metrics.md#dasks-own-families
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distributed.http.scheduler.prometheus.core import COLLECTORS

from dask_otel.export.dask_families import DaskFamilies

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.export.telemetry import ServerTelemetry


class SchedulerFamilies(DaskFamilies):
    """Exports one scheduler's Dask families from now until :meth:`close`"""

    def __init__(self, scheduler: Scheduler, own: ServerTelemetry):
        # Dask's label sets exactly, beside the resource names the scheduler
        super().__init__(scheduler, COLLECTORS, dict(own.metric_attributes), own)
