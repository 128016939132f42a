"""Dask spans -> OpenTelemetry spans: the mirror's conductor. Start reading here.

Every Dask span is mirrored on the scheduler as one OTel span, and every batch of
a TaskGroup attached to it as a child span, once finished; the records also make
the workflow outcomes, so the mirror runs when traces or metrics are on. Each file
of the path once (``tests/test_layout.py``)::

    Dask hooks (update_graph, transition)      dask_otel.scheduler.plugin
      -> SpanMirror.observe_* / poll / flush     here: what to open, when to export
        -> Ledger                                  dask_otel.scheduler.ledger
        -> SpanRecord, GroupBatch, SpanHead        dask_otel.scheduler.record
        -> totals over Dask's objects              dask_otel.scheduler.totals
        -> dask_span_context (ids, sampling)       dask_otel.span_context
        -> SpanBuilder.hand_over: a poll's numbers  dask_otel.scheduler.builder
    ~~~ the builder thread, off the event loop ~~~
          builder: numbers -> ReadableSpan           dask_otel.scheduler.builder
          -> SpanSink.emit -> the SDK's processors  dask_otel.export.sink

On the loop only what reads Dask's live state, as plain values. The mapping and
when a span is exported: docs/traces.md; costs: benchmarks/README.md.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Hashable, Iterable
from operator import attrgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from distributed.metrics import time
from opentelemetry.trace import Link

from dask_otel._compat import detached_span, sent_annotations, span_own_metrics
from dask_otel.annotation import entered_times, otel_of, read_span
from dask_otel.attributes import LOOP_BLOCKED, SPAN_ID, SPAN_NAME, WORKER_LOST
from dask_otel.scheduler import blocks
from dask_otel.scheduler.builder import SpanBuilder, built, dask_span, taskgroup_span
from dask_otel.scheduler.ledger import Ledger
from dask_otel.scheduler.links import producer_links
from dask_otel.scheduler.record import GroupBatch, SpanHead, SpanRecord
from dask_otel.scheduler.totals import (Totals, active_cpu_seconds, error_type, failure_time,
                                        group_done, observed, span_code)
from dask_otel.span_context import child_context, dask_span_context, root_span

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span
    from opentelemetry.trace import SpanContext

    from dask_otel.config import OtelConfig
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.outcomes import Outcomes

logger = logging.getLogger("dask_otel")

#: Task prefixes whose latest span context is kept for exemplars: the
#: fine-metrics series limit (dask_otel.scheduler.metrics.MAX_SERIES)
MAX_EXEMPLAR_PREFIXES = 2000

#: Longest a poll may hold the scheduler's event loop before yielding, seconds
POLL_BUDGET = 0.002

_GROUP = attrgetter("group")


class SpanMirror:
    """Watches the scheduler's SpansSchedulerExtension (above). The plugin calls the
    ``observe_*`` methods from Dask's hooks, :meth:`poll` periodically, :meth:`flush`
    on close."""

    def __init__(self, scheduler: Scheduler, sink: SpanSink | None, config: OtelConfig,
                 outcomes: Outcomes | None = None):
        #: The scheduler whose ``extensions["spans"]`` is mirrored
        self.scheduler = scheduler
        #: Where the built spans go (None: traces are off; nothing is built), and
        #: the thread that builds them
        self.sink = sink
        self.builder = SpanBuilder(sink) if sink is not None else None
        self.config = config
        #: Where each finished root goes as a workflow run (None: metrics are off)
        self.outcomes = outcomes
        #: What is open, a record per Dask span and a batch per TaskGroup
        self.ledger = Ledger()
        #: Spans and TaskGroup batches dropped by the sampler (self-metrics,
        #: dask_otel.scheduler.metrics)
        self.sampled_out = 0
        #: Whether the WARNING that Dask sent no code (otel.spans.code) was logged
        self.told_no_code = False
        #: Task prefix -> SpanContext of the latest sampled TaskGroup span of it: the
        #: exemplar of that prefix's fine metrics, at most MAX_EXEMPLAR_PREFIXES
        self.latest_by_prefix: dict[str, SpanContext] = {}
        #: Per poll: fine metrics and heads of the Dask spans it exports something
        #: of, and the spans it hands to the builder thread at its end
        self._metrics: dict[str, dict[tuple[Hashable, ...], float]] = {}
        self._heads: dict[str, SpanHead] = {}
        self._batch: list[tuple[Any, tuple]] = []
        self._random = random.Random()
        #: The computation the last graph joined and its ``span`` annotation then
        self._sent: tuple[Any, Any] = (None, None)
        self.ledger.follow_running(self.dask_spans)  # instrumented while running

    @property
    def mirrored(self) -> int:
        """Spans and TaskGroup batches handed to the SDK (by the builder thread)"""
        return self.builder.emitted if self.builder is not None else 0

    @property
    def dask_spans(self) -> dict[str, Span]:
        """``SpansSchedulerExtension.spans``; empty without the extension"""
        ext = self.scheduler.extensions.get("spans")
        return ext.spans if ext is not None else {}

    # --- what the hooks learn ------------------------------------------------------

    def observe_new_spans(self) -> None:
        """Open the Dask spans created since the last look"""
        self.ledger.open_new_spans(self.dask_spans)

    def observe_graph(self, keys: Iterable[Hashable], wanted: Any, client: str | None = None) -> None:
        """Open the TaskGroups of a graph asked for ``wanted`` that just reached the
        scheduler (``update_graph``: Dask attached its tasks to their spans; new ones
        are still ``released``). A group exported before opens again as a new batch,
        under the Dask span its tasks were submitted in (the TaskGroup collision
        keeps them on the group's first span), exported only if some task runs;
        so does an open group's, done, if its new tasks were sent from another
        block: its batch so far is exported at once, without them."""
        if not (spans := self.dask_spans):
            return
        self.observe_new_spans()
        ledger = self.ledger
        # The block the client sent the graph in (Dask rewrote its tasks'); None: it
        # sent none, and what the computation holds is an earlier graph's
        (computation, sent), seen = sent_annotations(self.scheduler), self._sent
        self._sent = computation, (block := sent.get("span"))
        told = None if seen[0] is computation and seen[1] is block else read_span(block)
        # One task per group of the graph (the first), whose annotations are
        # those of all, and how many of the graph's tasks each group has. In C
        # (map, zip, Counter): this runs for every key of every graph.
        tss = [ts for ts in map(self.scheduler.tasks.get, keys) if ts is not None]
        groups = list(map(_GROUP, tss))
        first = dict(zip(reversed(groups), reversed(tss)))
        in_graph: Counter[TaskGroup] | None = None
        rerun: dict[TaskGroup, int] | None = None
        later: list[tuple[TaskGroup, TaskState, Span]] = []
        fresh: Span | None = None  # the span of the graph's new groups
        orphan: Span | None = None  # where nothing says where they were sent
        for tg, ts in first.items():
            if tg.span_id is None or (span := spans.get(tg.span_id)) is None:
                continue
            if tg in ledger.groups:
                if told is not None:  # more work of its open batch, or of another block
                    later.append((tg, ts, span))
                continue
            states = tg.states
            if in_graph is None:
                in_graph = Counter(groups)
            if not tg.stop and states.get("released", 0) == sum(states.values()) == in_graph[tg]:
                # A new group: every task released, and in this graph
                self._open(tg, GroupBatch(span), ts, client)
                fresh = span
            else:
                later.append((tg, ts, span))
        for tg, ts, own in later:
            span = self._submitted_in(ts, own, fresh, told)
            if span is None:  # nothing says where: a root of its own, one per graph
                span = orphan = orphan or self._made(([str(uuid4())], [tg.prefix.name]), own)
            if (batch := ledger.groups.get(tg)) is not None and (
                    batch.span.id == span.id or not group_done(tg)):
                continue  # more work of its open batch's block, or two blocks' at once
            if rerun is None:  # tasks of each group it (re)runs, as Dask picks them after this
                # hook: the released keys asked for and, on, the released inputs of each
                run = new = {t for t in map(self.scheduler.tasks.get, wanted)
                             if t and t.state == "released"}
                while new := {d for t in new for d in t.dependencies if d.state == "released"} - run:
                    run = run | new
                rerun = Counter(map(_GROUP, run))
            if not rerun[tg]:
                continue  # none: finished tasks merely requested again
            if batch is not None:  # another block's, done: it ends without them
                self._export(self.group_span_of, tg, ledger.take_group(tg), rerun[tg])
                self._end_poll()
            self._open(tg, GroupBatch.reopened(tg, span, own, rerun[tg]), ts, client)

    def _submitted_in(self, ts: TaskState, own: Span, fresh: Span | None,
                      told: tuple[list[str], list[Any]] | None) -> Span | None:
        """The Dask span the tasks of a later batch were submitted in: the block
        ``told`` (the graph's), made here where Dask made none of it; else the open
        innermost ``dask_otel.span`` block of their annotation, the span of the
        graph's new groups, the group's own span; None: nothing says"""
        if told is not None:
            return self._made(told, own)
        records = self.ledger.records
        entered = entered_times(otel_of(ts.annotations))
        for span_id in (list(entered)[-1] if entered else None, fresh and fresh.id, own.id):
            if (record := records.get(span_id)) is not None:  # type: ignore[arg-type]
                return record.span
        return None

    def _made(self, block: tuple[list[str], list[Any]], own: Span) -> Span:
        """The Dask span of ``block`` (ids and tags, root first), and each of its
        ancestors, that Dask made none of (every task of it joined an older
        TaskGroup, of ``own``): made and opened here, linked to ``own``"""
        (ids, tags), span, ledger = block, None, self.ledger
        for i, span_id in enumerate(ids):
            parent, record = span, ledger.records.get(span_id)
            span = record.span if record else self.dask_spans.get(span_id) or ledger.made.get(span_id)
            if span is None:
                span = detached_span(tuple(map(str, tags[: i + 1])), span_id, parent,
                                     self.scheduler)
                link = (context := self._context(own)) and Link(
                    context, {SPAN_ID: own.id, SPAN_NAME: tuple(own.name)})
                ledger.open_made(span, {own.id: link} if link else None)
        return span  # type: ignore[return-value]

    def _open(self, tg: TaskGroup, batch: GroupBatch, ts: TaskState, client: str | None) -> None:
        """Open a batch (it runs tasks), read its first task's annotation; name its OTel
        span: its prefix's exemplar from the first heartbeat on (docs/metrics.md)"""
        ledger, span, latest = self.ledger, batch.span, self.latest_by_prefix
        ledger.open_group(tg, batch)
        ledger.observe_annotation(otel_of(ts.annotations), span, client)
        if (context := self._context(span)) is not None and (
                tg.prefix.name in latest or len(latest) < MAX_EXEMPLAR_PREFIXES):  # bounded
            batch.span_id = self._random.getrandbits(64) or 1
            latest[tg.prefix.name] = child_context(context, batch.span_id)
        if ts.dependencies and self.sink is not None and (record := ledger.records.get(span.id)):
            # Links to the spans of other traces that produced its inputs
            links = record.links if record.links is not None else {}
            producer_links(ts, root_span(span), self.dask_spans, links, self.sink.sampler)
            record.links = links or None

    def observe_erred(self, key: Hashable, startstops: Any) -> None:
        """A task erred: count it for its open group and spans (Dask's state counts
        forget it once the future is released), which end no earlier than it
        failed; its root's run erred"""
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return
        # A task that ran and failed: the worker sent its startstops
        started, failed = failure_time(startstops)
        tg = ts.group
        kind = error_type(ts, self.scheduler.allowed_failures)
        if (batch := self.ledger.groups.get(tg)) is not None:
            batch.observe_erred(kind, failed, started)
        # The span its batch is exported under, else the group's
        span = batch.span if batch is not None else self.dask_spans.get(tg.span_id)
        records = self.ledger.records
        if span is not None and (record := records.get(span.id)) is not None:
            sent = batch.sent if batch is not None else 0.0
            record.end_no_earlier(observed(failed, sent, time()))
        subtree = self.config.span_totals == "subtree"
        counted = False
        while span is not None:
            record = records.get(span.id)
            if record is not None and (subtree or not counted):
                record.count_erred(kind)
            counted = True
            if span.parent is None and record is not None:
                record.run_erred = True
            span = span.parent

    def observe_processing(self, key: Hashable, sent: bool) -> None:
        """The scheduler sends a task to a worker (``sent``: the first of its batch
        bounds the batch's start), or hears it finished or failed (the last bounds
        its end). Per task: two lookups, one test."""
        ts = self.scheduler.tasks.get(key)
        if ts is not None and (batch := self.ledger.groups.get(ts.group)) is not None:
            if not sent:
                batch.received = time()
            elif not batch.sent:
                batch.sent = time()

    def observe_exit(self, msg: Any) -> None:
        """A client left a ``dask_otel.span`` block (:mod:`dask_otel.scheduler.blocks`)"""
        self.observe_new_spans()
        blocks.observe_exit(self.ledger, self.dask_spans, msg, time())

    def observe_client_leaving(self, client: str, left: float) -> None:
        blocks.observe_client_leaving(self.ledger, client, left)

    def observe_client_gone(self, client: str) -> None:
        blocks.observe_client_gone(self.ledger, client)

    def observe_worker_lost(self, span_id: str, attributes: dict[str, Any], when: int) -> None:
        """A worker working for Dask span ``span_id`` was lost at ``when`` (ns): a
        ``dask.worker.lost`` event on it, if it is open"""
        if (record := self.ledger.records.get(span_id)) is not None:
            record.add_event(WORKER_LOST, attributes, when)

    def observe_loop_blocked(self, leaves: Iterable[str] | None, attributes: dict[str, Any],
                             when: int) -> SpanContext | None:
        """An event loop was blocked, told at ``when`` (ns): a ``dask.event_loop.blocked``
        event on each open Dask span of ``leaves`` (the spans of the tasks a worker
        was running) and their parents up to the root; None: the scheduler's, on each
        with tasks processing in its subtree. The sampled context of the first root
        hit (None: none), the histogram's exemplar"""
        records = self.ledger.records
        if leaves is None:
            hit = [r.span for r in records.values() if r.span.states.get("processing")]
        else:
            spans = self.dask_spans
            hit = [spans[span_id] for span_id in leaves if span_id in spans]
        seen: set[str] = set()
        roots = []
        for span in hit:
            while span is not None and span.id not in seen:
                seen.add(span.id)
                if (record := records.get(span.id)) is not None:
                    record.add_event(LOOP_BLOCKED, attributes, when)
                if span.parent is None:
                    roots.append(span.id)
                span = span.parent
        return next(filter(None, map(self.context_of, roots)), None)

    # --- when to export ------------------------------------------------------------

    def poll(self) -> bool:
        """Export the open spans and groups that are finished, for at most
        ``POLL_BUDGET`` seconds: True if there is more to do (next loop turn)"""
        self.observe_new_spans()
        ledger = self.ledger
        now = time()
        deadline = perf_counter() + POLL_BUDGET
        heard = min((ws.last_seen for ws in self.scheduler.workers.values()), default=now)
        delay, timeout = self.config.export_delay, self.config.metrics_timeout
        try:
            due = [item for item in ledger.groups.items() if item[1].wake <= now]
            for tg, batch in due:
                if batch.ready(tg, now, heard, delay, timeout):
                    self._export(self.group_span_of, tg, ledger.take_group(tg))
                    if perf_counter() > deadline:
                        return True
            if ledger.pending_exits:
                self._export_empty_blocks(now - delay)
            # Spans: only those with nothing open below them. A parent becomes a
            # leaf when its last sub-span is exported, and is looked at next, so
            # that its subtree totals and end include the sub-span's.
            pending = list(ledger.leaves.values())
            while pending:
                record = pending.pop()
                stop = record.finished_at()
                if stop is not None and self._ready(stop, now, heard):
                    self._export(self.span_of, record, stop)
                    parent = record.span.parent
                    if parent is not None and (leaf := ledger.leaves.get(parent.id)):
                        pending.append(leaf)
                    if perf_counter() > deadline:
                        return True
            return False
        finally:
            self._end_poll()

    def _ready(self, stop: float, now: float, heard: float) -> bool:
        """As ``GroupBatch.ready``, for a Dask span that finished at ``stop``"""
        waited = now - stop
        return waited >= self.config.export_delay and (
            heard > stop or waited >= self.config.metrics_timeout
        )

    def _export_empty_blocks(self, heard_before: float) -> None:
        for span_id, block in blocks.due_empty_blocks(self.ledger, self.dask_spans, heard_before):
            if self.sink is not None:
                self._export(self._empty_block, span_id, block)

    def flush(self) -> None:
        """Export everything still open, finished or not (the scheduler is closing)"""
        self.observe_new_spans()
        ledger = self.ledger
        try:
            if ledger.pending_exits:
                self._export_empty_blocks(float("inf"))
            for tg in list(ledger.groups):
                self._export(self.group_span_of, tg, ledger.take_group(tg))
            for record in reversed(list(ledger.records.values())):  # children first
                stop = record.finished_at()
                self._export(self.span_of, record, stop or time(), unfinished=stop is None)
        finally:
            ledger.clear()
            self._end_poll()

    def _end_poll(self) -> None:
        """Hand the poll's spans to the builder thread at once; forget its caches"""
        self._metrics.clear()
        self._heads.clear()
        if self._batch:
            batch, self._batch = self._batch, []
            self.builder.hand_over(batch)  # type: ignore[union-attr]

    def _kept(self, child_kept: bool, parent: SpanRecord | None) -> bool:
        """Whether the builder's queue takes a span of this poll, else it is dropped
        and counted: past its capacity only the parent of a span kept (a poll hands
        children over first), so that a full queue never orphans what it keeps"""
        builder: SpanBuilder = self.builder  # type: ignore[assignment]  # traces are on
        if not child_kept and builder.queued - builder.built + len(self._batch) >= builder.capacity:
            builder.dropped += 1
            return False
        if parent is not None:
            parent.child_kept = True
        return True

    def _export(self, export: Any, *args: Any, **kwargs: Any) -> None:
        """Read what a span's export needs with ``export`` (``(build, args)`` for
        the builder thread); one that cannot be mirrored is logged and dropped
        (never raises into the scheduler)"""
        try:
            item = export(*args, **kwargs)
            if item is False:
                self.sampled_out += 1
            elif item is not None:
                self._batch.append(item)
        except Exception:
            logger.exception("dask_otel: could not mirror %r; dropped", args[0])

    # --- what to export ------------------------------------------------------------

    def _empty_block(self, span_id: str, block: Any) -> tuple[Any, tuple] | bool | None:
        span = blocks.empty_block_span(self.ledger, self.sink, span_id, block)
        return span if span is False else (built, (span,)) if self._kept(False, None) else None

    def span_of(self, record: SpanRecord, stop: float, unfinished: bool = False
                ) -> tuple[Any, tuple] | bool | None:
        """Take an open Dask span's record, end its parent no earlier, record a
        root's run, and read what its OTel span needs (for the builder thread);
        False if the sampler drops its trace, None if traces are off or a full
        queue drops it. Keeps nothing."""
        span = record.span
        head = self._head(span)  # before the record goes: the root's caller
        ledger = self.ledger
        ledger.take_span(record)
        end = max(stop, record.end, head.start)
        parent = span.parent
        parent_record = ledger.records.get(parent.id) if parent is not None else None
        if parent is None and self.outcomes is not None:  # dask.workflow.*
            self.outcomes.record_run(record, head.context, head.start, end, unfinished)
        if head.context is None:
            if parent_record is not None:
                parent_record.end_no_earlier(end)
            return None if self.sink is None else False
        own = Totals.own(span)
        subtree = own
        if record.folded is not None:  # sub-spans exported before, summed
            subtree = record.folded
            subtree.add(own)
        if parent_record is not None:
            parent_record.fold(subtree, end)
        parent_context = self._head(parent).context if parent is not None else record.remote_parent
        config = self.config
        sums = config.span_totals == "subtree"
        code = span_code(span) if config.export_code else None
        if code is not None and not code and not self.told_no_code:
            self.told_no_code = _tell_no_code(span.name[-1])
        if not self._kept(record.child_kept, parent_record):
            return None
        return dask_span, (record, head, parent_context, parent.id if parent is not None else None,
                           end, subtree if sums else own, self._span_metrics(span),
                           active_cpu_seconds(span, end), sums, code, subtree.start, unfinished)

    def group_span_of(self, tg: TaskGroup, batch: GroupBatch, held: int = 0
                      ) -> tuple[Any, tuple] | bool | None:
        """Read what the OTel span of a batch of a TaskGroup needs (for the builder
        thread): a child of its Dask span's (which then ends no earlier), from its
        first task's start (a later batch: its graph's arrival) to its last task's
        end, less ``held`` released tasks (the next batch's). False if the sampler
        drops the trace, None if traces are off, nothing ran or a full queue drops
        it. Keeps nothing."""
        span = batch.span
        head = self._head(span)
        figures = batch.figures(tg, held) if head.context is not None else None
        latest, prefix = self.latest_by_prefix, tg.prefix.name
        if figures is None and head.context is not None:
            self._unname(prefix, batch)  # named at open (_open), nothing ran: no exemplar
            return None
        start = max(batch.start(tg) or span.enqueued, head.start)
        end = max(batch.end(tg) if group_done(tg) else time(), start)
        if (record := self.ledger.records.get(span.id)) is not None:
            # The Dask span ends no earlier than the scheduler heard of the
            # group's last task: every task, as its worker saw it, lies inside
            record.end_no_earlier(max(end, batch.received))
        if figures is None:
            return None if self.sink is None else False
        if not self._kept(False, record):
            self._unname(prefix, batch)  # dropped by the full queue: no exemplar
            return None
        context = child_context(head.context, batch.span_id or self._random.getrandbits(64) or 1)
        if prefix in latest or len(latest) < MAX_EXEMPLAR_PREFIXES:  # bounded
            latest[prefix] = context  # the exemplar of the prefix's fine metrics
        # The Dask span Dask attached it to, which has its tasks' fine metrics
        own = self.dask_spans.get(tg.span_id, span)
        open_id = own.id if own.id in self.ledger.records else None
        return taskgroup_span, ((str(tg.name), str(prefix), own.id, tuple(own.name)), batch, head,
                                context, figures, self._span_metrics(own), open_id, start, end)

    def _unname(self, prefix: str, batch: GroupBatch) -> None:
        """The batch named at open (:meth:`_open`) is not exported: its prefix's
        fine metrics name no exemplar until the next batch"""
        if (named := self.latest_by_prefix.get(prefix)) and named.span_id == batch.span_id:
            del self.latest_by_prefix[prefix]

    def context_of(self, span_id: str) -> SpanContext | None:
        """The OTel SpanContext of a Dask span, open or exported (None: unknown,
        sampled out, or traces off); for Dask's rare events"""
        span = self.dask_spans.get(span_id)
        return self._context(span) if span is not None else None

    def _context(self, span: Span) -> SpanContext | None:
        """The sampled OTel SpanContext of a Dask span (None: sampled out or traces
        off): one decision per trace, the same in every process"""
        if self.sink is None:
            return None
        root = root_span(span)
        context = dask_span_context(
            root.id, span.id, str(root.name[0]), self.ledger.remote_parent(root.id),
            self.sink.sampler, is_remote=False, forced=self.ledger.forced(root.id),
        )
        return context if context.trace_flags.sampled else None

    def _span_metrics(self, span: Span) -> dict[tuple[Hashable, ...], float]:
        """A copy of a Dask span's own fine metrics, taken once per poll (in C):
        the builder thread names and sums them"""
        if (metrics := self._metrics.get(span.id)) is None:
            metrics = self._metrics[span.id] = dict(span_own_metrics(span))
        return metrics

    def _head(self, span: Span) -> SpanHead:
        """The :class:`SpanHead` of a Dask span, once per poll"""
        if (head := self._heads.get(span.id)) is None:
            head = self._heads[span.id] = SpanHead(
                self._context(span), self.ledger.span_start(span), tuple(span.name)
            )
        return head


def _tell_no_code(name: str) -> bool:
    """With ``otel.spans.code``: one WARNING when a Dask span has no code (a
    client key, read in the client's process)"""
    logger.warning(
        "dask_otel: otel.spans.code is true but Dask span %r has no code: "
        "Dask records it only when distributed.diagnostics.computations.nframes "
        "is above 0 (default 0) in the client that computes; set it there, "
        "e.g. DASK_DISTRIBUTED__DIAGNOSTICS__COMPUTATIONS__NFRAMES=1",
        name,
    )
    return True
