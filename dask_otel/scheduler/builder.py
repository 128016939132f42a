"""Dask objects and what the mirror recorded -> finished OpenTelemetry spans.

Pure functions: they read a Dask ``Span`` or ``TaskGroup``, the numbers the
mirror worked out (:class:`SpanHead`, totals, the end), and return a
``ReadableSpan`` built by the :class:`~dask_otel.export.sink.SpanSink`. They keep
nothing and decide nothing about *when*: that is the mirror's
(:mod:`dask_otel.spans`). What each attribute means: docs/traces.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, SpanContext, Status, StatusCode

from dask_otel.export.sink import NO_ATTRIBUTES
from dask_otel.scheduler.totals import active_cpu_seconds, code_snippets
from dask_otel.span_context import SAMPLED

if TYPE_CHECKING:
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span
    from opentelemetry.sdk.trace import ReadableSpan

    from dask_otel.config import OtelConfig
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.record import GroupBatch
    from dask_otel.scheduler.totals import Totals

logger = logging.getLogger("dask_otel")

#: Thread time of a span that no task accounts for, as Dask's
#: ``Span.cumulative_worker_metrics`` has it
IDLE = "dask.metrics.execute.idle_or_other_spans.seconds"


class SpanHead:
    """What the OTel spans of one Dask span and of its TaskGroups share: worked
    out once per poll, which usually exports a span's groups together"""

    __slots__ = ("context", "start", "tags")

    #: The Dask span's OTel SpanContext (the parent of its TaskGroups' spans);
    #: None if the sampler drops its trace
    context: SpanContext | None
    #: Where its OTel span starts (``Ledger.span_start``)
    start: float
    #: ``Span.name`` as an attribute value
    tags: tuple[str, ...]

    def __init__(self, context: SpanContext | None, start: float, tags: tuple[str, ...]):
        self.context = context
        self.start = start
        self.tags = tags


#: ``error.type`` when Dask kept no exception text (the conventions' fallback)
OTHER_ERROR = "_OTHER"


def error_type(ts: TaskState, allowed_failures: int) -> str:
    """OTel's ``error.type`` for an erred task: the class name of the exception it
    erred with, or that the task it depends on erred with (``exception_blame``);
    ``KilledWorker`` when the workers running it died too often.

    The scheduler holds the exception pickled, with classes it may not have: the
    name is read from ``exception_text``, the worker's ``repr`` of it
    (``ZeroDivisionError('division by zero')``). Dask gives a KilledWorker no text.
    """
    failing = ts.exception_blame or ts
    name = (failing.exception_text or "").partition("(")[0]
    if name.isidentifier():
        return name
    if failing.suspicious > allowed_failures:
        return "KilledWorker"
    return OTHER_ERROR


def erred_status(
    attributes: dict[str, Any], erred: int, error_type: str | None = None
) -> Status | None:
    """Record the erred count and ``error.type`` (the first erred task's, see
    :func:`error_type`) in ``attributes`` and return the ERROR status, if any
    task erred.

    ``erred`` counts the erred transitions the mirror saw; the state count alone
    would miss tasks whose futures the client released before the export.
    """
    erred = max(erred, attributes.get("dask.tasks.erred", 0))
    if not erred:
        return None
    attributes["dask.tasks.erred"] = erred
    attributes["error.type"] = error_type or OTHER_ERROR
    if error_type == "KilledWorker":  # say why: no exception of the task's own
        return Status(
            StatusCode.ERROR,
            f"{erred} tasks erred: KilledWorker, the workers running them died "
            "(see the dask.worker.lost span events)",
        )
    return Status(StatusCode.ERROR, f"{erred} tasks erred")


