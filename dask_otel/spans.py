"""Dask spans -> OpenTelemetry spans: the mirror's conductor. Start reading here.

Every Dask span is mirrored on the scheduler as one OTel span, and every batch of
a TaskGroup attached to it as a child span, once finished; the records also make
the workflow outcomes, so the mirror runs when traces or metrics are on. Each file
of the path once (``tests/test_layout.py``)::

    Dask hooks (update_graph, transition)      dask_otel.scheduler.plugin
      -> SpanMirror.observe_* / poll / flush     here: what to open, when to export
        -> Ledger                                  dask_otel.scheduler.ledger
        -> SpanRecord, GroupBatch, SpanHead        dask_otel.scheduler.record
        -> dask_span_context (ids, sampling)       dask_otel.span_context
        -> SpanReading, GroupReading, handed over  dask_otel.scheduler.builder
    ~~~ the builder thread, off the event loop ~~~
          SpanBuilder: the subtree ledger, readings -> ReadableSpan
          -> Totals, SpanMetrics (both sides count with them)  dask_otel.scheduler.totals
          -> SpanSink.emit -> the SDK's processors  dask_otel.export.sink

On the loop only what reads Dask's live state, as plain values, in two frozen
readings handed to the builder thread whole. The mapping and
when a span is exported: docs/traces.md; costs: benchmarks/README.md.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import replace
from operator import attrgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from distributed.metrics import time
from opentelemetry.trace import Link

from dask_otel._compat import sent_annotations, span_code_blocks, span_own_metrics
from dask_otel.annotation import otel_of, read_block, read_span
from dask_otel.log import logger
from dask_otel.scheduler import blocks
from dask_otel.scheduler.builder import GroupReading, Handed, SpanBuilder, SpanReading
from dask_otel.scheduler.ledger import Ledger
from dask_otel.scheduler.record import GroupBatch, SpanHead, SpanRecord
from dask_otel.scheduler.totals import Failure, Totals, active_cpu_seconds, group_done
from dask_otel.span_context import child_context, kept_context, root_span

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from dask_otel.annotation import Block
    from dask_otel.config import OtelConfig
    from dask_otel.export.sink import SpanSink
    from dask_otel.scheduler.outcomes import Outcomes

#: Task prefixes whose latest span context is kept for exemplars: the
#: fine-metrics series limit (dask_otel.scheduler.metrics.MAX_SERIES)
MAX_EXEMPLAR_PREFIXES = 2000

#: Longest a poll may hold the scheduler's event loop before yielding, seconds
POLL_BUDGET = 0.002

_GROUP = attrgetter("group")


class SpanMirror:
    """Watches the scheduler's SpansSchedulerExtension (above). The plugin calls the
    ``observe_*`` methods from Dask's hooks, :meth:`poll` periodically, :meth:`flush` on close."""

    def __init__(self, scheduler: Scheduler, sink: SpanSink | None, config: OtelConfig,
                 outcomes: Outcomes | None = None):
        #: The scheduler whose ``extensions["spans"]`` is mirrored; where the built
        #: spans go (None: traces are off); where each finished root goes as a
        #: workflow run (None: metrics are off)
        self.scheduler, self.config, self.sink, self.outcomes = scheduler, config, sink, outcomes
        #: What is open, a record per Dask span and a batch per TaskGroup (opened now
        #: if instrumented while running), and the thread that builds the spans, its
        #: subtree ledger seeded with the sub-spans that finished before
        self.ledger = Ledger()
        before = self.ledger.follow_running(self.dask_spans)
        self.builder = SpanBuilder(sink, before) if sink is not None else None
        #: Spans and batches the sampler dropped (self-metrics); whether the WARNING
        #: that Dask sent no code (otel.spans.code) was logged
        self.sampled_out, self.told_no_code = 0, False
        #: Task prefix -> SpanContext of the latest sampled TaskGroup span of it: the
        #: exemplar of that prefix's fine metrics, at most MAX_EXEMPLAR_PREFIXES
        self.latest_by_prefix: dict[str, SpanContext] = {}
        #: Per poll: fine metrics and heads of the Dask spans it exports something
        #: of, and the spans it hands to the builder thread at its end
        self._metrics: dict[str, dict[tuple[Hashable, ...], float]] = {}
        self._heads: dict[str, SpanHead] = {}
        self._batch: list[Handed] = []
        self._random = random.Random()
        #: The computation the last graph joined and its ``span`` annotation then
        self._sent: tuple[Any, Any] = (None, None)

    @property
    def mirrored(self) -> int:
        """Spans and TaskGroup batches handed to the SDK (by the builder thread)"""
        return self.builder.emitted if self.builder is not None else 0

    @property
    def dask_spans(self) -> dict[str, Span]:
        """``SpansSchedulerExtension.spans``; empty without the extension"""
        ext = self.scheduler.extensions.get("spans")
        return ext.spans if ext is not None else {}

    def observe_graph(self, keys: Iterable[Hashable], wanted: Any, client: str | None = None) -> None:
        """Open the TaskGroups of a graph asked for ``wanted`` that just reached the
        scheduler (``update_graph``: new ones are still ``released``). A group exported
        before, or an open one, done, whose new tasks came from another block (whose
        batch so far is exported at once), opens a new batch under the Dask span its
        tasks were submitted in (the TaskGroup collision keeps them on the group's
        first span), exported only if some task runs."""
        if not (spans := self.dask_spans):
            return
        ledger = self.ledger
        ledger.open_new_spans(spans)
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
            # The graph's block ``told`` (made where Dask made none), else the task's
            span = (self._made(told, own) if told is not None else ledger.submitted_in(
                read_block(otel_of(ts.annotations), (own.id,)), own, fresh))
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

    def _made(self, block: tuple[list[str], list[Any]], own: Span) -> Span:
        return self.ledger.made_span(block, own, self.dask_spans, self.scheduler,
                                     self.sink.sampler if self.sink else None)

    def _open(self, tg: TaskGroup, batch: GroupBatch, ts: TaskState, client: str | None) -> None:
        """Open a batch (it runs tasks), read its first task's block; name its OTel span
        its prefix's exemplar from the first heartbeat on (docs/metrics.md)"""
        ledger, span, latest = self.ledger, batch.span, self.latest_by_prefix
        ledger.open_group(tg, batch)
        if (block := read_block(otel_of(ts.annotations), (span.annotation or {}).get("ids"),
                                client)) is not None:
            ledger.observe_block(block)
        if (context := self._context(span)) is not None and (
                tg.prefix.name in latest or len(latest) < MAX_EXEMPLAR_PREFIXES):  # bounded
            batch.span_id = self._random.getrandbits(64) or 1
            latest[tg.prefix.name] = child_context(context, batch.span_id)
        if ts.dependencies and self.sink is not None:  # the producers of its inputs
            ledger.link_producers(ts, span, self.dask_spans, self.sink.sampler)

    def observe_erred(self, key: Hashable, startstops: Any) -> None:
        """A task erred: one failure record, for :meth:`Ledger.observe_failure`"""
        if (ts := self.scheduler.tasks.get(key)) is not None:
            failure = Failure.of(ts, startstops, self.scheduler.allowed_failures,
                                 self.config.errors_messages)
            self.ledger.observe_failure(ts.group, failure, self.dask_spans,
                                        self.config.span_totals == "subtree")

    def observe_processing(self, key: Hashable, sent: bool) -> None:
        """A task sent to a worker, or heard back from (``GroupBatch.observe_processing``)"""
        ts = self.scheduler.tasks.get(key)
        if ts is not None and (batch := self.ledger.groups.get(ts.group)) is not None:
            batch.observe_processing(sent)

    def add_span_event(self, name: str, attributes: dict[str, Any], when: int,
                       leaves: Iterable[str] | None, up: bool = True) -> SpanContext | None:
        """A span event at ``when`` (ns) on each open Dask span of ``leaves`` (None:
        each with tasks processing in its subtree) and, with ``up``, every span above
        it up to the root. The sampled context of the first root hit (None: none)"""
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
                    record.add_event(name, attributes, when)
                if span.parent is None:
                    roots.append(span.id)
                span = span.parent if up else None
        return next(filter(None, map(self.context_of, roots)), None)

    def poll(self) -> bool:
        """Export the open spans and groups that are finished, for at most
        ``POLL_BUDGET`` seconds: True if there is more to do (next loop turn)"""
        ledger = self.ledger
        ledger.open_new_spans(self.dask_spans)
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
            self._export_empty_blocks(now - delay, now - timeout)
            # Spans with nothing open below them; a parent is looked at when its last
            # sub-span goes, so that its end and subtree sums include the sub-span's
            pending = list(ledger.leaves.values())
            while pending:
                record = pending.pop()
                if (stop := record.due(now, heard, delay, timeout)) is not None:
                    self._export(self.span_of, record, stop)
                    parent = record.span.parent
                    if parent is not None and (leaf := ledger.leaves.get(parent.id)):
                        pending.append(leaf)
                    if perf_counter() > deadline:
                        return True
            return False
        finally:
            self._end_poll()

    def _export_empty_blocks(self, heard_before: float, sent_before: float) -> None:
        """The blocks that ran no task: their spans, built here (rare)"""
        for span_id, block in blocks.due_empty_blocks(self.ledger, self.dask_spans, heard_before,
                                                      sent_before):
            if self.sink is not None:
                self._export(self._empty_block, span_id, block)

    def flush(self) -> None:
        """Export everything still open, finished or not (the scheduler is closing)"""
        ledger = self.ledger
        ledger.open_new_spans(self.dask_spans)
        try:
            self._export_empty_blocks(float("inf"), float("inf"))
            for tg in list(ledger.groups):
                self._export(self.group_span_of, tg, ledger.take_group(tg))
            for record in reversed(list(ledger.records.values())):  # children first
                stop = record.finished_at()
                self._export(self.span_of, record, stop or time(), stop is None)
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
        """Whether the builder's queue takes a span of this poll (:meth:`SpanBuilder.admit`)"""
        return self.builder.admit(child_kept, len(self._batch), parent)  # type: ignore[union-attr]

    def _export(self, export: Callable[..., Handed | bool | None], *args: Any) -> None:
        """Read what a span's export needs with ``export`` (False: sampled out); one
        that cannot be mirrored is logged and dropped (never raises into Dask)"""
        try:
            item = export(*args)
            if item is False:
                self.sampled_out += 1
            elif item is not None:
                self._batch.append(item)
        except Exception:
            logger.exception("dask_otel: could not mirror %r; dropped", args[0])

    def _empty_block(self, span_id: str, block: Block) -> ReadableSpan | bool | None:
        span = blocks.empty_block_span(self.ledger, self.sink, span_id, block)
        return span if span is False or self._kept(False, None) else None

    def span_of(self, record: SpanRecord, stop: float, unfinished: bool = False
                ) -> SpanReading | bool | None:
        """Take an open Dask span's record, end its parent no earlier, record a root's
        run, and read its OTel span's needs; False: sampled out, None: traces off"""
        span = record.span
        head = self._head(span)  # before the record goes: the root's caller
        ledger, config = self.ledger, self.config
        ledger.take_span(record)
        end = max(stop, record.end, head.start)
        parent = span.parent
        parent_record = ledger.records.get(parent.id) if parent is not None else None
        if parent_record is not None:
            parent_record.end_no_earlier(end)
        if parent is None and head.held is not None:  # a dropped run ends: kept whole, or not
            erred, slower = self._keep(record)
            record.kept = ("erred" if erred and record.run_erred else
                           "slow" if slower is not None and end - head.start > slower else None)
            if record.kept is None:
                self.sampled_out += len(head.held)
                head = self._heads[span.id] = replace(head, context=None, held=None)
        if parent is None and self.outcomes is not None:  # dask.workflow.*
            self.outcomes.record_run(record, head.context, head.start, end, unfinished)
        if head.context is None:
            return None if self.sink is None else False
        sums = config.span_totals == "subtree"
        code = (tuple(sc.code for block in span_code_blocks(span) for sc in block)
                if config.export_code else None)  # ``Span.code``; empty: Dask recorded none
        if code is not None and not code and not self.told_no_code:
            self.told_no_code = _tell_no_code(span.name[-1])
        parent_context = self._head(parent).context if parent is not None else record.remote_parent
        if record.kept:  # a trace of its own, linked to the caller's span (not an orphan)
            self._batch += head.held  # type: ignore[operator]
            if parent_context is not None:
                record.links = {**(record.links or {}), "caller": Link(parent_context, {})}
            parent_context = None
        return self._hold(head, SpanReading(
            record, head, parent_context, parent.id if parent_record else None, end,
            Totals.own(span), self._span_metrics(span), active_cpu_seconds(span, end), sums, code,
            unfinished, self._kept(record.child_kept, parent_record)))

    def group_span_of(self, tg: TaskGroup, batch: GroupBatch, held: int = 0
                      ) -> GroupReading | bool | None:
        """Read what the OTel span of a TaskGroup batch needs, a child of its Dask span's
        (which then ends no earlier), less ``held`` released tasks (the next batch's).
        False: sampled out; None: traces off, nothing ran or a full queue dropped it"""
        span = batch.span
        head = self._head(span)
        figures = batch.figures(tg, held) if head.context is not None else None
        latest, prefix = self.latest_by_prefix, tg.prefix.name
        if figures is None and head.context is not None:
            self._unname(prefix, batch)  # named at open (_open), nothing ran: no exemplar
            return None
        start, end = batch.bounds(tg, head.start)
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
        if head.held is None and (prefix in latest or len(latest) < MAX_EXEMPLAR_PREFIXES):
            latest[prefix] = context  # the exemplar of the prefix's fine metrics (bounded)
        # The Dask span Dask attached it to, which has its tasks' fine metrics
        own = self.dask_spans.get(tg.span_id, span)
        open_id = own.id if own.id in self.ledger.records else None
        (states, nbytes, duration), metrics = figures, self._span_metrics(own)
        return self._hold(head, GroupReading(str(tg.name), str(prefix), own.id, tuple(own.name),
                                             batch, head, context, states, nbytes, duration,
                                             metrics, open_id, start, end))

    def _hold(self, head: SpanHead, reading: Any) -> Any:
        """A reading of a dropped run that may be kept waits in its root's record"""
        if head.held is None or (isinstance(reading, SpanReading) and reading.record.kept):
            return reading
        head.held.append(reading)
        return None

    def _keep(self, root: SpanRecord) -> tuple[bool, float | None]:
        """``otel.traces.keep``: ``erred``, ``slower-than`` (seconds) of the run, the root
        block's ``keep=`` over the scheduler's config"""
        given, config = root.keep or {}, self.config
        return given.get("erred", config.keep_erred), given.get("slower-than",
                                                                config.keep_slower_than)

    def _unname(self, prefix: str, batch: GroupBatch) -> None:
        """The batch named at open is not exported: no exemplar until the next"""
        if (named := self.latest_by_prefix.get(prefix)) and named.span_id == batch.span_id:
            del self.latest_by_prefix[prefix]

    def context_of(self, span_id: str) -> SpanContext | None:
        """The OTel SpanContext of a Dask span, open or exported (None: unknown,
        sampled out, or traces off); for Dask's rare events"""
        span = self.dask_spans.get(span_id)
        return self._context(span) if span is not None else None

    def _context(self, span: Span) -> SpanContext | None:
        return self.ledger.context(span, self.sink.sampler if self.sink else None)

    def _span_metrics(self, span: Span) -> dict[tuple[Hashable, ...], float]:
        """A copy of a Dask span's own fine metrics, once per poll (in C)"""
        if (metrics := self._metrics.get(span.id)) is None:
            metrics = self._metrics[span.id] = dict(span_own_metrics(span))
        return metrics

    def _head(self, span: Span) -> SpanHead:
        """The :class:`SpanHead` of a Dask span, once per poll"""
        if (head := self._heads.get(span.id)) is None:
            head = SpanHead(self._context(span), self.ledger.span_start(span), tuple(span.name),
                            getattr(self.ledger.records.get(span.id), "labels", None))
            if head.context is None and self.sink is not None:
                head = self._kept_head(span, head)
            self._heads[span.id] = head
        return head

    def _kept_head(self, span: Span, head: SpanHead) -> SpanHead:
        """The head of a Dask span of a run the sampler dropped: if ``otel.traces.keep``
        may keep it (and no ``sampled=False`` forced the drop), its OTel context in a
        trace of its own (as a root without caller), its readings held in the root's record"""
        root = root_span(span)
        if (record := self.ledger.records.get(root.id)) is None or self.ledger.forced(
                root.id) is False or self._keep(record) == (False, None):
            return head
        record.held = [] if record.held is None else record.held
        return replace(head, context=kept_context(root.id, span.id, is_remote=False),
                       held=record.held)


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
