"""Dask's own worker metric families (``dask_worker_*``) as OpenTelemetry
instruments: opt-in ``otel.metrics.dask``, started by the
:class:`~dask_otel.worker.bridge.WorkerBridge`.

The counterpart of :mod:`dask_otel.scheduler.dask_families` for the families
Dask serves on a worker's ``/metrics`` (``distributed/http/worker/prometheus/
core.py``), with the same naming rule. The readers read what Dask's collector
reads, without calling it (it pops the tick-duration maximum). The digest
medians (``tick_duration_median`` ...) exist only where crick is installed, as
in Dask.
"""

from __future__ import annotations

from time import time
from typing import TYPE_CHECKING, Any

from dask_otel.export.instruments import (
    COUNTER,
    GAUGE,
    Attached,
    MetricSpec,
    ProcessInstruments,
    Reading,
    copy_mapping,
    dask_at_least,
    gc_collection,
    gil_contention,
)

#: The attribute that names the worker (as on the spill metrics)
WORKER_ADDRESS = "dask.worker.address"

if TYPE_CHECKING:
    from distributed import Worker

    from dask_otel.export.telemetry import ServerTelemetry


def _one(read):
    """A family of one unlabelled series; none where this distributed lacks what
    it reads (the family is newer than the installed distributed)"""
    def reading(observed: WorkerFamilies) -> Reading:
        try:
            return [(float(read(observed.worker)), {})]
        except AttributeError:
            return []
    return reading


def _served_until(version: str, reading):
    """``reading`` before distributed ``version``, none from then on: a family
    Dask stopped serving in ``version``"""
    return (lambda observed: []) if dask_at_least(version) else reading


def _tasks(observed: WorkerFamilies) -> Reading:
    worker = observed.worker
    slow = getattr(worker.data, "slow", None)
    out = []
    for state, n in copy_mapping(worker.state.task_counter.current_count(by_prefix=False)).items():
        if state == "memory" and slow is not None:
            spilled = len(slow)
            if n - spilled > 0:
                out.append((n - spilled, {"state": "memory"}))
            if spilled > 0:
                out.append((spilled, {"state": "disk"}))
        else:
            out.append((n, {"state": state}))
    return out


def _gil(observed: Any) -> Reading:
    return gil_contention(observed.worker.monitor)


def _memory(observed: WorkerFamilies) -> Reading:
    worker = observed.worker
    try:
        spilled_memory, spilled_disk = worker.data.spilled_total  # type: ignore[union-attr]
    except AttributeError:  # spilling is disabled
        spilled_memory, spilled_disk = 0, 0
    process = worker.monitor.get_process_memory()
    managed = min(process, worker.state.nbytes - spilled_memory)
    return [
        (managed, {"type": "managed"}),
        (process - managed, {"type": "unmanaged"}),
        (spilled_disk, {"type": "spilled"}),
    ]


def _tick_maximum(observed: WorkerFamilies) -> Reading:
    # Read, not popped: Dask's own scrape pops it
    worker = observed.worker
    return [(max(worker.digests_max.get("tick_duration", 0), time() - worker._last_tick), {})]


def _median(digest: str):
    def reading(observed: WorkerFamilies) -> Reading:
        digests = observed.worker.digests
        if not digests or digest not in digests:  # no crick: Dask has none either
            return []
        return [(digests[digest].components[1].quantile(50), {})]
    return reading


def _spill(unit: str):
    def reading(observed: WorkerFamilies) -> Reading:
        metrics = getattr(observed.worker.data, "cumulative_metrics", None)
        if metrics is None:  # spilling is disabled
            return []
        return [
            (value, {"activity": label})
            for (label, u), value in copy_mapping(metrics).items() if u == unit
        ]
    return reading


