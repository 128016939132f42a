"""The ledger of what is open: the Dask spans and TaskGroup batches the mirror has
seen and not yet exported, and which of them may be ready (:attr:`Ledger.leaves`);
what the hooks learn of them (a block's controls, a failure, the spans Dask made none
of) and the one sampling decision of a Dask span (:meth:`Ledger.context`). Nothing is
kept about what was exported but bounded tables of roots' callers, forced sampling,
made spans and block exits. docs/traces.md, "When a span is exported".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from distributed.metrics import time
from opentelemetry.trace import Link

from dask_otel._compat import detached_span
from dask_otel.attributes import EXCEPTION_EVENT, SPAN_ID, SPAN_NAME
from dask_otel.scheduler.links import producer_links
from dask_otel.scheduler.record import MAX_FAILURE_EVENTS, GroupBatch, SpanRecord
from dask_otel.scheduler.totals import Totals, group_done, observed
from dask_otel.span_context import dask_span_context, root_span

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import SpanContext

    from dask_otel.annotation import Block
    from dask_otel.scheduler.totals import Failure

#: Roots remembered with their caller's span after their export, for work that
#: comes under them later (each a few hundred bytes)
MAX_REOPENED_ROOTS = 1024
#: Block exits kept for Dask spans the scheduler has not seen (yet): a block that
#: ran no task, or whose graph is still on its way (each a few hundred bytes)
MAX_PENDING_EXITS = 1024
#: Roots whose client forced their sampling (``dask_otel.span(sampled=...)``),
#: remembered open or exported (a few dozen bytes each)
MAX_FORCED_ROOTS = 4096
#: Spans of blocks Dask made none of, made by the mirror, remembered open or
#: exported until Dask makes them (a few hundred bytes each)
MAX_MADE_SPANS = 1024


@dataclass  # one per mirror: vars() lists its tables (tests/test_client.py)
class Ledger:
    """Open Dask spans, open TaskGroup batches, and the open spans with nothing
    open below them. It writes only its own counts into a record; what a hook
    learns goes through the record's methods."""

    #: Open Dask spans, by id, in the order they were seen (parents first)
    records: dict[str, SpanRecord] = field(default_factory=dict)
    #: Open TaskGroup batches
    groups: dict[TaskGroup, GroupBatch] = field(default_factory=dict)
    #: The open spans with no open sub-span and no open TaskGroup batch: the only
    #: ones that can be ready, so the only ones a poll looks at
    leaves: dict[str, SpanRecord] = field(default_factory=dict)
    #: ``len(SpansSchedulerExtension.spans)`` when last looked at: Dask never
    #: deletes a span, so the spans created since are the ones past this count
    spans_seen: int = 0
    #: By exported root Dask span id: the caller's span it continues (None: none),
    #: for work that comes under it later; at most :data:`MAX_REOPENED_ROOTS`
    reopened_parents: dict[str, SpanContext | None] = field(default_factory=dict)
    #: By Dask span id, the exits of ``dask_otel.span`` blocks whose span is not
    #: open: ``(scheduler time heard, BLOCK_EXIT event as read)``, oldest first,
    #: at most :data:`MAX_PENDING_EXITS`. What is still here
    #: ``otel.spans.export-delay`` later ran no task: an empty block.
    pending_exits: dict[str, tuple[float, Block]] = field(default_factory=dict)
    #: By root Dask span id: the client's ``sampled=`` for its trace (the first
    #: ``otel`` annotation that says one); at most :data:`MAX_FORCED_ROOTS`
    forced_roots: dict[str, bool] = field(default_factory=dict)
    #: By Dask span id: the spans the mirror made of blocks whose every task joined
    #: an older TaskGroup (the collision); at most :data:`MAX_MADE_SPANS`
    made: dict[str, Span] = field(default_factory=dict)

    def open_new_spans(self, spans: dict[str, Span]) -> None:
        """Open the Dask spans created since the last call, parents first; one
        the mirror made first is Dask's from now on (exported: not again)"""
        if (new := len(spans) - self.spans_seen) > 0:
            self.spans_seen = len(spans)
            for span in list(islice(reversed(spans.values()), new))[::-1]:
                if (made := self.made.pop(span.id, None)) is None:
                    self.open_span(span)
                elif (record := self.records.get(span.id)) is not None:
                    record.span = span  # begun when the mirror made it
                    record.observe_entered(made.enqueued, False, None)

    def follow_running(self, spans: dict[str, Span]) -> dict[str, Totals]:
        """A cluster instrumented while running: open what is still in flight. The
        subtree totals, by open span id, of its sub-spans that finished before
        (walked once, now): the builder's subtree ledger starts with them"""
        self.spans_seen = len(spans)
        for span in spans.values():
            if not span.done:  # Dask's own walk, once
                self.open_span(span)
                for tg in span.groups:
                    if not group_done(tg):
                        self.open_group(tg, GroupBatch(span))
        before: dict[str, Totals] = {}
        for record in list(self.records.values()):
            for child in record.span.children:
                if child.id not in self.records:
                    record.end_no_earlier(child.stop)
                    before.setdefault(record.span.id, Totals()).add(Totals.of_subtree(child))
        return before

    # --- spans ---------------------------------------------------------------------

    def open_span(self, span: Span) -> SpanRecord:
        record = self.records[span.id] = self.leaves[span.id] = SpanRecord(span)
        if self.pending_exits and (pending := self.pending_exits.pop(span.id, None)):
            # its block was left before its graph came
            block = pending[1]
            record.left_block(block.exited, None, block.names_workflow(span.id))
            record.labels = block.labels
        parent = span.parent
        if parent is not None and (parent_record := self.records.get(parent.id)):
            parent_record.open_children += 1
            self.leaves.pop(parent.id, None)
        return record

    def made_span(self, block: tuple[list[str], list[Any]], own: Span, spans: Mapping[str, Span],
                  scheduler: Scheduler, sampler: Sampler | None) -> Span:
        """The Dask span of ``block`` (ids and tags, root first), and each of its
        ancestors, that Dask made none of (every task of it joined an older
        TaskGroup, of ``own``): made and opened here, linked to ``own``"""
        (ids, tags), span = block, None
        for i, span_id in enumerate(ids):
            parent, record = span, self.records.get(span_id)
            span = record.span if record else spans.get(span_id) or self.made.get(span_id)
            if span is None:
                span = detached_span(tuple(map(str, tags[: i + 1])), span_id, parent, scheduler)
                link = (context := self.context(own, sampler)) and Link(
                    context, {SPAN_ID: own.id, SPAN_NAME: tuple(own.name)})
                _bounded_put(self.made, span.id, span, MAX_MADE_SPANS)
                record = self.open_span(span)
                record.collided, record.links = True, {own.id: link} if link else None
        return span  # type: ignore[return-value]

    def submitted_in(self, block: Block | None, own: Span, fresh: Span | None) -> Span | None:
        """The open Dask span the tasks of a later batch of ``block`` were submitted in:
        the innermost ``dask_otel.span`` block it entered, the span of the graph's new
        groups (``fresh``), the group's own span; None: none is open"""
        entered = block.entered if block is not None else None
        for span_id in (list(entered)[-1] if entered else None, fresh and fresh.id, own.id):
            if (record := self.records.get(span_id)) is not None:  # type: ignore[arg-type]
                return record.span
        return None

    def link_producers(self, ts: TaskState, span: Span, spans: Mapping[str, Span],
                       sampler: Sampler) -> None:
        """Link open span ``span`` to the spans of other traces that produced the
        inputs of its task ``ts`` (:mod:`dask_otel.scheduler.links`)"""
        if (record := self.records.get(span.id)) is not None:
            links = record.links if record.links is not None else {}
            producer_links(ts, root_span(span), spans, links, sampler)
            record.links = links or None

    def take_span(self, record: SpanRecord) -> None:
        """Forget an open span (it is being exported)"""
        span = record.span
        del self.records[span.id]
        self.leaves.pop(span.id, None)
        parent = span.parent
        parent_record = self.records.get(parent.id) if parent is not None else None
        if parent_record is not None and parent_record.open_children > 0:
            parent_record.open_children -= 1
            if parent_record.leaf:
                self.leaves[parent.id] = parent_record

    def observe_failure(self, tg: TaskGroup, failure: Failure, spans: Mapping[str, Span],
                        subtree: bool) -> None:
        """A task of ``tg`` erred: counted for its open batch and the open spans above
        it (its own alone unless ``subtree``: Dask's state counts forget it once its
        future is released), which end no earlier than it failed; its root's run erred"""
        if (batch := self.groups.get(tg)) is not None:
            batch.observe_erred(failure)
        # The span its batch is exported under, else the group's
        span = batch.span if batch is not None else spans.get(tg.span_id)
        failed = observed(failure.failed, batch.sent if batch else 0.0, time())
        if span is not None and (record := self.records.get(span.id)) is not None:
            record.end_no_earlier(failed)
        counted = False
        while span is not None:
            if (record := self.records.get(span.id)) is not None:
                if subtree or not counted:
                    record.count_erred(failure.kind)
                if span.parent is None:
                    record.run_erred = True
                    if sum(e[0] == EXCEPTION_EVENT for e in record.events or ()) < MAX_FAILURE_EVENTS:
                        record.add_event(*failure.event(failed))
            counted = True
            span = span.parent

    # --- TaskGroup batches ---------------------------------------------------------

    def open_group(self, tg: TaskGroup, batch: GroupBatch) -> None:
        self.groups[tg] = batch
        span_id = batch.span.id
        if (record := self.records.get(span_id)) is not None:
            record.open_groups += 1
            self.leaves.pop(span_id, None)

    def take_group(self, tg: TaskGroup) -> GroupBatch:
        """Forget an open batch (it is being exported)"""
        batch = self.groups.pop(tg)
        record = self.records.get(batch.span.id)
        if record is not None and record.open_groups > 0:
            record.open_groups -= 1
            if record.leaf:
                self.leaves[record.span.id] = record
        return batch

    def clear(self) -> None:
        """Forget everything (the scheduler is closing)"""
        for table in (self.groups, self.records, self.leaves, self.reopened_parents,
                      self.pending_exits, self.forced_roots, self.made):
            table.clear()

    def pend_exit(self, span_id: str, heard: float, block: Block) -> None:
        _bounded_put(self.pending_exits, span_id, (heard, block), MAX_PENDING_EXITS, True)

    # --- what the client's annotation says ---------------------------------------

    def observe_block(self, block: Block) -> None:
        """A new graph's tasks of ``block`` (their ``otel`` annotation, read once):
        keep, for each open span of its ids (root first), the earliest time a block of
        it or below it was entered (a parent never starts after its children; one
        whose own block is open waits for the exit its client announces); whether
        its root is a named workflow; and, from the root's own blocks only, the
        caller's span the root continues and its ``sampled=``"""
        records, root_id = self.records, block.ids[0]
        if (own := records.get(block.ids[-1])) is not None:  # its tasks' span
            own.labels = block.labels
        if block.workflow and (root := records.get(root_id)) is not None:
            root.workflow = True
        earliest = float("inf")
        for span_id in reversed(block.ids):  # innermost first: ancestors take the minimum
            if (t := block.entered.get(span_id)) is not None:
                earliest = min(earliest, t)
            if (record := records.get(span_id)) is not None:
                record.observe_entered(earliest, t is not None, block.client)
        if root_id not in block.entered:  # a distributed.span root
            return
        if (forced := block.sampled) is not None:
            _bounded_put(self.forced_roots, root_id, forced, MAX_FORCED_ROOTS)
        record = records.get(root_id)
        if record is not None and block.keep is not None:
            record.keep = block.keep
        if record is None:
            if root_id not in self.reopened_parents:
                _bounded_put(self.reopened_parents, root_id, block.caller, MAX_REOPENED_ROOTS)
        elif not record.carrier_read:
            record.observe_caller(block.caller)

    def span_start(self, span: Span) -> float:
        """Where the OTel span of a Dask span starts: ``Span.enqueued``, or earlier
        if a client entered a ``dask_otel.span`` block of it or below it before
        that; no earlier than any ancestor's start (as Dask clamps ``Span.start``),
        so that a child starts within its parent. Walks ancestors, never subtrees."""
        start = 0.0
        while span is not None:
            record = self.records.get(span.id)
            entered = record.entered if record is not None else None
            start = max(start, span.enqueued if entered is None else min(span.enqueued, entered))
            span = span.parent
        return start

    # --- callers of roots ----------------------------------------------------------

    def remote_parent(self, root_id: str, block: Block | None = None) -> SpanContext | None:
        """The caller's span a root Dask span continues, open or exported, else
        the one ``block`` names"""
        record = self.records.get(root_id)
        parent = record.remote_parent if record else self.reopened_parents.get(root_id)
        return parent if parent is not None or block is None else block.caller

    def context(self, span: Span, sampler: Sampler | None) -> SpanContext | None:
        """The sampled OTel SpanContext of a Dask span (None: sampled out, or no
        ``sampler``: traces off): one decision per trace, the same in every process"""
        if sampler is None:
            return None
        root = root_span(span)
        context = dask_span_context(root.id, span.id, str(root.name[0]),
                                    self.remote_parent(root.id), sampler, is_remote=False,
                                    forced=self.forced(root.id))
        return context if context.trace_flags.sampled else None

    def forced(self, root_id: str, block: Block | None = None) -> bool | None:
        """The client's ``sampled=`` for root ``root_id``'s trace: the first ``otel``
        annotation of it that said one, else ``block``'s (None: the sampler decides)"""
        forced = self.forced_roots.get(root_id) if self.forced_roots else None
        return block.sampled if forced is None and block is not None else forced


def _bounded_put(table: dict, key: Any, value: Any, limit: int, replace: bool = False) -> None:
    """Keep ``value`` (a first one only, unless ``replace``), the oldest entry
    forgotten past ``limit``"""
    if key in table and not replace:
        return
    if len(table) >= limit:
        del table[next(iter(table))]
    table[key] = value
