"""The clients' ``dask_otel.span`` blocks, as the scheduler hears of them.

A client announces when it leaves a block (one ``BLOCK_EXIT`` event per block,
:mod:`dask_otel.client`). The scheduler learns of a block's Dask span only through
its graphs, so an exit can come first, or alone (a block that ran no task). What is
pending lives in the :class:`~dask_otel.scheduler.ledger.Ledger`; these functions
are the rules, called by :class:`~dask_otel.spans.SpanMirror`:

- a Dask span ends no earlier than its block's exit, and is not final while its
  block is open (:meth:`SpanRecord.finished_at`);
- a client that leaves the scheduler closes the blocks it had open;
- a block whose Dask span never came is exported on its own, from entry to exit,
  once its exit is ``otel.spans.export-delay`` old: its client-side children then
  have their parent (docs/traces.md, "A dask_otel.span block").

Cost: per exit heard, a lookup per Dask span it closes; per client gone, one walk
of the open spans; pending exits are bounded (``MAX_PENDING_EXITS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dask_otel.annotation import (
    entered_at,
    forced_sampling,
    read_block_exit,
    remote_parent,
    root_carrier,
)
from dask_otel.scheduler import builder
from dask_otel.span_context import dask_span_context

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.annotation import BlockExit
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.ledger import Ledger


def caller_of(otel: Any, root_id: str) -> SpanContext | None:
    """The caller's span a root continues, from a block's ``otel`` annotation"""
    return remote_parent(root_carrier(otel, root_id))


def observe_exit(ledger: Ledger, spans: Mapping[str, Span], msg: Any, now: float) -> None:
    """A client left a block: its open spans may finish; the exit of a span the
    scheduler has not seen is kept until its graph comes, or until it is exported
    as an empty block (:func:`due_empty_blocks`)"""
    block = read_block_exit(msg)
    if block is None:
        return
    ids, _, own, _, exited = block
    for span_id in ids[-own:]:
        record = ledger.records.get(span_id)
        if record is not None:
            record.left_block(exited)
        elif span_id not in spans:
            ledger.pend_exit(span_id, now, block)


def observe_client_gone(ledger: Ledger, client: str, now: float) -> None:
    """A client left the scheduler: the blocks it had open are over (it will
    announce no exit). Walks the open spans: once per client."""
    for record in ledger.records.values():
        if record.block_client == client and not record.exited:
            record.left_block(now)


def due_empty_blocks(
    ledger: Ledger, spans: Mapping[str, Span], heard_before: float
) -> list[tuple[str, BlockExit]]:
    """Take the blocks whose exit was heard before ``heard_before`` and whose Dask
    span never reached the scheduler: they ran no task"""
    pending = ledger.pending_exits
    due = []
    for span_id, (heard, block) in list(pending.items()):
        if heard >= heard_before:
            break  # oldest first
        del pending[span_id]
        if span_id not in spans:
            due.append((span_id, block))
    return due


def empty_block_span(
    ledger: Ledger, sink: SpanSink, span_id: str, block: BlockExit
) -> ReadableSpan | bool:
    """The OTel span of a block that ran no task, from its entry to its exit, with
    its tags, a child of its enclosing Dask span or of the caller's span; False if
    the sampler drops its trace"""
    ids, tags, _, otel, exited = block
    i = ids.index(span_id)
    root = ids[0]
    caller = (
        ledger.remote_parent(root) if root in ledger.records else None
    ) or caller_of(otel, root)
    forced = ledger.forced(root)
    if forced is None:
        forced = forced_sampling(otel, root)
    context = dask_span_context(
        root, span_id, str(tags[0]), caller, sink.sampler, is_remote=False, forced=forced
    )
    if not context.trace_flags.sampled:
        return False
    parent = (
        dask_span_context(
            root, ids[i - 1], str(tags[0]), caller, sink.sampler, is_remote=False,
            forced=forced,
        )
        if i else caller
    )
    start = entered_at(otel, span_id) or exited
    if i and (parent_record := ledger.records.get(ids[i - 1])) is not None:
        parent_record.end_no_earlier(exited)  # the enclosing span covers it
    return builder.empty_block_span(
        sink, str(tags[i]), context, parent, span_id, tuple(tags[: i + 1]), start, exited
    )
