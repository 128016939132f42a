"""Span links across workflows: where a Dask span's inputs came from.

When the tasks of a Dask span consume data that another workflow produced (a
collection persisted under another root span and reused, a future from another
``with span()`` block), the OTel span of the consuming Dask span carries a
`span link <https://opentelemetry.io/docs/concepts/signals/traces/#span-links>`_
to the OTel span of each producing Dask span, so that a trace view can jump from
a workflow to the one that made its inputs. Producers in the same trace are not
linked: the trace already shows them.

Found on the scheduler in ``update_graph``, from the dependencies of one task of
each TaskGroup the graph adds (the tasks of a group usually share their upstream
groups; inputs that only other tasks of the group read are not seen), and kept
for the consuming span until it is exported: at most :data:`MAX_LINKS` per Dask
span, the first found. Each link's context is the producer's span context as the
mirror exports it (its trace: its root's UUID, or the caller's trace its root
continued), with the attributes ``dask.span.id`` and ``dask.span.name`` of the
producing Dask span. Cost: a lookup per dependency of the one task looked at.
How links show: docs/traces.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Link, SpanContext

import dask_otel.attributes as attr
from dask_otel.annotation import forced_sampling, otel_of, remote_parent, root_carrier
from dask_otel.span_context import dask_span_context, root_span

if TYPE_CHECKING:
    from distributed.scheduler import TaskState
    from distributed.spans import Span, SpansSchedulerExtension
    from opentelemetry.sdk.trace.sampling import Sampler

#: Links kept per Dask span, at most
MAX_LINKS = 16


def producer_links(
    ts: TaskState,
    root: Span,
    ext: SpansSchedulerExtension,
    links: dict[str, Link],
    sampler: Sampler,
) -> None:
    """Add to ``links`` (by producer Dask span id) a link to each Dask span, in
    another trace than ``root``'s, that produced an input of task ``ts``"""
    for dep in ts.dependencies:
        if len(links) >= MAX_LINKS:
            return
        span_id = dep.group.span_id
        if span_id is None or span_id in links:
            continue
        producer = ext.spans.get(span_id)
        if producer is None:
            continue
        producer_root = root_span(producer)
        if producer_root is root:
            continue
        links[span_id] = Link(
            producer_context(producer, producer_root, dep.annotations, sampler),
            {attr.SPAN_ID: producer.id, attr.SPAN_NAME: tuple(producer.name)},
        )


def producer_context(
    producer: Span, root: Span, annotations: Mapping[str, Any] | None, sampler: Sampler
) -> SpanContext:
    """The OTel span context of Dask span ``producer`` as the mirror exports it"""
    otel = otel_of(annotations)
    parent = remote_parent(root_carrier(otel, root.id))
    return dask_span_context(
        root.id, producer.id, str(root.name[0]), parent, sampler, is_remote=False,
        forced=forced_sampling(otel, root.id),
    )
