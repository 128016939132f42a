"""The scheduler's metrics: Dask's fine performance metrics
(``Scheduler.cumulative_worker_metrics``, as observable counters, at most
:data:`MAX_SERIES` series each) and the bridge's own (``dask.otel.*``).
:data:`SCHEDULER_METRICS` is the only place they are named; what each means:
docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from functools import lru_cache
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any

from distributed.spans import CONTEXTS_WITH_SPAN_ID

import dask_otel.attributes as attr
from dask_otel._compat import span_own_metrics
from dask_otel.export.instruments import (COUNTER, GAUGE, Attached, MetricSpec,
                                          ProcessInstruments, Reading, copy_mapping)
from dask_otel.span_context import in_context

if TYPE_CHECKING:
    from distributed import Scheduler
    from opentelemetry.context import Context

    from dask_otel.export.telemetry import ServerTelemetry, Telemetry
    from dask_otel.spans import SpanMirror


#: Series per fine-metrics instrument, scheduler and collection, the rest folded
#: into one overflow series (the SDK 1.45.2 default; folding here, not in the
#: SDK, saves ~20 us per further series: seconds of GIL at 10,000 prefixes)
MAX_SERIES = 2000
#: The series the rest is summed into: the attribute of the SDK's own overflow point
OVERFLOW = {"otel.metric.overflow": True}


@lru_cache(maxsize=4 * MAX_SERIES)  # only the first MAX_SERIES keys of a unit are exported
def fine_metric_attributes(key: Hashable) -> tuple[str, dict[str, Any]] | None:
    """``(dask unit, attributes)`` of a fine-metrics key ``(context, [prefix or
    where...], activity, unit)``, built once; None for other keys (``"latency"``...)"""
    if not isinstance(key, tuple) or len(key) < 3:
        return None
    context, *middle, activity, unit = key
    attributes = {attr.ACTIVITY_CONTEXT: str(context), attr.ACTIVITY: str(activity)}
    if middle:
        if context == "execute":
            attributes[attr.TASK_PREFIX] = str(middle[0])
        else:
            attributes[attr.ACTIVITY_WHERE] = " ".join(map(str, middle))
    return str(unit), attributes


#: One fine-metrics reading before its attributes are built: value, Dask key, and
#: the attributes to add (the span name)
_Raw = tuple[float, tuple, Mapping[str, Any] | None]


def _fine_metrics(dask_unit: str):
    def read(observed: SchedulerMetrics) -> Reading:
        scheduler = observed.scheduler
        spans = observed.span_label and scheduler.extensions.get("spans")
        # Dask's mappings, copied: [(Dask span id or None, attributes to add,
        # metrics)]. With span-label, what can be attributed to spans is read from them
        state = [(None, None, observed.fine_copy(scheduler.cumulative_worker_metrics))]
        if spans:
            for span in list(spans.spans.values()):
                own = span_own_metrics(span)
                if own:
                    state.append((span.id, {attr.SPAN_NAME: tuple(span.name)},
                                  observed.fine_copy(own)))
        previous = observed.previous.get(dask_unit)
        if previous is not None and previous[0] == state:
            # Nothing changed since the last read (the usual case at a short
            # interval): the same reading, whose observations are reused; no
            # series grew, so without exemplars
            if previous[3]:
                previous = observed.previous[dask_unit] = (
                    state, [r[:2] for r in previous[1]], previous[2], False)
            return previous[1]
        skip = CONTEXTS_WITH_SPAN_ID if spans else ()
        known = observed.unit_keys.get(dask_unit, {})
        keys_now = {}  # of the mappings read now only
        out: list[_Raw] = []
        overflow: float | None = None
        for span_id, extra, metrics in state:
            # a span's own mapping holds just the contexts skipped in the scheduler's: all kept
            _, keys = keys_now[span_id] = observed.series_keys(
                dask_unit, metrics, known.get(span_id), () if extra is not None else skip)
            # The first MAX_SERIES series in Dask's order (each keeps its place as
            # more come), the rest summed in C
            room = max(MAX_SERIES - len(out), 0)
            head = keys[:room]
            out += zip(map(metrics.__getitem__, head), head, repeat(extra))
            if len(keys) > room:
                overflow = (overflow or 0.0) + sum(map(metrics.__getitem__, keys[room:]))
        observed.unit_keys[dask_unit] = keys_now
        reading, values, exemplars = observed.with_exemplars(
            out, overflow, previous[2] if previous is not None else {})
        observed.previous[dask_unit] = (state, reading, values, exemplars)
        return reading

    return read


def _mirror_count(field: str):
    def read(observed: SchedulerMetrics) -> Reading:
        mirror = observed.mirror
        return [] if mirror is None else [(getattr(mirror, field), {})]

    return read


#: ``dask.otel.span.dropped`` of the spans a poll handed over past the builder
#: thread's queue (the SDK's own instruments name a full queue so too)
QUEUE_FULL = {attr.ERROR_TYPE: "queue_full"}


def _dropped(observed: SchedulerMetrics) -> Reading:
    """Spans lost: each span exporter's failed ones, and the builder's queue-full
    drops (this scheduler's: the row is read once per process, which runs one),
    from 0 on, as the exporters' are: an alert's ``increase()`` needs the series
    before the first drop"""
    readings = _exported("failed", "spans")(observed)
    mirror = observed.mirror
    if mirror is not None and mirror.builder is not None:
        readings.append((mirror.builder.dropped, QUEUE_FULL))
    return readings


def _exported(field: str, signal: str | None = None):
    """``field`` of the process's accounted exporters (``ExportOutage``), by signal;
    of ``signal``'s only, when given"""
    def read(observed: SchedulerMetrics) -> Reading:
        return [(getattr(e.outage, field), {attr.OTEL_EXPORTER: type(e.exporter).__name__,
                                            **({} if signal else {attr.OTEL_SIGNAL: e.outage.signal})})
                for e in list(observed.telemetry.accounted) if signal in (None, e.outage.signal)]

    return read


#: Every scheduler instrument. The Dask unit in ``_fine_metrics(...)`` is the last
#: element of the keys of ``Scheduler.cumulative_worker_metrics``.
SCHEDULER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "dask.activity.time", COUNTER, "s",
        "Time workers spent, by context, task prefix and activity "
        "(Dask's fine performance metrics)", _fine_metrics("seconds"),
    ),
    MetricSpec(
        "dask.activity.size", COUNTER, "By",
        "Bytes workers processed, by context, task prefix and activity "
        "(Dask's fine performance metrics)", _fine_metrics("bytes"),
    ),
    MetricSpec(
        "dask.activity.count", COUNTER, "{operation}",
        "Operations workers performed, by context, task prefix and activity "
        "(Dask's fine performance metrics)", _fine_metrics("count"),
    ),
    # With metrics on, the mirror runs and has its outcomes
    MetricSpec("dask.workflow.active", GAUGE, "{run}", "Workflow runs (root Dask spans) open now, "
               "by name", lambda m: m.mirror.outcomes.open_runs(m.mirror.ledger, False)),
    MetricSpec("dask.workflow.tasks", GAUGE, "{task}", "Tasks of the open runs of each workflow, "
               "by state", lambda m: m.mirror.outcomes.open_runs(m.mirror.ledger, True)),
    MetricSpec("dask.otel.span.mirrored", COUNTER, "{span}",
               "Dask spans and TaskGroups the bridge handed to the OpenTelemetry SDK",
               _mirror_count("mirrored")),
    MetricSpec("dask.otel.span.sampled_out", COUNTER, "{span}",
               "Dask spans and TaskGroups the sampler (OTEL_TRACES_SAMPLER) dropped",
               _mirror_count("sampled_out")),
    MetricSpec("dask.otel.span.exported", COUNTER, "{span}", "Spans the exporter delivered",
               _exported("exported", "spans"), per_process=True),
    MetricSpec("dask.otel.span.dropped", COUNTER, "{span}",
               "Spans lost because their export failed, or was not tried during an outage, "
               "or the builder thread's queue was full",
               _dropped, per_process=True),
    MetricSpec("dask.otel.export.items", COUNTER, "{item}",
               "Spans, metric points and log records the collector accepted, by signal",
               _exported("exported"), per_process=True),
    MetricSpec("dask.otel.export.size", COUNTER, "By",
               "Bytes of the OTLP requests the collector accepted, by signal, before compression",
               _exported("sent_bytes"), per_process=True),
    MetricSpec("dask.otel.export.failures", COUNTER, "{request}",
               "Export requests that failed (an outage's probes included), by signal",
               _exported("export_failures"), per_process=True),
)


