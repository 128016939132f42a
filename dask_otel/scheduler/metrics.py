"""The scheduler's metrics: Dask's fine performance metrics
(``Scheduler.cumulative_worker_metrics``, as observable counters, at most
:data:`MAX_SERIES` series each) and the span mirror's (``dask.otel.span.*``; the
export health: :mod:`dask_otel.export.accounting`).
:data:`SCHEDULER_METRICS` is the only place they are named; what each means:
docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any

from distributed.spans import CONTEXTS_WITH_SPAN_ID

import dask_otel.attributes as attr
from dask_otel._compat import span_own_metrics
from dask_otel.export.instruments import (COUNTER, GAUGE, Attached, MetricSpec,
                                          ProcessInstruments, Reading, copy_mapping)
from dask_otel.scheduler.totals import fine_key
from dask_otel.span_context import in_context

if TYPE_CHECKING:
    from distributed import Scheduler
    from opentelemetry.context import Context

    from dask_otel.export.telemetry import ServerTelemetry
    from dask_otel.spans import SpanMirror


#: Series per fine-metrics instrument, scheduler and collection, the rest folded
#: into one overflow series (the SDK 1.45.2 default; folding here, not in the
#: SDK, saves ~20 us per further series: seconds of GIL at 10,000 prefixes)
MAX_SERIES = 2000
#: The series the rest is summed into: the attribute of the SDK's own overflow point
OVERFLOW = {"otel.metric.overflow": True}


@lru_cache(maxsize=4 * MAX_SERIES)  # only the first MAX_SERIES keys of a unit are exported
def fine_metric_attributes(key: Hashable) -> tuple[str, dict[str, Any]] | None:
    """``(dask unit, attributes)`` of a fine-metrics key (:func:`fine_key`), built
    once; None for other keys (``"latency"``...)"""
    if (fk := fine_key(key)) is None:
        return None
    attributes = {attr.ACTIVITY_CONTEXT: fk.context, attr.ACTIVITY: fk.activity}
    if fk.prefix is not None:
        attributes[attr.TASK_PREFIX] = fk.prefix
    elif fk.where is not None:
        attributes[attr.ACTIVITY_WHERE] = fk.where
    return fk.unit, attributes


#: One fine-metrics reading before its attributes are built: value, Dask key, and
#: the attributes to add (the span name)
_Raw = tuple[float, tuple, Mapping[str, Any] | None]


@dataclass(slots=True)
class UnitRead:
    """What a read of one Dask unit's fine metrics leaves for the next"""

    #: Dask's mappings read, copied: ``(Dask span id or None, attributes to add,
    #: metrics)``; the reading made of them; each series' value (one that grew
    #: since carries an exemplar); whether the reading has exemplars
    state: list[tuple[str | None, Mapping[str, Any] | None, dict]]
    reading: Reading
    values: dict[tuple, float]
    exemplars: bool
    #: By mapping (its Dask span id; None: the scheduler's): how many keys were
    #: read, and which of them are the unit's series (:meth:`SchedulerMetrics.series_keys`)
    keys: dict[str | None, tuple[int, list[tuple]]]


def _fine_metrics(name: str, unit: str, what: str, dask_unit: str) -> MetricSpec:
    """The instrument of one Dask unit of the fine metrics (the last element of the keys
    of ``Scheduler.cumulative_worker_metrics``)"""

    def read(observed: SchedulerMetrics) -> Reading:
        scheduler = observed.scheduler
        spans = observed.span_label and scheduler.extensions.get("spans")
        # With span-label, what can be attributed to spans is read from them
        state: list = [(None, None, observed.fine_copy(scheduler.cumulative_worker_metrics))]
        if spans:
            for span in list(spans.spans.values()):
                own = span_own_metrics(span)
                if own:
                    state.append((span.id, {attr.SPAN_NAME: tuple(span.name)},
                                  observed.fine_copy(own)))
        last = observed.reads.get(dask_unit)
        if last is not None and last.state == state:
            # Nothing changed since the last read (the usual case at a short
            # interval): the same reading, whose observations are reused; no
            # series grew, so without exemplars
            if last.exemplars:
                last.reading, last.exemplars = [r[:2] for r in last.reading], False
            return last.reading
        skip = CONTEXTS_WITH_SPAN_ID if spans else ()
        keys_now: dict[str | None, tuple[int, list[tuple]]] = {}  # of the mappings read now only
        out: list[_Raw] = []
        overflow: float | None = None
        for span_id, extra, metrics in state:
            # a span's own mapping holds just the contexts skipped in the scheduler's: all kept
            _, keys = keys_now[span_id] = observed.series_keys(
                dask_unit, metrics, last and last.keys.get(span_id),
                () if extra is not None else skip)
            # The first MAX_SERIES series in Dask's order (each keeps its place as
            # more come), the rest summed in C
            room = max(MAX_SERIES - len(out), 0)
            head = keys[:room]
            out += zip(map(metrics.__getitem__, head), head, repeat(extra))
            if len(keys) > room:
                overflow = (overflow or 0.0) + sum(map(metrics.__getitem__, keys[room:]))
        reading, values, exemplars = observed.with_exemplars(
            out, overflow, last.values if last is not None else {})
        observed.reads[dask_unit] = UnitRead(state, reading, values, exemplars, keys_now)
        return reading

    return MetricSpec(name, COUNTER, unit, f"{what}, by context, task prefix and activity "
                      "(Dask's fine performance metrics)", read)


