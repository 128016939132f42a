"""What the mirror read on the event loop -> finished OpenTelemetry spans, on the
bridge's own thread (:meth:`SpanBuilder.hand_over`, a bounded queue: the mirror
drops and counts past it): the corridor's last stop (:mod:`dask_otel.spans`), whose
only way out is the sink. docs/traces.md; costs: benchmarks/README.md.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

from distributed.scheduler import ALL_TASK_STATES
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, Status, StatusCode

import dask_otel.attributes as attr
from dask_otel.export.sink import NO_ATTRIBUTES

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.export.sink import SpanSink

#: What the loop hands over: the ledger's records (no hook writes one once taken)
#: and the totals it summed. Not imported: those modules come before this one.
SpanRecord = GroupBatch = SpanHead = Totals = Any

logger = logging.getLogger("dask_otel")

#: A TaskGroup span's name: its task prefix behind a word of its own, so that a trace
#: UI lists TaskGroups apart from Dask spans and tasks (docs/traces.md "Span names")
TASKGROUP_SPAN_NAME = "taskgroup/{}"
#: Spans handed over and not yet built: past it spans are dropped, children first, and
#: counted (``SpanMirror._kept``; the SDK's batch span processor queues as many by default)
MAX_QUEUED_SPANS = 2048
#: ``dask.tasks.<state>`` by state: built once, not per span
_STATE_NAMES = {state: attr.TASKS_PREFIX + attr.snake(state) for state in ALL_TASK_STATES}
#: Open Dask spans whose sub-spans' fine metrics the builder thread sums, at most
#: (a span whose own export was dropped leaves its sum behind)
MAX_FOLDED = 1 << 16


_NO_PREFIX = object()


@lru_cache(maxsize=1 << 16)  # unbounded task prefixes: stay bounded
def _key_info(key: tuple[Hashable, ...]) -> tuple[str, Hashable, bool] | None:
    """A fine-metric key ``(context, [prefix,] ..., activity, unit)`` -> its attribute
    name, its task prefix (``_NO_PREFIX`` unless an ``execute`` metric of one) and
    whether it is seconds of ``execute``"""
    if len(key) < 3:
        return None
    execute = key[0] == "execute"
    parts = map(attr.snake, (key[0], key[-2], key[-1]))
    return ("dask.metrics.{}.{}.{}".format(*parts),
            key[1] if execute and len(key) >= 4 else _NO_PREFIX, execute and key[-1] == "seconds")


@dataclass(slots=True)
class SpanMetrics:
    """The fine performance metrics of one Dask span (its own, not its
    sub-spans'), as attributes, in one pass: summed over task prefixes for the
    span, and by task prefix for its TaskGroups. Named on the builder thread from
    the loop's copy (and on the loop for a later batch's starting point)."""

    #: ``dask.metrics.<context>.<activity>.<unit>``, summed over prefixes
    total: dict[str, float] = field(default_factory=dict)
    #: the same by task prefix, ``execute`` context only
    by_prefix: dict[Hashable, dict[str, float]] = field(default_factory=dict)
    #: seconds of the execute context, for "idle or other spans"
    execute_seconds: float = 0.0

    @classmethod
    def of(cls, metrics: Mapping[tuple[Hashable, ...], float]) -> SpanMetrics:
        """Of a Dask span's own metrics (``Span._cumulative_worker_metrics``, or
        the copy the loop took of them)"""
        out = cls()
        total, by_prefix = out.total, out.by_prefix
        for key, value in metrics.items():
            if not value or (info := _key_info(key)) is None:
                continue
            name, prefix, execute_seconds = info
            total[name] = total.get(name, 0) + value
            if prefix is not _NO_PREFIX:
                attrs = by_prefix.get(prefix)
                if attrs is None:
                    attrs = by_prefix[prefix] = {}
                attrs[name] = attrs.get(name, 0) + value
            if execute_seconds:
                out.execute_seconds += value
        return out

    def add(self, other: SpanMetrics) -> SpanMetrics:
        """Sum ``other``'s totals and execute seconds into these"""
        total = self.total
        for name, value in other.total.items():
            total[name] = total.get(name, 0) + value
        self.execute_seconds += other.execute_seconds
        return self


#: Seconds the builder thread waits for spans before it ends (the next spans start
#: it again): no thread of the bridge outlives its work, whether the scheduler's
#: close drained it or not
IDLE_EXIT = 2.0


