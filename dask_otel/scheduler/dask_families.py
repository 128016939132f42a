"""Dask's own scheduler metric families (``dask_scheduler_*``, ``dask_semaphore_*``,
``dask_stealing_*``) as OpenTelemetry instruments: opt-in ``otel.metrics.dask``.

Dask serves them on the scheduler's ``/metrics`` (``distributed/http/scheduler/
prometheus/``); a backend that only receives OTLP never sees them. Each row of
:data:`SCHEDULER_FAMILIES` is named so that OpenTelemetry's Prometheus
translation (dots to ``_``, unit ``s`` to ``_seconds``, ``By`` to ``_bytes``,
annotations such as ``{task}`` dropped, ``_total`` on counters) gives Dask's
exact name, and its attributes are Dask's label names.

The readers read the attributes Dask's collectors read, never the collectors:
collecting clears ``Scheduler.digests_max`` (the tick-duration maximum a
Prometheus scrape would then miss) and calls ``SystemMonitor.update()``.
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

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.export.telemetry import ServerTelemetry


def _one(read):
    """A family of one unlabelled series; none where this distributed lacks what
    it reads (``client_connections_added``, ``workers_added``... are newer than
    distributed 2024.1.0)"""
    def reading(observed: SchedulerFamilies) -> Reading:
        try:
            return [(float(read(observed.scheduler)), {})]
        except AttributeError:
            return []
    return reading


def _per_prefix(read):
    """One series per task prefix, label ``task_prefix_name``"""
    def reading(observed: SchedulerFamilies) -> Reading:
        return [
            (float(read(tp)), {"task_prefix_name": tp.name})
            for tp in list(observed.scheduler.task_prefixes.values())
        ]
    return reading


def _workers(observed: SchedulerFamilies) -> Reading:
    s = observed.scheduler
    if not dask_at_least("2024.7.1"):  # one state for both before
        return [
            (len(s.idle), {"state": "idle"}),
            (len(s.running) - len(s.idle) - len(s.saturated), {"state": "partially_saturated"}),
            (len(s.saturated), {"state": "saturated"}),
            (len(s.workers) - len(s.running), {"state": "paused_or_retiring"}),
        ]
    paused = sum(1 for ws in list(s.workers.values()) if ws.status.name == "paused")
    idle, running, saturated = len(s.idle), len(s.running), len(s.saturated)
    return [
        (idle, {"state": "idle"}),
        (running - idle - saturated, {"state": "partially_saturated"}),
        (saturated, {"state": "saturated"}),
        (paused, {"state": "paused"}),
        (len(s.workers) - paused - running, {"state": "retiring"}),
    ]


def _task_counts(observed: SchedulerFamilies) -> dict[str, float]:
    counts: dict[str, float] = {}
    for tp in list(observed.scheduler.task_prefixes.values()):
        for state, n in copy_mapping(tp.states).items():
            counts[state] = counts.get(state, 0) + n
    return counts


def _tasks(observed: SchedulerFamilies) -> Reading:
    from distributed.scheduler import ALL_TASK_STATES

    counts = _task_counts(observed)
    return [
        (counts.get(state, 0.0), {"state": state})
        for state in ALL_TASK_STATES if state != "forgotten"
    ]


def _prefix_state_totals(observed: SchedulerFamilies) -> Reading:
    return [
        (count, {"task_prefix_name": tp.name, "state": state})
        for tp in list(observed.scheduler.task_prefixes.values())
        for state, count in copy_mapping(tp.state_counts).items()
    ]


def _gil(observed: Any) -> Reading:
    return gil_contention(observed.scheduler.monitor)


def _tick_maximum(observed: SchedulerFamilies) -> Reading:
    # Read, not cleared: Dask's own scrape clears digests_max
    s = observed.scheduler
    return [(max(s.digests_max.get("tick_duration", 0), time() - s._last_tick), {})]


def _semaphores(read):
    def reading(observed: SchedulerFamilies) -> Reading:
        ext = observed.scheduler.extensions.get("semaphores")
        if ext is None:
            return []
        return [
            (float(read(ext, name)), {"name": name})
            for name in list(copy_mapping(ext.max_leases))
        ]
    return reading


def _stealing(metric: str):
    def reading(observed: SchedulerFamilies) -> Reading:
        ext = observed.scheduler.extensions.get("stealing")
        if ext is None:
            return []
        return [
            (ext.metrics[metric][level], {"cost_multiplier": str(multiplier)})
            for level, multiplier in enumerate(ext.cost_multipliers)
        ]
    return reading


def _client_count(s: Scheduler) -> int:
    return len([k for k in list(s.clients) if k != "fire-and-forget"])


#: Dask's scheduler families. Prometheus name (what docs/metrics.md lists):
#: :func:`~dask_otel.export.instruments.prometheus_name`.
SCHEDULER_FAMILIES: tuple[MetricSpec, ...] = (
    MetricSpec("dask.scheduler.clients", GAUGE, "{client}",
               "Number of clients connected", _one(_client_count)),
    MetricSpec("dask.scheduler.client_connections_added", COUNTER, "{connection}",
               "Total number of client connections added",
               _one(lambda s: s._client_connections_added_total)),
    MetricSpec("dask.scheduler.client_connections_removed", COUNTER, "{connection}",
               "Total number of client connections removed",
               _one(lambda s: s._client_connections_removed_total)),
    MetricSpec("dask.scheduler.desired_workers", GAUGE, "{worker}",
               "Number of workers scheduler needs for task graph",
               _one(lambda s: s.adaptive_target())),
    MetricSpec("dask.scheduler.workers", GAUGE, "{worker}",
               "Number of workers known by scheduler", _workers),
    MetricSpec("dask.scheduler.workers_added", COUNTER, "{worker}",
               "Total number of workers added", _one(lambda s: s._workers_added_total)),
    MetricSpec("dask.scheduler.workers_removed", COUNTER, "{worker}",
               "Total number of workers removed",
               _one(lambda s: s._workers_removed_total)),
    MetricSpec("dask.scheduler.gil_contention", COUNTER, "s",
               "GIL contention metric", _gil),
    MetricSpec("dask.scheduler.gc_collection", COUNTER, "s",
               "Total time spent on garbage collection", gc_collection, per_process=True),
    MetricSpec("dask.scheduler.last_time", COUNTER, "{time}",
               "SystemMonitor last time", _one(lambda s: s.monitor.last_time)),
    MetricSpec("dask.scheduler.tasks", GAUGE, "{task}",
               "Number of tasks known by scheduler", _tasks),
    MetricSpec("dask.scheduler.tasks_suspicious", COUNTER, "{task}",
               "Total number of times a task has been marked suspicious",
               _per_prefix(lambda tp: tp.suspicious)),
    MetricSpec("dask.scheduler.tasks_forgotten", COUNTER, "{task}",
               "Total number of processed tasks no longer in memory and already "
               "removed from the scheduler job queue",
               lambda o: [(_task_counts(o).get("forgotten", 0.0), {})]),
    MetricSpec("dask.scheduler.task_groups", GAUGE, "{group}",
               "Number of task groups known by scheduler",
               lambda o: [(len(o.scheduler.task_groups), {})]
               if dask_at_least("2024.6.0") else []),  # served from 2024.6.0
    MetricSpec("dask.scheduler.tasks_compute", COUNTER, "s",
               "Total amount of compute time spent in each prefix",
               _per_prefix(lambda tp: tp.all_durations["compute"])),
    MetricSpec("dask.scheduler.tasks_transfer", COUNTER, "s",
               "Total amount of transfer time spent in each prefix",
               _per_prefix(lambda tp: tp.all_durations["transfer"])),
    MetricSpec("dask.scheduler.tasks_output", GAUGE, "By",
               "Current number of bytes in memory (without duplicates) for each prefix",
               _per_prefix(lambda tp: tp.nbytes_total)),
    MetricSpec("dask.scheduler.prefix_state_totals", COUNTER, "{task}",
               "Accumulated count of task prefix in each state", _prefix_state_totals),
    MetricSpec("dask.scheduler.tick_duration_maximum", GAUGE, "s",
               "Maximum tick duration observed since the last collection's "
               "previous tick (not reset by this read)", _tick_maximum),
    MetricSpec("dask.scheduler.tick_count", COUNTER, "{tick}",
               "Total number of ticks observed since the server started",
               _one(lambda s: s._tick_counter)),
    MetricSpec("dask.semaphore.max_leases", GAUGE, "{lease}",
               "Maximum leases allowed per semaphore",
               _semaphores(lambda ext, n: ext.max_leases[n])),
    MetricSpec("dask.semaphore.active_leases", GAUGE, "{lease}",
               "Amount of currently active leases per semaphore",
               _semaphores(lambda ext, n: len(ext.leases[n]))),
    MetricSpec("dask.semaphore.pending_leases", GAUGE, "{lease}",
               "Amount of currently pending leases per semaphore",
               _semaphores(lambda ext, n: ext.metrics["pending"][n])),
    MetricSpec("dask.semaphore.acquire", COUNTER, "{lease}",
               "Total number of leases acquired per semaphore",
               _semaphores(lambda ext, n: ext.metrics["acquire_total"][n])),
    MetricSpec("dask.semaphore.release", COUNTER, "{lease}",
               "Total number of leases released per semaphore",
               _semaphores(lambda ext, n: ext.metrics["release_total"][n])),
    # Dask gives this one the unit "s", which prometheus_client appends as is
    # ("_s"); OTel would append "_seconds" to the unit s, so it is in the name
    MetricSpec("dask.semaphore.average_pending_lease_time_s", GAUGE, "{second}",
               "Exponential moving average of the time it took to acquire a lease "
               "per semaphore",
               _semaphores(lambda ext, n: ext.metrics["average_pending_lease_time"][n])),
    MetricSpec("dask.stealing.request_count", COUNTER, "{request}",
               "Total number of stealing requests per cost multiplier.",
               _stealing("request_count_total")),
    MetricSpec("dask.stealing.request_cost", COUNTER, "{cost}",
               "Total cost of stealing requests per cost multiplier.",
               _stealing("request_cost_total")),
)


class SchedulerFamilyInstruments(ProcessInstruments):
    table = SCHEDULER_FAMILIES


class SchedulerFamilies(Attached):
    """Exports one scheduler's Dask families from now until :meth:`close`"""

    scheduler: Scheduler

    def __init__(self, scheduler: Scheduler, own: ServerTelemetry):
        # Dask's label sets exactly: the resource names the scheduler
        super().__init__(dict(own.metric_attributes))
        self.scheduler = scheduler
        assert own.telemetry.meter_provider is not None
        SchedulerFamilyInstruments.of(own.telemetry.meter_provider).attach(self)