class SchedulerInstruments(ProcessInstruments):
    """The scheduler instruments of one MeterProvider, reporting on every
    scheduler of this process"""

    table = SCHEDULER_METRICS


class SchedulerMetrics(Attached):
    """Exports one scheduler's fine performance metrics and the bridge's
    self-metrics, from now until :meth:`close`"""

    def __init__(self, scheduler: Scheduler, own: ServerTelemetry, mirror: SpanMirror | None):
        # metric_attributes: a second scheduler in the process has the first's resource
        super().__init__(dict(own.metric_attributes))
        self.scheduler = scheduler
        #: The process's Telemetry: its accounted exporters' counts
        self.telemetry: Telemetry = own.telemetry
        #: The span mirror (traces on or off): its counters, exemplars and open runs
        self.mirror = mirror
        #: otel.metrics.span-label
        self.span_label = own.config.span_label
        #: Dask unit -> (Dask's mappings at the previous read, that reading, each
        #: series' value then (one that grew since carries an exemplar), whether
        #: the reading has exemplars)
        self.previous: dict[str, tuple[list, Reading, dict[tuple, float], bool]] = {}
        #: Keys of Dask's mappings that are no fine metrics, seen so far
        #: (``latency``, ``tick-duration``: they change at every heartbeat)
        self.not_fine: set[Hashable] = set()
        #: Dask unit -> Dask span id (None: the scheduler's mapping) -> how many
        #: keys of that mapping were read, and which of them are the unit's series
        #: (:meth:`series_keys`)
        self.unit_keys: dict[str, dict[str | None, tuple[int, list[tuple]]]] = {}
        assert self.telemetry.meter_provider is not None
        SchedulerInstruments.of(self.telemetry.meter_provider).attach(self)

    def fine_copy(self, metrics: Mapping[Hashable, float]) -> dict[Hashable, float]:
        """A copy of ``metrics`` without the keys known to be no fine metrics"""
        out = copy_mapping(metrics)
        for key in tuple(self.not_fine):  # made in C: another reader may add to it
            out.pop(key, None)
        return out

    def series_keys(self, unit: str, metrics: dict[Hashable, float],
                    known: tuple[int, list[tuple]] | None,
                    skip: Collection[Hashable]) -> tuple[int, list[tuple]]:
        """How many keys ``metrics`` (a :meth:`fine_copy`) has and which are series of
        ``unit``, in Dask's order (of contexts not in ``skip``), from those
        ``known`` at the previous read: Dask's
        mappings only grow, in insertion order, so only the keys added since are
        looked at (a read at 10,000 task prefixes would otherwise pass over 110,000
        keys in Python for each unit). Keys that are no fine metrics are dropped
        from ``metrics`` and remembered in :attr:`not_fine`."""
        seen, keys = known if known is not None and known[0] <= len(metrics) else (0, [])
        keys = list(keys)  # known stays as it was if this read fails half-way
        for key in list(islice(metrics, seen, None)):
            if not isinstance(key, tuple):
                self.not_fine.add(key)
                del metrics[key]
            elif len(key) >= 3 and key[-1] == unit and key[0] not in skip:
                keys.append(key)
        return len(metrics), keys

    def with_exemplars(self, raw: list[_Raw], overflow: float | None, previous: dict[tuple, float]
                       ) -> tuple[Reading, dict[tuple, float], bool]:
        """The readings of one fine-metrics instrument, with their attributes, and the
        ``overflow`` reading last (the sum of the series past :data:`MAX_SERIES`; None:
        none); those of a task prefix that grew since ``previous`` (each series' value
        then) in the context of the latest sampled TaskGroup span of that prefix
        (docs/metrics.md: exemplars). Each series' value now; whether any has an exemplar"""
        mirror = self.mirror
        latest = mirror.latest_by_prefix if mirror is not None else {}
        now: dict[tuple, float] = {}
        contexts: dict[str, Context | None] = {}  # one per prefix, shared by its series
        out: list[tuple[Any, ...]] = []
        for value, dask_key, extra in raw:
            attributes = fine_metric_attributes(dask_key)[1]  # type: ignore[index]
            if extra:
                attributes = {**attributes, **extra}
            prefix = attributes.get(attr.TASK_PREFIX)
            if prefix is None or not latest:
                out.append((value, attributes))
                continue
            # what tells the series of a prefix apart (cheaper than all items)
            key = (prefix, attributes.get(attr.ACTIVITY_CONTEXT), attributes.get(attr.ACTIVITY),
                   attributes.get(attr.SPAN_NAME))
            now[key] = value
            context = latest.get(prefix)
            if context is not None and value > previous.get(key, 0):
                if prefix not in contexts:
                    contexts[prefix] = in_context(context)
                out.append((value, attributes, contexts[prefix]))
            else:
                out.append((value, attributes))
        if overflow is not None:
            out.append((overflow, OVERFLOW))
        return out, now, bool(contexts)