#: Dask's worker families; Prometheus names by
#: :func:`dask_otel.export.instruments.prometheus_name`
WORKER_FAMILIES: tuple[MetricSpec, ...] = (
    MetricSpec("dask.worker.tasks", GAUGE, "{task}", "Number of tasks at worker.", _tasks),
    # Deprecated alias of transfer_incoming_count, removed in 2026.6.0 (#9249)
    MetricSpec("dask.worker.concurrent_fetch_requests", GAUGE, "{request}",
               "Number of open fetch requests to other workers (deprecated: "
               "transfer_incoming_count)",
               _served_until("2026.6.0", _one(lambda w: w.state.transfer_incoming_count))),
    MetricSpec("dask.worker.gil_contention", COUNTER, "s", "GIL contention metric", _gil),
    MetricSpec("dask.worker.gc_collection", COUNTER, "s",
               "Total time spent on garbage collection", gc_collection, per_process=True),
    MetricSpec("dask.worker.threads", GAUGE, "{thread}", "Number of worker threads",
               _one(lambda w: w.state.nthreads)),
    MetricSpec("dask.worker.latency", GAUGE, "s", "Latency of worker connection",
               _one(lambda w: w.latency)),
    MetricSpec("dask.worker.memory", GAUGE, "By", "Memory breakdown", _memory),
    MetricSpec("dask.worker.transfer_incoming", GAUGE, "By",
               "Total size of open data transfers from other workers",
               _one(lambda w: w.state.transfer_incoming_bytes)),
    MetricSpec("dask.worker.transfer_incoming_count", GAUGE, "{transfer}",
               "Number of open data transfers from other workers",
               _one(lambda w: w.state.transfer_incoming_count)),
    # Same Prometheus name as the gauge above plus _total, as in Dask; a
    # different OTel name (a dot), which must be unique per meter
    MetricSpec("dask.worker.transfer_incoming.count", COUNTER, "{transfer}",
               "Total number of data transfers from other workers since the worker "
               "was started", _one(lambda w: w.state.transfer_incoming_count_total)),
    MetricSpec("dask.worker.transfer_outgoing", GAUGE, "By",
               "Total size of open data transfers to other workers",
               _one(lambda w: w.transfer_outgoing_bytes)),
    MetricSpec("dask.worker.transfer_outgoing_count", GAUGE, "{transfer}",
               "Number of open data transfers to other workers",
               _one(lambda w: w.transfer_outgoing_count)),
    MetricSpec("dask.worker.transfer_outgoing.bytes", COUNTER, "By",
               "Total size of data transfers to other workers since the worker was "
               "started (including in-progress and failed transfers)",
               _one(lambda w: w.transfer_outgoing_bytes_total)),
    MetricSpec("dask.worker.transfer_outgoing.count", COUNTER, "{transfer}",
               "Total number of data transfers to other workers since the worker "
               "was started", _one(lambda w: w.transfer_outgoing_count_total)),
    MetricSpec("dask.worker.tick_duration_median", GAUGE, "s",
               "Median tick duration at worker", _median("tick-duration")),
    MetricSpec("dask.worker.task_duration_median", GAUGE, "s",
               "Median task runtime at worker", _median("task-duration")),
    MetricSpec("dask.worker.transfer_bandwidth_median", GAUGE, "By",
               "Bandwidth for transfer at worker", _median("transfer-bandwidth")),
    MetricSpec("dask.worker.spill_bytes", COUNTER, "{byte}",
               "Total size of memory and disk accesses caused by managed data since "
               "the latest worker restart", _spill("bytes")),
    MetricSpec("dask.worker.spill_count", COUNTER, "{access}",
               "Total number of memory and disk accesses caused by managed data "
               "since the latest worker restart", _spill("count")),
    MetricSpec("dask.worker.spill_time", COUNTER, "s",
               "Total time spent spilling/unspilling since the latest worker restart",
               _spill("seconds")),
    MetricSpec("dask.worker.tick_duration_maximum", GAUGE, "s",
               "Maximum tick duration observed (not reset by this read)", _tick_maximum),
    MetricSpec("dask.worker.tick_count", COUNTER, "{tick}",
               "Total number of ticks observed since the server started",
               _one(lambda w: w._tick_counter)),
)


class WorkerFamilyInstruments(ProcessInstruments):
    table = WORKER_FAMILIES


class WorkerFamilies(Attached):
    """Exports one worker's Dask families from now until :meth:`close`.

    Each series carries ``dask.worker.address`` beside Dask's labels, as the
    spill metrics do: Prometheus tells the workers' series apart by the
    ``instance`` label of the endpoint it scraped, while over OTLP every worker
    of a cluster shares one resource (its scheduler's).
    """

    worker: Worker

    def __init__(self, worker: Worker, own: ServerTelemetry):
        super().__init__({**own.metric_attributes, WORKER_ADDRESS: worker.address})
        self.worker = worker
        assert own.telemetry.meter_provider is not None
        WorkerFamilyInstruments.of(own.telemetry.meter_provider).attach(self)
