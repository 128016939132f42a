"""The clients' ``dask_otel.span`` blocks, as the scheduler hears of them.

A client announces when it leaves a block (one ``BLOCK_EXIT`` event per block,
:mod:`dask_otel.client`). The scheduler learns of a block's Dask span only through
its graphs, so an exit can come first, or alone (a block that ran no task). What is
pending lives in the :class:`~dask_otel.scheduler.ledger.Ledger`; these functions
are the rules, called by :class:`~dask_otel.spans.SpanMirror`:

- a Dask span ends no earlier than its block's exit, and is not final while its
  block is open (:meth:`SpanRecord.finished_at`);
- a client that leaves the scheduler closes the blocks it had open, as of when it
  left, once :data:`CLIENT_GONE_GRACE` has passed with no exit for them;
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
    exit_sender,
    forced_sampling,
    read_block_exit,
    remote_parent,
    root_carrier,
    workflow_named,
)
from dask_otel.scheduler import builder
from dask_otel.span_context import dask_span_context, root_span

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.annotation import BlockExit
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.ledger import Ledger
    from dask_otel.scheduler.record import SpanRecord


#: How long the blocks a client had open when it left wait for their exits before
#: they are closed as of its leaving (and their runs counted ``cancelled``). A
#: client sends its exits on the scheduler's rpc, which may open a connection, and
#: its close on its own stream: the exit of a block left just before the client
#: closed can come after the close (seen: 4 ms after, on a loaded machine).
CLIENT_GONE_GRACE = 1.0


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
    ids, _, own, otel, exited = block
    sender = exit_sender(msg)
    for span_id in ids[-own:]:
        record = ledger.records.get(span_id)
        if record is not None:
            record.left_block(exited, sender, names_workflow(block, span_id))
        elif span_id not in spans:
            ledger.pend_exit(span_id, now, block)


def names_workflow(block: BlockExit, span_id: str) -> bool:
    """Whether ``block`` opened root ``span_id`` with ``workflow=True``"""
    return block[0][0] == span_id and workflow_named(block[3])


def left_by(record: SpanRecord, client: str) -> bool:
    """Whether ``client`` itself announced it left its block of ``record``: it
    sent that exit before it closed, however late the exit came. An exit sent by
    another client does not tell; an old client's, which names no sender, does."""
    return bool(record.exited) and record.exit_client in (client, None)


def observe_client_leaving(ledger: Ledger, client: str, left: float) -> None:
    """A client left the scheduler at ``left``: the blocks it had open wait
    :data:`CLIENT_GONE_GRACE` for their exit (:func:`observe_client_gone`), not
    finished meanwhile. Walks the open spans: once per client."""
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
