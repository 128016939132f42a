"""What the mirror read on the event loop -> finished OpenTelemetry spans, on the
bridge's own thread: two frozen readings (:class:`SpanReading` of a Dask span,
:class:`GroupReading` of a TaskGroup batch; typed NamedTuples, read by name: a frozen
dataclass costs the loop 4 us more per span) handed over whole, a poll at a time
(:meth:`SpanBuilder.hand_over`, a bounded queue: the mirror drops and counts past
it). The thread keeps the one subtree ledger (:attr:`SpanBuilder.folded`) and counts
with :mod:`dask_otel.scheduler.totals`; its only way out is the sink.
docs/traces.md; costs: benchmarks/README.md.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Mapping
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Link

import dask_otel.attributes as attr
from dask_otel.export.sink import NO_ATTRIBUTES
from dask_otel.log import logger
from dask_otel.scheduler.totals import SpanMetrics, Totals, erred_status, task_counts

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.record import GroupBatch, SpanHead, SpanRecord

#: A TaskGroup span's name: its task prefix behind a word of its own, so that a trace
#: UI lists TaskGroups apart from Dask spans and tasks (docs/traces.md "Span names")
TASKGROUP_SPAN_NAME = "taskgroup/{}"
#: Spans handed over and not yet built: past it spans are dropped, children first, and
#: counted (:meth:`SpanBuilder.admit`; the SDK's batch span processor queues as many)
MAX_QUEUED_SPANS = 2048
#: Open Dask spans whose sub-spans' totals the builder thread sums, at most (a
#: span whose own build failed leaves its sum behind)
MAX_FOLDED = 1 << 16

#: A Dask span's own fine metrics, as the loop copied them (``Span._cumulative_worker_metrics``)
FineMetrics = Mapping[tuple[Hashable, ...], float]


class SpanReading(NamedTuple):
    """What a Dask span's OTel span needs, read on the loop: its ``record``, taken
    from the ledger (no hook writes it any more), from ``head.start`` to ``end``"""

    record: SpanRecord
    head: SpanHead
    #: Its parent's OTel SpanContext (or the caller's); its parent's Dask span id while
    #: that is open (its subtree sums go there)
    parent: SpanContext | None
    parent_id: str | None
    end: float
    #: Its own TaskGroups' totals and fine metrics: the builder folds its subtree's
    own: Totals
    metrics: FineMetrics
    active: float
    #: ``otel.spans.totals: subtree``
    subtree: bool
    #: Its code (None: not asked); exported open, as the scheduler closed
    code: tuple[str, ...] | None
    unfinished: bool
    #: False: a full queue dropped it (counted); only summed into its parent's subtree
    kept: bool = True


class GroupReading(NamedTuple):
    """What the OTel span of one ``batch`` of a TaskGroup needs, read on the loop:
    ``context``, a child of ``head``'s, from ``start`` to ``end``"""

    #: The group's name and prefix, and the id and tags of the Dask span Dask
    #: attached it to, whose fine metrics (the loop's copy) hold its prefix's
    name: str
    prefix: str
    span_id: str
    tags: tuple[str, ...]
    batch: GroupBatch
    head: SpanHead
    context: SpanContext
    #: The group's states, output bytes and duration when read (``GroupBatch.figures``)
    states: dict[str, int]
    nbytes: int
    duration: float
    metrics: FineMetrics
    #: That Dask span's id while it is open: what the prefix carried is in its ledger
    open_id: str | None
    start: float
    end: float


#: What a poll hands over: readings, and the span of a block that ran no task
#: (built on the loop, from the block's exit alone: rare)
Handed = SpanReading | GroupReading | ReadableSpan


#: Seconds the builder thread waits for spans before it ends (the next spans start
#: it again): no thread of the bridge outlives its work, whether the scheduler's
#: close drained it or not
IDLE_EXIT = 2.0


