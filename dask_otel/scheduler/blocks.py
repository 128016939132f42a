"""The clients' ``dask_otel.span`` blocks, as the scheduler hears of them: a Dask
span is not finished while its block is open; a client leaving the scheduler
closes its open blocks after :data:`CLIENT_GONE_GRACE`; a block whose Dask span
never came is exported on its own. docs/traces.md, "A dask_otel.span block".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from distributed.metrics import time

import dask_otel.attributes as attr
from dask_otel.annotation import read_block_exit
from dask_otel.span_context import dask_span_context, root_span

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.annotation import Block
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.ledger import Ledger
    from dask_otel.scheduler.record import SpanRecord


#: How long the blocks a client had open when it left wait for their exits before
#: they are closed as of its leaving (their runs ``cancelled``): an exit goes on
#: the rpc, the close on the client's stream, so it can come after (seen: 4 ms).
CLIENT_GONE_GRACE = 1.0


def observe_exit(ledger: Ledger, spans: Mapping[str, Span], msg: Any) -> None:
    """A client left a block: its open spans may finish; the exit of a span not
    seen yet is kept until its graph comes, or exported as an empty block"""
    if (block := read_block_exit(msg)) is None:
        return
    ledger.open_new_spans(spans)
    for span_id in block.ids[-block.own:]:
        if (record := ledger.records.get(span_id)) is not None:
            record.left_block(block.exited, block.client, block.names_workflow(span_id))
            record.labels = block.labels
        elif span_id not in spans and span_id not in ledger.made:
            ledger.pend_exit(span_id, time(), block)


def left_by(record: SpanRecord, client: str) -> bool:
    """Whether ``client`` itself announced it left its block of ``record`` (an
    old client's exit names no sender: it does too), however late it came"""
    return bool(record.exited) and record.exit_client in (client, None)


def observe_client_leaving(ledger: Ledger, client: str, left: float) -> None:
    """A client left the scheduler at ``left``: the blocks it had open wait
    :data:`CLIENT_GONE_GRACE` for their exit, not finished meanwhile"""
    for record in ledger.records.values():
        if record.block_client == client and not left_by(record, client):
            record.client_left = left


def observe_client_gone(ledger: Ledger, client: str) -> None:
    """:data:`CLIENT_GONE_GRACE` after ``client`` left: the blocks it had open and
    did not announce leaving are over, as of when it left; their runs did not
    finish (their roots are ``cancelled``)"""
    for record in ledger.records.values():
        if record.block_client == client and record.client_left:
            if not left_by(record, client):
                record.left_block(record.client_left)
                root = ledger.records.get(root_span(record.span).id)
                if root is not None:
                    root.cancelled = True
            record.client_left = 0.0


def due_empty_blocks(ledger: Ledger, spans: Mapping[str, Span], heard_before: float,
                     sent_before: float) -> Iterator[tuple[str, Block]]:
    """Take the blocks whose exit was heard before ``heard_before`` (if they sent
    graphs, before ``sent_before``: a busy scheduler reads a graph seconds after the
    exit that followed it) and whose Dask span never came: they ran no task"""
    pending = ledger.pending_exits
    for span_id, (heard, block) in list(pending.items()):
        if heard >= heard_before:
            break  # oldest first
        if block.graphs and heard >= sent_before:
            continue  # its graph is on its way: its span comes with it
        del pending[span_id]
        if span_id not in spans:
            yield span_id, block


def empty_block_span(ledger: Ledger, sink: SpanSink, span_id: str, block: Block
                     ) -> ReadableSpan | bool:
    """The OTel span of a block that ran no task, from its entry to its exit, a
    child of its enclosing span or the caller's; False if sampled out"""
    ids, tags, exited = block.ids, block.tags, block.exited
    i = ids.index(span_id)
    root = ids[0]
    caller, forced = ledger.remote_parent(root, block), ledger.forced(root, block)

    def context_of(dask_id: str) -> SpanContext:
        return dask_span_context(root, dask_id, str(tags[0]), caller, sink.sampler,
                                 is_remote=False, forced=forced)

    context = context_of(span_id)
    if not context.trace_flags.sampled:
        return False
    parent = context_of(ids[i - 1]) if i else caller
    start = block.entered.get(span_id) or exited
    if i and (parent_record := ledger.records.get(ids[i - 1])) is not None:
        parent_record.end_no_earlier(exited)  # the enclosing span covers it
        parent_record.child_kept = True  # and a full builder queue keeps it
    # Dask made no span of it: only its ids, tags, entry and exit are known
    attributes = {attr.SPAN_ID: span_id, attr.SPAN_NAME: tuple(tags[: i + 1]), attr.TASKS_TOTAL: 0}
    return sink.span(str(tags[i]), context, parent, start, exited, attributes | block.labels)
