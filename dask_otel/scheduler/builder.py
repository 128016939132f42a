"""What the mirror recorded -> finished OpenTelemetry spans: the corridor's last stop
before the SDK. Pure functions of a record, its :class:`SpanHead` and the numbers the
mirror worked out; their only way out is the sink (``tests/test_layout.py``).
What each attribute means: docs/traces.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, Status, StatusCode

import dask_otel.attributes as attr
from dask_otel.export.sink import NO_ATTRIBUTES

if TYPE_CHECKING:
    from distributed.scheduler import TaskGroup
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.record import GroupBatch, SpanHead, SpanRecord

#: A TaskGroup span's name: its task prefix behind a word of its own, so that a trace
#: UI lists TaskGroups apart from Dask spans and tasks (docs/traces.md "Span names")
TASKGROUP_SPAN_NAME = "taskgroup/{}"


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
              end: float, figures: dict[str, Any], first_task: float, unfinished: bool = False
              ) -> ReadableSpan:
    """The OTel span of an open Dask span's ``record`` (sampled), from
    ``head.start`` to ``end``, with its ``figures`` and a ``dask.first_task_start``
    event at ``first_task`` (0: no task started)"""
    start = head.start
    attributes = {attr.SPAN_ID: record.span.id, attr.SPAN_NAME: head.tags, **figures}
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


def taskgroup_span(sink: SpanSink, tg: TaskGroup, batch: GroupBatch, head: SpanHead,
                   context: SpanContext, counts: dict[str, Any], start: float, end: float
                   ) -> ReadableSpan:
    """The OTel span of one ``batch`` of a TaskGroup, with ``context``, a child
    of its Dask span's, with its ``counts`` (``GroupBatch.attributes``)"""
    attributes = {attr.SPAN_ID: batch.span.id, attr.SPAN_NAME: head.tags,
                  attr.TASKGROUP_NAME: str(tg.name), attr.TASKGROUP_PREFIX: str(tg.prefix.name)}
    attributes.update(counts)
    status = erred_status(attributes, batch.erred, batch.error_type)
    name = TASKGROUP_SPAN_NAME.format(tg.prefix.name)
    return sink.span(name, context, head.context, start, end, attributes, status)


def bounded_links(sink: SpanSink, links: Mapping[str, Link] | None) -> tuple[Link, ...]:
    """Links with their attributes within the SDK's link attribute limits"""
    if not links:
        return ()
    count = sink.limits.max_link_attributes
    return tuple(Link(link.context, sink.event_attributes(dict(link.attributes), count))
                 for link in links.values())
