"""Span links across workflows: the OTel span of a Dask span whose tasks consume data
another trace produced links to each producing Dask span's (at most :data:`MAX_LINKS`, found
in ``update_graph`` from one task of each new TaskGroup). docs/traces.md, "Links".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.trace import Link

import dask_otel.attributes as attr
from dask_otel.annotation import forced_sampling, otel_of, remote_parent, root_carrier
from dask_otel.span_context import dask_span_context, root_span

if TYPE_CHECKING:
    from distributed.scheduler import TaskState
    from distributed.spans import Span
    from opentelemetry.sdk.trace.sampling import Sampler

#: Links kept per Dask span, at most
MAX_LINKS = 16


def producer_links(ts: TaskState, root: Span, spans: dict[str, Span], links: dict[str, Link],
                   sampler: Sampler) -> None:
    """Add to ``links`` a link to each Dask span in another trace than ``root``'s that
    produced an input of task ``ts``, with the context the mirror exports it with"""
    for dep in ts.dependencies:
        if len(links) >= MAX_LINKS:
            return
        span_id = dep.group.span_id
        if span_id is None or span_id in links or (producer := spans.get(span_id)) is None:
            continue
        if (producer_root := root_span(producer)) is root:
            continue
        otel, root_id = otel_of(dep.annotations), producer_root.id
        context = dask_span_context(root_id, producer.id, str(producer_root.name[0]),
                                    remote_parent(root_carrier(otel, root_id)), sampler,
                                    is_remote=False, forced=forced_sampling(otel, root_id))
        links[span_id] = Link(context, {attr.SPAN_ID: producer.id,
                                        attr.SPAN_NAME: tuple(producer.name)})
