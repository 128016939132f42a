"""What the mirror read on the event loop -> finished OpenTelemetry spans, on the
bridge's own thread: the corridor's last stop before the SDK. The loop reads Dask's
live state into plain numbers and hands each poll's spans over at once
(:meth:`SpanBuilder.hand_over`, a bounded queue: a full one drops and counts); the
builder thread makes their attributes, events, links, status and ``ReadableSpan``
and hands them to the sink. Its only way out is the sink (``tests/test_layout.py``).
What each attribute means: docs/traces.md; what it costs: benchmarks/README.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from queue import SimpleQueue
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
    from dask_otel.scheduler.record import GroupBatch, SpanHead, SpanRecord
    from dask_otel.scheduler.totals import Totals

logger = logging.getLogger("dask_otel")

#: A TaskGroup span's name: its task prefix behind a word of its own, so that a trace
#: UI lists TaskGroups apart from Dask spans and tasks (docs/traces.md "Span names")
TASKGROUP_SPAN_NAME = "taskgroup/{}"
#: Spans handed over and not yet built: past it a poll's spans are dropped and
#: counted (the SDK's batch span processor queues as many by default)
MAX_QUEUED_SPANS = 2048
#: ``dask.tasks.<state>`` by state: built once, not per span
_STATE_NAMES = {state: attr.TASKS_PREFIX + state for state in ALL_TASK_STATES}


class SpanBuilder:
    """The bridge's builder thread and its bounded queue. The event loop writes
    ``queued`` and ``dropped``, the thread ``built`` and ``emitted``: each counter
    has one writer. The thread starts with the first spans handed over."""

    def __init__(self, sink: SpanSink, capacity: int = MAX_QUEUED_SPANS):
        self.sink = sink
        self.capacity = capacity
        #: Spans handed over, and dropped because the queue was full (the loop)
        self.queued = self.dropped = 0
        #: Spans taken off the queue, and of them handed to the SDK (the thread)
        self.built = self.emitted = 0
        self._queue: SimpleQueue[list[tuple[Any, tuple]] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def hand_over(self, batch: list[tuple[Any, tuple]]) -> None:
        """Queue a poll's spans, each ``(build, args)``: ``build(sink, *args)`` makes
        its ``ReadableSpan``. What does not fit is dropped and counted: the loop
        never waits."""
        if not batch:
            return
        room = self.capacity - (self.queued - self.built)
        if len(batch) > room:
            self.dropped += len(batch) - max(room, 0)
            if room <= 0:
                return
            batch = batch[:room]
        self.queued += len(batch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dask_otel-build", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def drain(self, timeout: float) -> None:
        """Let the thread build and hand to the SDK all that is queued, then end,
        waiting at most ``timeout`` seconds: before the SDK's providers flush"""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("dask_otel: %d mirrored spans not handed to the SDK within %.3gs; "
                           "they may miss the flush", self.queued - self.built, timeout)

    def _run(self) -> None:
        sink, queue = self.sink, self._queue
        while (batch := queue.get()) is not None:
            for build, args in batch:
                try:
                    span = build(sink, *args)
                    self.emitted += 1  # before: a reader that sees the span sees it counted
                    sink.emit(span)
                except Exception:
                    logger.exception("dask_otel: could not mirror %r; dropped", args[0])
                self.built += 1


def built(sink: SpanSink, span: ReadableSpan) -> ReadableSpan:
    """A span the loop had to build itself (a block that ran no task: rare)"""
    return span


def task_counts(states: Mapping[str, int], total: int, nbytes: int, duration: float
                ) -> dict[str, Any]:
    """The attributes every mirrored span has of its tasks: the count of each
    state (those above 0), the total, output bytes and duration"""
    names = _STATE_NAMES
    out: dict[str, Any] = {}
    for state, n in states.items():
        if n > 0:
            name = names.get(state)
            out[attr.TASKS_PREFIX + state if name is None else name] = n
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


def dask_span(sink: SpanSink, record: SpanRecord, head: SpanHead, parent: SpanContext | None,
              end: float, totals: Totals, active: float, subtree: bool,
              code: tuple[str, ...] | None, first_task: float, unfinished: bool = False
              ) -> ReadableSpan:
    """The OTel span of a Dask span's ``record`` (sampled, taken from the ledger:
    no hook writes it any more), from ``head.start`` to ``end``: ``totals``' task
    counts and fine metrics, ``active`` CPU seconds, with ``subtree`` totals the
    thread time no task accounts for, its ``code`` (None: not asked), and a
    ``dask.first_task_start`` event at ``first_task`` (0: no task started)"""
    start = head.start
    attributes = {attr.SPAN_ID: record.span.id, attr.SPAN_NAME: head.tags}
    attributes.update(task_counts(totals.states, sum(totals.states.values()), totals.nbytes,
                                  totals.duration))
    attributes[attr.ACTIVE_CPU_SECONDS] = active
    attributes.update(totals.metrics)
    if subtree and (idle := active - totals.execute_seconds) > 0:
        attributes[attr.IDLE] = idle
    if code is not None:
        attributes[attr.SPAN_CODE] = code
    if unfinished:
        attributes[attr.SPAN_UNFINISHED] = True
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
    return sink.span(
        record.span.name[-1], head.context, parent, start, end, attributes, status, events,
        bounded_links(sink, record.links),
    )


def taskgroup_span(sink: SpanSink, names: tuple[str, str], batch: GroupBatch, head: SpanHead,
                   context: SpanContext, figures: tuple[dict[str, int], int, float],
                   metrics: Mapping[str, float], start: float, end: float) -> ReadableSpan:
    """The OTel span of one ``batch`` of a TaskGroup (``names``: its name and task
    prefix; taken from the ledger), with ``context``, a child of its Dask span's:
    its task counts, bytes, duration (``figures``: the group's states, bytes and
    duration when exported) and fine ``metrics`` (its prefix's within its Dask span
    then), less what an earlier batch counted"""
    name, prefix = names
    states, nbytes, duration = figures
    attributes = {attr.SPAN_ID: batch.span.id, attr.SPAN_NAME: head.tags,
                  attr.TASKGROUP_NAME: name, attr.TASKGROUP_PREFIX: prefix}
    if (base := batch.states) is None:
        attributes.update(task_counts(states, sum(states.values()), nbytes, duration))
        attributes.update(metrics)
    else:
        attributes.update(task_counts(
            {state: n - base.get(state, 0) for state, n in states.items()},
            sum(states.values()) - batch.total, max(nbytes - batch.nbytes, 0),
            max(duration - batch.duration, 0.0),
        ))
        for key, value in metrics.items():
            if (delta := value - batch.metrics.get(key, 0)) > 0:
                attributes[key] = delta
    status = erred_status(attributes, batch.erred, batch.error_type)
    return sink.span(TASKGROUP_SPAN_NAME.format(prefix), context, head.context, start, end,
                     attributes, status)


def bounded_links(sink: SpanSink, links: Mapping[str, Link] | None) -> tuple[Link, ...]:
    """Links with their attributes within the SDK's link attribute limits"""
    if not links:
        return ()
    count = sink.limits.max_link_attributes
    return tuple(Link(link.context, sink.event_attributes(dict(link.attributes), count))
                 for link in links.values())