def dask_span(
    sink: SpanSink,
    config: OtelConfig,
    span: Span,
    head: SpanHead,
    parent: SpanContext | None,
    end: float,
    own: Totals,
    subtree: Totals,
    erred: int,
    links: Mapping[str, Link] | None,
    unfinished: bool = False,
    error_type: str | None = None,
    dask_events: list[Event] | None = None,
) -> ReadableSpan:
    """The OTel span of a Dask span (``head.context`` must be sampled), from
    ``head.start`` to ``end``, with its ``own`` or ``subtree`` totals as
    ``otel.spans.totals`` says"""
    start = head.start
    subtree_totals = config.span_totals == "subtree"
    totals = subtree if subtree_totals else own
    active = active_cpu_seconds(span, end)
    attributes = {"dask.span.id": span.id, "dask.span.name": head.tags}
    attributes.update(totals.attributes())
    attributes["dask.active_cpu_seconds"] = active
    attributes.update(totals.metrics)
    if subtree_totals and (idle := active - totals.execute_seconds) > 0:
        attributes[IDLE] = idle
    if config.export_code:
        attributes["dask.span.code"] = code_snippets(span)
    if unfinished:
        attributes["dask.span.unfinished"] = True
    status = erred_status(attributes, erred, error_type)
    first_task = subtree.start and min(max(subtree.start, start), end)
    events = (
        (Event("dask.first_task_start", NO_ATTRIBUTES, int(first_task * 1e9)),)
        if first_task
        else ()
    )
    if dask_events:  # dask.worker.lost (dask_otel.scheduler.events), bounded there
        count = sink.limits.max_event_attributes
        events += tuple(
            Event(e.name, sink.event_attributes(dict(e.attributes), count), e.timestamp)
            for e in dask_events
        )
    return sink.span(
        span.name[-1], head.context, parent, start, end, attributes, status, events,
        bounded_links(sink, links),
    )


def empty_block_span(
    sink: SpanSink,
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    dask_id: str,
    tags: tuple[str, ...],
    start: float,
    end: float,
) -> ReadableSpan:
    """The OTel span of a ``dask_otel.span`` block that ran no task: Dask made no
    span of it, so only its ids, tags and the client's entry and exit are known"""
    attributes = {"dask.span.id": dask_id, "dask.span.name": tags, "dask.tasks.total": 0}
    return sink.span(name, context, parent, start, end, attributes)


def taskgroup_span(
    sink: SpanSink,
    tg: TaskGroup,
    batch: GroupBatch,
    head: SpanHead,
    counts: dict[str, Any],
    start: float,
    end: float,
    span_id: int,
) -> ReadableSpan:
    """The OTel span of one batch of a TaskGroup, a child of its Dask span's
    (``head.context``, sampled), with id ``span_id``: ``counts`` are the batch's
    task counts, bytes, duration and fine metrics (``GroupBatch.attributes``)"""
    parent = head.context
    assert parent is not None
    attributes = {
        "dask.span.id": batch.span.id,
        "dask.span.name": head.tags,
        "dask.taskgroup.name": str(tg.name),
        "dask.taskgroup.prefix": str(tg.prefix.name),
    }
    attributes.update(counts)
    status = erred_status(attributes, batch.erred, batch.error_type)
    context = SpanContext(parent.trace_id, span_id, False, SAMPLED, parent.trace_state)
    return sink.span(str(tg.prefix.name), context, parent, start, end, attributes, status)


def told_no_code(span: ReadableSpan) -> bool:
    """With ``otel.spans.code``: log one WARNING, and return True, if a Dask span
    has no code. The client sends code with each graph only if its
    ``distributed.diagnostics.computations.nframes`` is above 0 (Dask's default is
    0), a key read in the client's process, not here."""
    if not span.attributes or span.attributes.get("dask.span.code"):
        return False
    logger.warning(
        "dask_otel: otel.spans.code is true but Dask span %r has no code: "
        "Dask records it only when distributed.diagnostics.computations.nframes "
        "is above 0 (default 0) in the client that computes; set it there, "
        "e.g. DASK_DISTRIBUTED__DIAGNOSTICS__COMPUTATIONS__NFRAMES=1",
        span.name,
    )
    return True


def bounded_links(sink: SpanSink, links: Mapping[str, Link] | None) -> tuple[Link, ...]:
    """Links with their attributes within the SDK's link attribute limits"""
    if not links:
        return ()
    count = sink.limits.max_link_attributes
    return tuple(
        Link(link.context, sink.event_attributes(dict(link.attributes), count))
        for link in links.values()
    )