#: Every scheduler instrument
SCHEDULER_METRICS: tuple[MetricSpec, ...] = (
    _fine_metrics("dask.activity.time", "s", "Time workers spent", "seconds"),
    _fine_metrics("dask.activity.size", "By", "Bytes workers processed", "bytes"),
    _fine_metrics("dask.activity.count", "{operation}", "Operations workers performed", "count"),
    # With metrics on, the mirror runs and has its outcomes (SchedulerMetrics.mirror)
    MetricSpec("dask.workflow.active", GAUGE, "{run}", "Workflow runs (root Dask spans) open now, "
               "by name", lambda m: m.mirror.outcomes.open_runs(m.mirror.ledger, False)),
    MetricSpec("dask.workflow.tasks", GAUGE, "{task}", "Tasks of the open runs of each workflow, "
               "by state", lambda m: m.mirror.outcomes.open_runs(m.mirror.ledger, True)),
    MetricSpec("dask.otel.span.mirrored", COUNTER, "{span}",
               "Dask spans and TaskGroups the bridge handed to the OpenTelemetry SDK",
               lambda m: [(m.mirror.mirrored, {})]),
    MetricSpec("dask.otel.span.sampled_out", COUNTER, "{span}",
               "Dask spans and TaskGroups the sampler (OTEL_TRACES_SAMPLER) dropped",
               lambda m: [(m.mirror.sampled_out, {})]),
)


class SchedulerInstruments(ProcessInstruments):
    """The scheduler instruments of one MeterProvider, reporting on every
    scheduler of this process"""

    table = SCHEDULER_METRICS


class SchedulerMetrics(Attached):
    """Exports one scheduler's fine performance metrics and the bridge's
    self-metrics, from now until :meth:`close`"""

    def __init__(self, scheduler: Scheduler, own: ServerTelemetry, mirror: SpanMirror):
        # metric_attributes: a second scheduler in the process has the first's resource
        super().__init__(dict(own.metric_attributes))
        self.scheduler = scheduler
        #: The span mirror (traces on or off; always on with metrics): its counters,
        #: exemplars and open runs
        self.mirror = mirror
        if mirror.builder is not None:  # its queue-full drops
            own.telemetry.health.builders.append(mirror.builder)  # type: ignore[union-attr]
        #: otel.metrics.span-label
        self.span_label = own.config.span_label
        #: By Dask unit, what its last read left for the next
        self.reads: dict[str, UnitRead] = {}
        #: Keys of Dask's mappings that are no fine metrics, seen so far
        #: (``latency``, ``tick-duration``: they change at every heartbeat)
        self.not_fine: set[Hashable] = set()
        SchedulerInstruments.of(own.telemetry.meter_provider).attach(self)

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
            elif (fk := fine_key(key)) is not None and fk.unit == unit and fk.context not in skip:
                keys.append(key)
        return len(metrics), keys

    def with_exemplars(self, raw: list[_Raw], overflow: float | None, previous: dict[tuple, float]
                       ) -> tuple[Reading, dict[tuple, float], bool]:
        """The readings of one fine-metrics instrument, with their attributes, and the
        ``overflow`` reading last (the sum of the series past :data:`MAX_SERIES`; None:
        none); those of a task prefix that grew since ``previous`` (each series' value
        then) in the context of the latest sampled TaskGroup span of that prefix
        (docs/metrics.md: exemplars). Each series' value now; whether any has an exemplar"""
        latest = self.mirror.latest_by_prefix
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
