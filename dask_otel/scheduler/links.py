"""Span links across workflows: the OTel span of a Dask span whose tasks consume
data another trace produced links to each producing Dask span's (at most
:data:`MAX_LINKS`, found in ``update_graph`` from one task of each new TaskGroup).
docs/traces.md, "Links".
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
    """Add to ``links`` a link to each Dask span in another trace than ``root``'s
    that produced an input of task ``ts``"""
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