class SpanBuilder:
    """The bridge's builder thread and its bounded queue. The event loop writes
    ``queued`` and ``dropped``, the thread ``built`` and ``emitted``: each counter
    has one writer. The thread starts with spans handed over (in a forked child too,
    as the SDK's BatchProcessor) and ends when idle."""

    def __init__(self, sink: SpanSink, capacity: int = MAX_QUEUED_SPANS):
        self.sink = sink
        self.capacity = capacity
        #: Spans handed over, and dropped because the queue was full (the loop)
        self.queued = self.dropped = 0
        #: Spans taken off the queue, and of them handed to the SDK (the thread)
        self.built = self.emitted = 0
        self._queue: SimpleQueue[list[tuple[Any, tuple]] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        #: Held to start the thread and, by the thread, to end it idle: no spans
        #: are left on a queue with no thread
        self._lock = threading.Lock()
        #: The thread's own: by open Dask span id, its exported sub-spans' subtree
        #: fine metrics (``otel.spans.totals: subtree``) and, ``by_prefix``, what its
        #: exported TaskGroup spans carried of its own; and the last copy of a
        #: Dask span's metrics it named, with its names (a span's TaskGroups come
        #: together, with one copy)
        self.folded: dict[str, SpanMetrics] = {}
        self._named: tuple[Any, SpanMetrics | None] = (None, None)
        if hasattr(os, "register_at_fork"):
            forked = weakref.WeakMethod(self._forked)
            os.register_at_fork(after_in_child=lambda: (reset := forked()) and reset())

    def _forked(self) -> None:
        """A forked child has no thread; the parent builds what it had queued"""
        self._lock, self._queue, self._thread, self.queued = (threading.Lock(), SimpleQueue(),
                                                              None, self.built)

    def hand_over(self, batch: list[tuple[Any, tuple]]) -> None:
        """Queue a poll's spans, each ``(build, args)``: ``build(self, *args)`` makes
        its ``ReadableSpan``. The loop never waits."""
        if not batch:
            return
        self.queued += len(batch)
        with self._lock:  # once a poll
            self._queue.put(batch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dask_otel-build",
                                                daemon=True)
                self._thread.start()

    def drain(self, timeout: float) -> None:
        """Let the thread build and hand to the SDK all that is queued, then end, waiting
        at most ``timeout`` seconds, in the thread that then flushes (never on the loop)"""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("dask_otel: %d mirrored spans not handed to the SDK within %.3gs; "
                           "they may miss the flush", self.queued - self.built, timeout)

    def named(self, metrics: Mapping[tuple[Hashable, ...], float]) -> SpanMetrics:
        """:class:`SpanMetrics` of the loop's copy of a Dask span's metrics, named
        once for the span and its TaskGroups"""
        last, named = self._named
        if last is not metrics or named is None:
            named = SpanMetrics.of(metrics)
            self._named = (metrics, named)
        return named

    def fold(self, span_id: str, parent_id: str | None, metrics: SpanMetrics) -> SpanMetrics:
        """A Dask span's own fine metrics (``total`` and execute seconds) plus its
        exported sub-spans' (taken), added to its parent's"""
        if (below := self.folded.pop(span_id, None)) is not None:
            metrics.add(below)
        if parent_id is not None:
            self.folded_of(parent_id).add(metrics)
        return metrics

    def folded_of(self, span_id: str) -> SpanMetrics:
        """``folded`` of an open Dask span, made if need be (bounded)"""
        if (folded := self.folded.get(span_id)) is None:
            if len(self.folded) >= MAX_FOLDED:
                del self.folded[next(iter(self.folded))]
            folded = self.folded[span_id] = SpanMetrics()
        return folded

    def _run(self) -> None:
        queue = self._queue
        sink = self.sink
        me = threading.current_thread()
        while True:
            try:
                batch = queue.get(timeout=IDLE_EXIT)
            except Empty:
                batch = None
            # Ends at drain's None or idle; the next hand_over starts a thread
            # if this one was the thread (a drain may have started another)
            if batch is None:
                with self._lock:
                    if not queue.empty():
                        continue
                    if self._thread is me:
                        self._thread = None
                return
            for build, args in batch:
                try:
                    span = build(self, *args)
                    self.emitted += 1  # before: a reader that sees the span sees it counted
                    sink.emit(span)
                except Exception:
                    logger.exception("dask_otel: could not mirror %r; dropped", args[0])
                self.built += 1


def built(builder: SpanBuilder, span: ReadableSpan) -> ReadableSpan:
    """A span the loop had to build itself (a block that ran no task: rare)"""
    return span


def task_counts(states: Mapping[str, int], total: int, nbytes: int, duration: float
                ) -> dict[str, Any]:
    """The attributes every mirrored span has of its tasks: the count of each
    state (those above 0), the total, output bytes and duration"""
    out: dict[str, Any] = {_STATE_NAMES.get(state) or attr.TASKS_PREFIX + attr.snake(state): n
                           for state, n in states.items() if n > 0}
    out.update({attr.TASKS_TOTAL: total, attr.OUTPUT_BYTES: nbytes, attr.DURATION: duration})
    return out


def erred_status(attributes: dict[str, Any], erred: int, error_type: str | None = None
                 ) -> Status | None:
    """Record the erred count (the transitions the mirror saw, or the state
    count) and ``error.type`` in ``attributes`` and return the ERROR status, if
    any task erred"""
    erred = max(erred, attributes.get(attr.TASKS_ERRED, 0))
    if not erred:
        return None
    attributes[attr.TASKS_ERRED] = erred
    attributes[attr.ERROR_TYPE] = error_type or attr.OTHER_ERROR
    if error_type == "KilledWorker":  # say why: no exception of the task's own
        return Status(StatusCode.ERROR, f"{erred} tasks erred: KilledWorker, the workers "
                      f"running them died (see the {attr.WORKER_LOST} span events)")
    return Status(StatusCode.ERROR, f"{erred} tasks erred")


def dask_span(builder: SpanBuilder, record: SpanRecord, head: SpanHead,
              parent: SpanContext | None, parent_id: str | None, end: float, totals: Totals,
              own_metrics: Mapping[tuple[Hashable, ...], float], active: float, subtree: bool,
              code: tuple[str, ...] | None, first_task: float, unfinished: bool = False
              ) -> ReadableSpan:
    """The OTel span of a Dask span's ``record`` (sampled, taken from the ledger:
    no hook writes it any more), from ``head.start`` to ``end``: ``totals``' task
    counts, its ``own_metrics`` (the loop's copy) named, with ``subtree`` totals
    its sub-spans' summed (:meth:`SpanBuilder.fold`) and the thread time no task
    accounts for, ``active`` CPU seconds, its ``code`` (None: not asked), and a
    ``dask.first_task_start`` event at ``first_task`` (0: no task started)"""
    sink = builder.sink
    start = head.start
    attributes = {attr.SPAN_ID: record.span.id, attr.SPAN_NAME: head.tags}
    attributes.update(task_counts(totals.states, sum(totals.states.values()), totals.nbytes,
                                  totals.duration))
    attributes[attr.ACTIVE_CPU_SECONDS] = active
    metrics = SpanMetrics().add(builder.named(own_metrics))
    builder.fold(record.span.id, parent_id if subtree else None, metrics)
    metrics.add(totals.fine)  # sub-spans done before the bridge started
    attributes.update(metrics.total)
    if subtree and (idle := active - metrics.execute_seconds) > 0:
        attributes[attr.IDLE] = idle
    if code is not None:
        attributes[attr.SPAN_CODE] = code
    if unfinished:
        attributes[attr.SPAN_UNFINISHED] = True
    if record.collided:
        attributes[attr.SPAN_COLLIDED] = True
    status = erred_status(attributes, record.erred, record.error_type)
    first_task = first_task and min(max(first_task, start), end)
    events = ((Event(attr.FIRST_TASK_START, NO_ATTRIBUTES, int(first_task * 1e9)),)
              if first_task else ())
    if record.events:  # dask.worker.lost (dask_otel.scheduler.events), bounded there
        count = sink.limits.max_event_attributes
        events += tuple(
            Event(name, sink.event_attributes(dict(values), count), timestamp)
            for name, values, timestamp in record.events
        )
    count = sink.limits.max_link_attributes  # links to other traces: within the SDK's limits
    links = tuple(Link(link.context, sink.event_attributes(dict(link.attributes), count))
                  for link in (record.links or {}).values())
    return sink.span(record.span.name[-1], head.context, parent, start, end, attributes, status,
                     events, links)


def taskgroup_span(builder: SpanBuilder, names: tuple[str, str, str, tuple[str, ...]],
                   batch: GroupBatch, head: SpanHead, context: SpanContext,
                   figures: tuple[dict[str, int], int, float],
                   span_metrics: Mapping[tuple[Hashable, ...], float], open_id: str | None,
                   start: float, end: float) -> ReadableSpan:
    """The OTel span of one ``batch`` of a TaskGroup (``names``: its name, prefix, and
    the id and tags of the span Dask attached it to), with ``context``, a child of
    ``head``'s: its task counts, bytes, duration (``figures``: the group's when
    exported) and fine metrics (its prefix's in ``span_metrics``, the loop's copy of
    that span's), less what earlier batches counted; fine metrics, while that span is
    open (``open_id``), less what any group of the prefix carried: Dask keys them by prefix"""
    sink = builder.sink
    name, prefix, span_id, tags = names
    metrics = builder.named(span_metrics).by_prefix.get(prefix, {})
    carried = (builder.folded_of(open_id).by_prefix.setdefault(prefix, {}) if open_id
               else batch.metrics)
    states, nbytes, duration = figures
    attributes = {attr.SPAN_ID: span_id, attr.SPAN_NAME: tags,
                  attr.TASKGROUP_NAME: name, attr.TASKGROUP_PREFIX: prefix}
    if (base := batch.states) is None:
        attributes.update(task_counts(states, sum(states.values()), nbytes, duration))
    else:
        attributes.update(task_counts(
            {state: n - base.get(state, 0) for state, n in states.items()},
            sum(states.values()) - batch.total, max(nbytes - batch.nbytes, 0),
            max(duration - batch.duration, 0.0),
        ))
    for key, value in metrics.items():
        if (delta := value - carried.get(key, 0)) > 0:
            attributes[key], carried[key] = delta, value
    status = erred_status(attributes, batch.erred, batch.error_type)
    return sink.span(TASKGROUP_SPAN_NAME.format(prefix), context, head.context, start, end,
                     attributes, status)