class SpanBuilder:
    """The bridge's builder thread and its bounded queue. The event loop writes
    ``queued`` and ``dropped``, the thread ``built`` and ``emitted``: each counter
    has one writer. As the SDK's BatchProcessor, the thread is reset in a forked
    child and joined off the loop (:meth:`drain`); it starts with spans handed
    over and ends when idle."""

    def __init__(self, sink: SpanSink, folded: dict[str, Totals] | None = None):
        self.sink, self.capacity = sink, MAX_QUEUED_SPANS
        #: Spans handed over, and dropped because the queue was full (the loop)
        self.queued = self.dropped = 0
        #: Spans taken off the queue, and of them handed to the SDK (the thread)
        self.built = self.emitted = 0
        self._queue: SimpleQueue[list[Handed] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        #: Held to start the thread and, by the thread, to end it idle: no spans
        #: are left on a queue with no thread
        self._lock = threading.Lock()
        #: The one subtree ledger, the thread's own (seeded before it starts with
        #: the sub-spans that finished before the bridge did): by open Dask span
        #: id, its built sub-spans' subtree totals, and in ``fine.by_prefix``
        #: what its TaskGroup spans carried of its own
        self.folded: dict[str, Totals] = folded or {}
        #: The last copy of a Dask span's metrics it named, with its names (a
        #: span's TaskGroups come together, with one copy)
        self._named: tuple[FineMetrics | None, SpanMetrics] = (None, SpanMetrics())
        if hasattr(os, "register_at_fork"):
            forked = weakref.WeakMethod(self._forked)
            os.register_at_fork(after_in_child=lambda: (reset := forked()) and reset())

    def _forked(self) -> None:
        """A forked child has no thread; the parent builds what it had queued"""
        self._lock, self._queue, self._thread, self.queued = (threading.Lock(), SimpleQueue(),
                                                              None, self.built)

    def hand_over(self, batch: list[Handed]) -> None:
        """Queue a poll's readings (and spans built on the loop). The loop never waits."""
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

    def admit(self, child_kept: bool, waiting: int, parent: SpanRecord | None) -> bool:
        """On the loop: whether the queue takes one more span of a poll holding
        ``waiting``, else it is dropped and counted. Past capacity, only the parent of
        a span kept (a poll hands children over first; its ``parent`` record is told):
        a full queue never orphans what it keeps"""
        if not child_kept and self.queued - self.built + waiting >= self.capacity:
            self.dropped += 1
            return False
        if parent is not None:
            parent.child_kept = True
        return True

    def named(self, metrics: FineMetrics) -> SpanMetrics:
        """:class:`SpanMetrics` of the loop's copy of a Dask span's metrics, named
        once for the span and its TaskGroups"""
        last, named = self._named
        if last is not metrics:
            named = SpanMetrics.of(metrics)
            self._named = (metrics, named)
        return named

    def folded_of(self, span_id: str) -> Totals:
        """The subtree ledger's entry of an open Dask span, made if need be (bounded)"""
        if (folded := self.folded.get(span_id)) is None:
            if len(self.folded) >= MAX_FOLDED:
                del self.folded[next(iter(self.folded))]
            folded = self.folded[span_id] = Totals()
        return folded

    def _run(self) -> None:
        queue, sink, me = self._queue, self.sink, threading.current_thread()
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
            for item in batch:
                try:
                    span = (self.dask_span(item) if isinstance(item, SpanReading) else
                            self.taskgroup_span(item) if isinstance(item, GroupReading) else item)
                    if span is not None:
                        self.emitted += 1  # before: a reader that sees the span sees it counted
                        sink.emit(span)
                except Exception:
                    logger.exception("dask_otel: could not mirror %r; dropped", item)
                self.built += 1

    def dask_span(self, reading: SpanReading) -> ReadableSpan | None:
        """The OTel span of a Dask span: its own totals (its fine metrics named) or,
        ``subtree``, those plus its sub-spans' (folded here, then into its parent's),
        the thread time no task accounts for, its ``code``, and a
        ``dask.first_task_start`` event at its subtree's first task (None: not kept)"""
        sink, record, head, own = self.sink, reading.record, reading.head, reading.own
        own.fine.add(self.named(reading.metrics))
        subtree = self.folded.pop(record.span.id, None) or Totals()
        subtree.add(own)
        if reading.parent_id is not None:
            self.folded_of(reading.parent_id).add(subtree)
        if not reading.kept:
            return None
        start, end, active = head.start, reading.end, reading.active
        totals = subtree if reading.subtree else own
        attributes = {attr.SPAN_ID: record.span.id, attr.SPAN_NAME: head.tags,
                      **task_counts(totals.states, sum(totals.states.values()), totals.nbytes,
                                    totals.duration),
                      attr.ACTIVE_CPU_SECONDS: active, **totals.fine.total}
        if reading.subtree and (idle := active - totals.fine.execute_seconds) > 0:
            attributes[attr.IDLE] = idle
        if (code := reading.code) is not None:
            attributes[attr.SPAN_CODE] = code
        if reading.unfinished:
            attributes[attr.SPAN_UNFINISHED] = True
        if record.collided:
            attributes[attr.SPAN_COLLIDED] = True
        if record.kept:
            attributes[attr.TRACE_KEPT] = record.kept
        attributes.update(record.labels or ())
        status = erred_status(attributes, record.erred, record.error_type)
        first_task = subtree.start and min(max(subtree.start, start), end)
        events = ((Event(attr.FIRST_TASK_START, NO_ATTRIBUTES, int(first_task * 1e9)),)
                  if first_task else ())
        events += span_events(sink, record.events or (), start, end)  # bounded in the record
        count = sink.limits.max_link_attributes  # links to other traces: within the SDK's limits
        links = tuple(Link(link.context, sink.event_attributes(dict(link.attributes), count))
                      for link in (record.links or {}).values())
        return sink.span(record.span.name[-1], head.context, reading.parent, start, end,
                         attributes, status, events, links)

    def taskgroup_span(self, reading: GroupReading) -> ReadableSpan:
        """The OTel span of one batch of a TaskGroup: its task counts, bytes,
        duration and fine metrics (its prefix's), less what earlier batches
        counted; fine metrics, while its Dask span is open (``open_id``), less what
        any group of the prefix carried: Dask keys them by prefix"""
        sink, batch, prefix, head = self.sink, reading.batch, reading.prefix, reading.head
        metrics = self.named(reading.metrics).by_prefix.get(prefix, {})
        carried = (self.folded_of(reading.open_id).fine.by_prefix.setdefault(prefix, {})
                   if reading.open_id else batch.metrics)
        states, nbytes, duration = reading.states, reading.nbytes, reading.duration
        attributes = {attr.SPAN_ID: reading.span_id, attr.SPAN_NAME: reading.tags,
                      attr.TASKGROUP_NAME: reading.name, attr.TASKGROUP_PREFIX: prefix}
        base = batch.states or {}  # a first batch's snapshot is all 0
        attributes.update(task_counts(
            {state: n - base.get(state, 0) for state, n in states.items()},
            sum(states.values()) - batch.total, max(nbytes - batch.nbytes, 0),
            max(duration - batch.duration, 0.0)))
        for key, value in metrics.items():
            if (delta := value - carried.get(key, 0)) > 0:
                attributes[key], carried[key] = delta, value
        attributes.update(head.labels or ())
        status = erred_status(attributes, batch.erred, batch.error_type)
        start, end, context = reading.start, reading.end, reading.context
        return sink.span(TASKGROUP_SPAN_NAME.format(prefix), context, head.context, start, end,
                         attributes, status, span_events(sink, batch.events, start, end))


def span_events(sink: SpanSink, events: Iterable[tuple[str, dict[str, Any], int]], start: float,
                end: float) -> tuple[Event, ...]:
    """A record's span events (``dask.worker.lost``, ``exception``), within its span's times"""
    count, first, last = sink.limits.max_event_attributes, int(start * 1e9), int(end * 1e9)
    return tuple(Event(name, sink.event_attributes(dict(values), count), min(max(t, first), last))
                 for name, values, t in events)
