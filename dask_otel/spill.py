"""A worker's managed data (``Worker.data``: a SpillBuffer, a plain dict when
spilling is disabled, or a third-party buffer, of which whatever it has is read)
as OpenTelemetry metrics, read when the metric reader collects. The instruments
are :data:`SPILL_METRICS`, the only place their names are spelled. What each
means and the formulas that combine them: docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from functools import partial
from typing import TYPE_CHECKING

import dask.config

from dask_otel.attributes import ACTIVITY, THRESHOLD, WORKER_ADDRESS, WORKER_NAME
from dask_otel.export.instruments import (COUNTER, GAUGE, Attached, MetricSpec, ProcessInstruments,
                                          Reading, copy_mapping)

if TYPE_CHECKING:
    from distributed import Worker

    from dask_otel.export.telemetry import ServerTelemetry

#: What the current SpillBuffer records in ``cumulative_metrics``, exported as 0
#: until it happens: Prometheus' rate() loses the first increase of a series
#: that appears with a value above 0
SPILLBUFFER_TOTALS = (
    *((activity, unit) for activity in ("memory-read", "disk-read", "disk-write")
      for unit in ("count", "bytes")),
    *((activity, "seconds") for activity in ("disk-read", "disk-write", "serialize", "deserialize",
                                            "compress", "decompress")),
)


class ObservedWorker(Attached):
    """A worker that the spill instruments of its process report on, from now
    until :meth:`close`"""

    worker: Worker
    #: distributed.worker.memory.terminate when the worker started; only a nanny
    #: enforces it, so None for a worker without one
    terminate_fraction: float | None

    def __init__(self, worker: Worker, own: ServerTelemetry):
        super().__init__({WORKER_ADDRESS: worker.address, WORKER_NAME: str(worker.name),
                          **own.metric_attributes})
        self.worker = worker
        fraction = dask.config.get("distributed.worker.memory.terminate", False)
        self.terminate_fraction = fraction if getattr(worker, "nanny", None) else None
        assert own.telemetry.meter_provider is not None
        SpillInstruments.of(own.telemetry.meter_provider).attach(self)

    @property
    def active(self) -> bool:
        return getattr(self.worker.status, "name", "") not in ("closing", "closed", "failed")


def spill_levels(worker: Worker) -> dict[str, float]:
    """What the worker's data holds now; what this kind of ``data`` cannot tell
    is missing"""
    data = worker.data
    fast, slow = getattr(data, "fast", None), getattr(data, "slow", None)
    spilled = getattr(data, "spilled_total", None)  # SpilledSize(memory, disk)
    out: dict[str, float] = {}
    if fast is None and slow is None:
        # Spilling is disabled: a plain mapping, all of it in memory
        out.update(disk_count=0, disk_size=0, disk_memory_size=0)
    if isinstance(slow, Sized):
        out["disk_count"] = len(slow)
    if spilled is not None:
        out["disk_memory_size"], out["disk_size"] = spilled
    if isinstance(fast, Sized):
        out["memory_count"] = len(fast)
    elif "disk_count" in out:
        out["memory_count"] = len(data) - out["disk_count"]
    weight = getattr(fast, "total_weight", None)  # zict.LRU: sum of sizeof()
    if isinstance(weight, (int, float)):
        out["memory_size"] = weight
    elif "disk_memory_size" in out:
        # WorkerState.nbytes counts every key in data, spilled or not
        out["memory_size"] = worker.state.nbytes - out["disk_memory_size"]
    return out


def spill_totals(worker: Worker) -> dict[tuple[str, str], float]:
    """``{(activity, unit): value}`` since the worker started: its data's
    ``cumulative_metrics``, if it has them"""
    current = getattr(worker.data, "cumulative_metrics", None)
    if not isinstance(current, Mapping):
        return {}
    out = dict.fromkeys(SPILLBUFFER_TOTALS, 0.0)
    out.update(((str(a), str(u)), v) for (a, u), v in copy_mapping(current).items())
    return out


def memory_thresholds(observed: ObservedWorker) -> Reading:
    """The worker's memory limit and the enabled thresholds, in bytes"""
    manager = getattr(observed.worker, "memory_manager", None)
    limit = getattr(manager, "memory_limit", None)
    if not limit:
        return []
    fractions = {
        "target": getattr(manager, "memory_target_fraction", False),
        "spill": getattr(manager, "memory_spill_fraction", False),
        "pause": getattr(manager, "memory_pause_fraction", False),
        "terminate": observed.terminate_fraction,
    }
    return [(limit, {THRESHOLD: "limit"})] + [
        (int(limit * fraction), {THRESHOLD: name}) for name, fraction in fractions.items()
        if fraction is not None and fraction is not False]


def _level(field: str, observed: ObservedWorker) -> Reading:
    value = spill_levels(observed.worker).get(field)
    return [] if value is None else [(value, {})]


def _total(dask_unit: str, observed: ObservedWorker) -> Reading:
    return [(value, {ACTIVITY: activity})
            for (activity, unit), value in spill_totals(observed.worker).items()
            if unit == dask_unit]


#: Every spill instrument. The Dask unit of a ``_total`` is the second element of
#: the keys of ``SpillBuffer.cumulative_metrics``.
SPILL_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("dask.spill.memory.keys", GAUGE, "{key}", "Keys held in memory by the worker",
               partial(_level, "memory_count")),
    MetricSpec("dask.spill.memory.size", GAUGE, "By",
               "Size in memory (sizeof) of the keys held in memory by the worker",
               partial(_level, "memory_size")),
    MetricSpec("dask.spill.disk.keys", GAUGE, "{key}", "Keys spilled to disk by the worker",
               partial(_level, "disk_count")),
    MetricSpec("dask.spill.disk.size", GAUGE, "By",
               "Bytes on disk (pickled, possibly compressed) of the keys spilled by the worker",
               partial(_level, "disk_size")),
    MetricSpec("dask.spill.disk.memory_size", GAUGE, "By",
               "Size in memory (sizeof) of the keys spilled to disk by the worker",
               partial(_level, "disk_memory_size")),
    MetricSpec("dask.memory.threshold", GAUGE, "By",
               "Memory limit and thresholds of the worker (attribute dask.threshold)",
               memory_thresholds),
    MetricSpec("dask.spill.count", COUNTER, "{key}",
               "Keys read from memory or disk, or written to disk, by the worker's data "
               "since the worker started", partial(_total, "count")),
    MetricSpec("dask.spill.size", COUNTER, "By",
               "Bytes read from memory or disk, or written to disk, by the worker's data "
               "since the worker started", partial(_total, "bytes")),
    MetricSpec("dask.spill.time", COUNTER, "s",
               "Time spent spilling and unspilling (disk I/O, (de)serialization, "
               "(de)compression) since the worker started", partial(_total, "seconds")),
)


class SpillInstruments(ProcessInstruments):
    """The spill instruments of one MeterProvider, on every observed worker of
    this process"""

    table = SPILL_METRICS
