"""Dask spans -> OpenTelemetry spans.

Every Dask span (``with distributed.span("Alice's workflow"):``) is mirrored on the
scheduler as one OpenTelemetry span, and every TaskGroup attached directly to it as
a child span (one per batch of work, see below), once the Dask span has finished.
A root Dask span and everything below it form one OTel trace.

Ids
    ``trace_id`` is the 128-bit integer of the root Dask span's UUID, so
    ``with span("x") as sid:`` is trace ``sid.replace("-", "")`` with no lookup.
    ``span_id`` is the low 64 bits of the Dask span's UUID; parents mirror the Dask
    tree. TaskGroup spans get random span ids. A root opened with
    ``dask_otel.span`` under a valid current span (the ``otel`` task annotation
    carries it, see :mod:`dask_otel.client`) joins that caller's trace instead: its
    trace id is the caller's and its parent the caller's span.

Sampling
    One decision per trace (:func:`dask_otel.sampling.trace_sampled`, asked with
    the root span's first tag, ``Span.name[0]``): every span of a trace is kept or
    dropped together, ratio samplers keep their ratio of Dask traces, and nothing
    is kept about a span the sampler dropped.

Timing
    A Dask span starts at ``Span.enqueued``, or earlier when a client entered a
    ``dask_otel.span`` block of it or of a span below it before that, and ends
    at ``Span.stop``; the event
    ``dask.first_task_start`` marks ``Span.start``. A TaskGroup span runs from
    ``TaskGroup.start`` to ``TaskGroup.stop``. Dask records no run time for an
    erred task (its group's ``stop`` stays 0, ``Span.stop`` falls back to
    ``enqueued``): the mirror takes when it ran and failed from the
    ``transition`` hook (the run in the worker's ``startstops``, else the time it
    erred) for the start of its group and the ends of its group and span, and
    for their export delay.

    Every span lies within its parent: a span starts no earlier than any of its
    ancestors (Dask clamps ``Span.start`` likewise), children are exported before
    their parent and their exported ends fold into the parent's end
    (:attr:`SpanMirror.ends`). Only work that runs after its parent's export
    (below) can end after the parent.

Limits
    Attributes go through the SDK's ``BoundedAttributes`` with the provider's
    ``SpanLimits`` (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``,
    ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``), as the SDK's own spans do;
    span names are cut to ``MAX_NAME_LENGTH``.

Attributes (Dask spans)
    ``dask.span.id`` (str), ``dask.span.name`` (str[], all tags),
    ``dask.tasks.total`` (int, tasks in the span whatever their state),
    ``dask.tasks.<state>`` (int, non-zero task counts by state at export time:
    ``memory``, ``released``, ``forgotten``, ``erred``...),
    ``dask.output.bytes``, ``dask.duration`` (s, time spent running tasks),
    ``dask.active_cpu_seconds`` (s, threads available while the span ran),
    ``dask.metrics.<context>.<activity>.<unit>`` (fine performance metrics, summed
    over task prefixes), ``dask.span.code`` (str[], only with ``otel.spans.code``),
    ``dask.span.unfinished`` (true when the scheduler closed before the span finished).

    With ``otel.spans.totals: subtree`` (default) the task counts, bytes, duration
    and fine metrics cover the span and all its sub-spans, as Dask's own
    ``Span`` properties and dashboard do; with ``own`` only the span's own
    TaskGroups, so that summing over a trace does not count anything twice.
    Subtree totals are summed as sub-spans are exported (task counts by state are
    each sub-span's as of its export), so exporting a span never walks its tree.

Attributes (TaskGroup spans)
    ``dask.span.id`` and ``dask.span.name`` of the Dask span the group belongs to,
    ``dask.taskgroup.name``, ``dask.taskgroup.prefix``, ``dask.tasks.<state>``,
    ``dask.output.bytes``, ``dask.duration``, and
    ``dask.metrics.<context>.<activity>.<unit>`` for the group's task prefix within
    its Dask span (two groups of one prefix in one span both show the prefix total).

Status
    ERROR, described as ``"<n> tasks erred"``, when any task erred; unset otherwise.

When a span is exported
    Once it is done (every task in its tree finished), has stayed done for
    ``otel.spans.export-delay`` (so that the next ``compute()`` of the same
    workflow, submitted right away, does not cut it in two), and every worker has
    sent a heartbeat since it finished, which carries the fine performance metrics
    (or ``otel.spans.metrics-timeout`` passed). Children may be exported before
    their parents. A span that goes from done back to not done before that simply
    waits.

After a span is exported, the bridge forgets it: each span is exported exactly once
and no two OTel spans ever share an id. If more work later lands on an exported
Dask span (a ``compute()`` after a long pause inside the same ``with span()``
block), its new sub-spans and TaskGroups are still exported as its children, so
the trace stays whole; the exported parent keeps the end time and totals it had.

Every batch of tasks that runs is mirrored once. A TaskGroup that gets new tasks
after its export (``client.submit(f, x)`` without ``key=`` puts every call of
``f`` in one TaskGroup, attached to the first call's span) opens again with a
snapshot of its cumulative values (:class:`GroupBatch`, kept only while it is
open) and is exported as a new child span covering only that batch: from when its
graph reached the scheduler to when its last task finished or failed, with the
tasks, bytes, duration and fine metrics added since (``dask.tasks.<state>``: how
much each state count grew). A batch in which nothing ran exports nothing.
Recomputation after a worker death, without a new graph, is not mirrored.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping
from itertools import islice
from operator import attrgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any

from distributed.metrics import time
from distributed.protocol.serialize import ToPickle
from distributed.scheduler import ALL_TASK_STATES
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

from dask_otel.client import ANNOTATION, remote_parent, root_carrier
from dask_otel.ids import otel_span_id, root_span, trace_id_of
from dask_otel.links import producer_links
from dask_otel.sampling import trace_sampled
from dask_otel.telemetry import NO_ATTRIBUTES

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span, SpansSchedulerExtension

    from dask_otel.config import OtelConfig
    from dask_otel.telemetry import SpanSink, Telemetry

logger = logging.getLogger("dask_otel")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
#: Longest a poll may hold the scheduler's event loop before yielding, seconds
POLL_BUDGET = 0.002
_IDLE = "dask.metrics.execute.idle_or_other_spans.seconds"
#: Roots remembered with their caller's span after their export, for work that
#: comes under them later (each a few hundred bytes)
MAX_REOPENED_ROOTS = 1024
#: Longest span name exported; the rest of a huge tag is cut (span names are not
#: attributes, so the SDK's attribute length limit does not apply to them)
MAX_NAME_LENGTH = 1024


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


#: What a fine-metric key ``(context, [prefix,] ..., activity, unit)`` of a Dask
#: span means to the mirror: its attribute name, its task prefix (None unless it
#: is an ``execute`` metric of one prefix) and whether it is seconds of the
#: ``execute`` context. Keys come from Dask and repeat across spans; the cache is
#: bounded.
_KEYS: dict[tuple[Hashable, ...], tuple[str, Hashable, bool]] = {}
_MAX_KEYS = 1 << 16
_NO_PREFIX = object()


def _key_info(key: tuple[Hashable, ...]) -> tuple[str, Hashable, bool] | None:
    info = _KEYS.get(key)
    if info is None:
        if len(key) < 3:
            return None
        if len(_KEYS) >= _MAX_KEYS:  # unbounded task prefixes: stay bounded
            _KEYS.clear()
        execute = key[0] == "execute"
        parts = (str(k).replace(" ", "_") for k in (key[0], key[-2], key[-1]))
        info = _KEYS[key] = (
            "dask.metrics.{}.{}.{}".format(*parts),
            key[1] if execute and len(key) >= 4 else _NO_PREFIX,
            execute and key[-1] == "seconds",
        )
    return info


class SpanMetrics:
    """The fine performance metrics of one Dask span (its own, not its
    sub-spans'), as attributes, in one pass over Dask's
    ``Span._cumulative_worker_metrics``: summed over task prefixes for the span,
    and by task prefix for its TaskGroups."""

    __slots__ = ("by_prefix", "execute_seconds", "total")

    def __init__(self, metrics: Mapping[tuple[Hashable, ...], float]):
        #: ``dask.metrics.<context>.<activity>.<unit>``, summed over prefixes
        self.total: dict[str, float] = {}
        #: the same by task prefix, ``execute`` context only
        self.by_prefix: dict[Hashable, dict[str, float]] = {}
        #: seconds of the execute context, for "idle or other spans"
        self.execute_seconds = 0.0
        total, by_prefix = self.total, self.by_prefix
        for key, value in metrics.items():
            if not value:
                continue
            info = _KEYS.get(key) or _key_info(key)
            if info is None:
                continue
            name, prefix, execute_seconds = info
            total[name] = total.get(name, 0) + value
            if prefix is not _NO_PREFIX:
                attrs = by_prefix.get(prefix)
                if attrs is None:
                    attrs = by_prefix[prefix] = {}
                attrs[name] = attrs.get(name, 0) + value
            if execute_seconds:
                self.execute_seconds += value

    @classmethod
    def of(cls, span: Span) -> SpanMetrics:
        return cls(span._cumulative_worker_metrics)


def active_cpu_seconds(span: Span, stop: float) -> float:
    """``Span.active_cpu_seconds`` of a span that is not a merge, given its stop.

    The property walks the subtree four times (for ``stop`` and ``done``) and
    skips through the cluster's whole thread-count history; this reads only the
    history since the span was enqueued.
    """
    try:
        history = span._total_nthreads_history
        first = span._total_nthreads_offset
    except AttributeError:  # another Dask version: the public, slower way
        return span.active_cpu_seconds
    total = 0.0
    since, nthreads = span.enqueued, 0
    for i in range(first, len(history)):
        t, n = history[i]
        if t >= stop:
            break
        t = max(t, span.enqueued)
        total += (t - since) * nthreads
        since, nthreads = t, n
    return total + max(stop - since, 0.0) * nthreads


def _name(name: str) -> str:
    """A span name cut to ``MAX_NAME_LENGTH``"""
    return name[:MAX_NAME_LENGTH]


def failure_time(startstops: Iterable[Mapping[str, Any]] | None) -> tuple[float, float]:
    """When an erred task ran and failed: its ``compute`` in the ``startstops`` the
    worker sent with the error (already in the scheduler's clock); else (0, now):
    it erred because a dependency did, or an older worker sent no times."""
    for startstop in startstops or ():
        if startstop.get("action") == "compute" and startstop.get("stop"):
            return startstop.get("start") or 0.0, startstop["stop"]
    return 0.0, time()


_GROUP = attrgetter("group")

#: TaskGroup states in which a task has yet to finish: ``TaskGroup.done`` is "no
#: task in any of these"
_PENDING = tuple(sorted(ALL_TASK_STATES - {"memory", "erred", "released", "forgotten"}))


#: ``dask.tasks.<state>`` by state: built once, not per span
_STATE_NAMES = {state: f"dask.tasks.{state}" for state in ALL_TASK_STATES}


def _state_name(state: str) -> str:
    name = _STATE_NAMES.get(state)
    return f"dask.tasks.{state}" if name is None else name


def code_snippets(span: Span) -> tuple[str, ...]:
    """The source of ``Span.code``'s snippets. distributed 2024.1 keeps
    each block of them still wrapped in the ``ToPickle`` the client sent."""
    return tuple(
        sc.code
        for block in span.code
        for sc in (block.data if isinstance(block, ToPickle) else block)
    )


def group_done(tg: TaskGroup) -> bool:
    """``TaskGroup.done``, in a quarter of the time: polls ask it of every open group"""
    states = tg.states
    for state in _PENDING:
        if states.get(state):
            return False
    return True


def groups_stop(groups: Iterable[TaskGroup]) -> float | None:
    """When the last task of some TaskGroups finished, or None if one is not done"""
    stop = 0.0
    for tg in groups:
        if not group_done(tg):
            return None
        if tg.stop > stop:
            stop = tg.stop
    return stop


class Totals:
    """What a Dask span's attributes sum over TaskGroups and fine metrics: of its
    own groups, or of its whole subtree.

    A span's subtree totals are its own plus its sub-spans' subtree totals. The
    mirror sums those as the sub-spans are exported (:attr:`SpanMirror.folded`),
    so exporting a span reads its own groups and metrics only, however deep and
    wide its tree. Task counts by state are each sub-span's as of its export.
    """

    __slots__ = ("duration", "execute_seconds", "metrics", "nbytes", "start", "states", "stop")

    def __init__(self) -> None:
        self.states: dict[str, int] = {}
        self.nbytes = 0
        self.duration = 0.0
        #: when the first task started (0: none has), as ``Span.start``
        self.start = 0.0
        #: when the last task finished, as ``Span.stop`` of a finished span
        self.stop = 0.0
        #: ``dask.metrics.*`` attributes, summed over task prefixes
        self.metrics: dict[str, float] = {}
        #: seconds of the execute context, for "idle or other spans"
        self.execute_seconds = 0.0

    @classmethod
    def own(cls, span: Span, metrics: SpanMetrics | None = None) -> Totals:
        """Of a span's own groups and fine metrics (``metrics``, if already
        read)"""
        totals = cls()
        totals.add_groups(span.groups)
        if metrics is None:
            metrics = SpanMetrics.of(span)
        totals.metrics = dict(metrics.total)
        totals.execute_seconds = metrics.execute_seconds
        return totals

    def add_groups(self, groups: Iterable[TaskGroup]) -> None:
        states = self.states
        for tg in groups:
            for state, n in tg.states.items():
                if n:
                    states[state] = states.get(state, 0) + n
            self.nbytes += tg.nbytes_total
            self.duration += tg.duration
            self._started(tg.start)
            if tg.stop > self.stop:
                self.stop = tg.stop

    def _started(self, start: float) -> None:
        if start and (not self.start or start < self.start):
            self.start = start

    def add(self, other: Totals) -> None:
        for state, n in other.states.items():
            self.states[state] = self.states.get(state, 0) + n
        for name, value in other.metrics.items():
            self.metrics[name] = self.metrics.get(name, 0) + value
        self.nbytes += other.nbytes
        self.duration += other.duration
        self.execute_seconds += other.execute_seconds
        self._started(other.start)
        if other.stop > self.stop:
            self.stop = other.stop

    def attributes(self) -> dict[str, Any]:
        """Task counts by state, output bytes, duration; fine metrics apart"""
        out: dict[str, Any] = {_state_name(s): n for s, n in self.states.items()}
        out["dask.tasks.total"] = sum(self.states.values())
        out["dask.output.bytes"] = self.nbytes
        out["dask.duration"] = self.duration
        return out


def subtree_totals(span: Span) -> Totals:
    """:class:`Totals` of a span and all its sub-spans, by walking the tree"""
    totals = Totals.own(span)
    for child in span.children:
        totals.add(subtree_totals(child))
    return totals


def group_attributes(tg: TaskGroup) -> dict[str, Any]:
    """Task counts by state, output bytes and duration of one TaskGroup"""
    out: dict[str, Any] = {}
    total = 0
    for state, n in tg.states.items():
        if n:
            out[_state_name(state)] = n
            total += n
    out["dask.tasks.total"] = total
    out["dask.output.bytes"] = tg.nbytes_total
    out["dask.duration"] = float(tg.duration)  # an int 0 in distributed 2024.1
    return out


def prefix_metrics(span: Span, prefix: Hashable) -> dict[str, float]:
    """``dask.metrics.*`` of one task prefix within one Dask span (its own, no
    sub-spans')"""
    return SpanMetrics.of(span).by_prefix.get(prefix, {})


class GroupBatch:
    """A TaskGroup seen and not yet exported: the Dask span it belongs to, and what
    its next export covers.

    A group's first export covers all of it. Then the mirror forgets it; if new
    tasks join it later (:meth:`SpanMirror.observe_graph`: ``client.submit(f, x)``
    without ``key=`` puts every call of ``f`` in one TaskGroup), it opens again
    with a snapshot of its cumulative values, so that its next export covers only
    the tasks that ran since, as a new child span. The snapshot is kept only while
    the group is open.
    """

    __slots__ = (
        "busy", "duration", "erred", "failed", "metrics", "nbytes", "since", "span",
        "started", "states", "total", "wake",
    )

    #: The Dask span the group belongs to (``TaskGroup.span_id``)
    span: Span
    #: When new work joined an exported group (0: the group's first batch, which
    #: starts at ``TaskGroup.start``)
    since: float
    #: ``TaskGroup.states`` when the group opened again (None: first batch)
    states: dict[str, int] | None
    #: Tasks of the group then, less those the new graph (re)runs
    total: int
    #: ``TaskGroup.nbytes_total`` and ``TaskGroup.duration`` then
    nbytes: int
    duration: float
    #: ``dask.metrics.*`` of the group's prefix within its span then
    metrics: dict[str, float]
    #: Tasks of this batch that erred (transitions seen), and when the last did (0:
    #: none), and when the first of them started running (0: none did): Dask
    #: records no run time for an erred task
    erred: int
    failed: float
    started: float
    #: When a poll last found the group still running (0: never). Its last task
    #: finishes later, so it cannot be ready until ``otel.spans.export-delay``
    #: after that
    busy: float
    #: The earliest time the group can be ready, as the last poll that looked at
    #: it found: ``otel.spans.export-delay`` after its end or after ``busy``.
    #: Polls pass it over until then, at the cost of one comparison, so that a
    #: cluster with many long-running workflows open pays per group that may be
    #: ready, not per open group. A group's end only moves later (but for a
    #: worker's clock running behind the scheduler's, which delays a look by at
    #: most the difference), so no group is looked at later than it would be
    #: without this.
    wake: float

    def __init__(self, span: Span):
        self.span = span
        self.busy = self.wake = 0.0
        self.since = 0.0
        self.states = None
        self.total = self.nbytes = 0
        self.duration = 0.0
        self.metrics = {}
        self.erred = 0
        self.failed = self.started = 0.0

    @classmethod
    def reopened(cls, tg: TaskGroup, span: Span, rerun: int) -> GroupBatch:
        """A batch of new work in a group that was exported: ``rerun`` tasks of
        the new graph are to run"""
        batch = cls(span)
        batch.since = time()
        batch.states = dict(tg.states)
        batch.total = sum(batch.states.values()) - rerun
        batch.nbytes = tg.nbytes_total
        batch.duration = tg.duration
        batch.metrics = prefix_metrics(span, tg.prefix.name)
        return batch

    def start(self, tg: TaskGroup) -> float:
        """When the batch started: a later batch when its graph arrived, a first
        one when its first task, finished or failed, started (0: none did)"""
        if self.since:
            return self.since
        if tg.start and self.started:
            return min(tg.start, self.started)
        return tg.start or self.started

    def end(self, tg: TaskGroup) -> float:
        """When the group's last task finished or failed (0: none did yet; for a
        later batch, a finish before the batch may show until its tasks end)"""
        return max(tg.stop, self.failed)

    def attributes(self, tg: TaskGroup, metrics: Mapping[str, float]) -> dict[str, Any] | None:
        """Task counts, bytes, duration and fine metrics of the batch, given the
        group's prefix metrics within its span now; None for a later batch in
        which nothing ran (its tasks were merely requested again)"""
        if self.states is None:
            out = group_attributes(tg)
            out.update(metrics)
            return out
        base = self.states
        out: dict[str, Any] = {
            _state_name(state): n - base.get(state, 0)
            for state, n in tg.states.items()
            if n > base.get(state, 0)
        }
        out["dask.tasks.total"] = total = sum(tg.states.values()) - self.total
        out["dask.output.bytes"] = max(tg.nbytes_total - self.nbytes, 0)
        out["dask.duration"] = duration = max(float(tg.duration) - self.duration, 0.0)
        if total <= 0 and duration <= 0 and not self.erred:
            return None
        for name, value in metrics.items():
            if (delta := value - self.metrics.get(name, 0)) > 0:
                out[name] = delta
        return out



class SpanHead:
    """What the OTel spans of one Dask span and of its TaskGroups share: worked
    out once per poll, which usually exports a span's groups together"""

    __slots__ = ("context", "start", "tags")

    #: The Dask span's OTel SpanContext (the parent of its TaskGroups' spans);
    #: None if the sampler drops its trace
    context: SpanContext | None
    #: Where its OTel span starts (:meth:`SpanMirror.span_start`)
    start: float
    #: ``Span.name`` as an attribute value
    tags: tuple[str, ...]

    def __init__(self, context: SpanContext | None, start: float, tags: tuple[str, ...]):
        self.context = context
        self.start = start
        self.tags = tags


def _erred_status(attributes: dict[str, Any], erred: int) -> Status | None:
    """Record the erred count and return the ERROR status, if any task erred.

    ``erred`` counts the erred transitions the mirror saw; the state count alone
    would miss tasks whose futures the client released before the export.
    """
    erred = max(erred, attributes.get("dask.tasks.erred", 0))
    if not erred:
        return None
    attributes["dask.tasks.erred"] = erred
    return Status(StatusCode.ERROR, f"{erred} tasks erred")


class SpanMirror:
    """Watches the scheduler's SpansSchedulerExtension and exports each Dask span
    and each batch of a TaskGroup once it has finished.

    Work per :meth:`poll` is proportional to the spans and groups not yet exported;
    memory likewise: nothing is kept about what has been exported, or dropped by
    the sampler.
    """

    scheduler: Scheduler
    telemetry: Telemetry
    config: OtelConfig

    #: Dask spans seen and not yet exported, by id
    open_spans: dict[str, Span]
    #: TaskGroups seen and not yet exported, with the Dask span each belongs to
    #: and what their next export covers
    open_groups: dict[TaskGroup, GroupBatch]
    #: ``len(SpansSchedulerExtension.spans)`` when last looked at. Dask never deletes
    #: a span and dicts keep insertion order, so the spans created since are the
    #: ones past this count.
    spans_seen: int

    #: Tasks that transitioned to erred, by open Dask span id (each span counts its
    #: subtree's, or its own with ``otel.spans.totals: own``)
    erred: defaultdict[str, int]
    #: By open Dask span id: the latest end of its exported children (sub-spans and
    #: TaskGroup spans) and failure of its own tasks. Its own end is no earlier:
    #: every child exported before its parent lies within it.
    ends: dict[str, float]

    #: By open Dask span id: how many of its sub-spans are open. A span is done
    #: when none is and its own groups are: polls never walk a span's tree.
    open_children: dict[str, int]
    #: By open Dask span id: how many of its TaskGroups are open
    open_groups_of: dict[str, int]
    #: The open Dask spans with no open sub-span and no open TaskGroup: the only
    #: ones that can be ready (a span finishes no earlier than its groups, which
    #: are exported first), so the only ones a poll looks at. 1,000 long-running
    #: workflows cost a poll nothing while their groups run.
    idle: dict[str, Span]
    #: By open Dask span id: the subtree totals of its sub-spans exported so far,
    #: summed. One per open span with finished steps, however many steps: a
    #: pipeline of 10,000 steps is summed as it goes, not walked when it ends.
    folded: dict[str, Totals]

    #: Fine metrics of the Dask spans this poll exports something of
    _metrics: dict[str, SpanMetrics]
    #: What the OTel spans of a Dask span and its TaskGroups share, by Dask span id,
    #: for the Dask spans this poll exports something of (:meth:`_head`)
    _heads: dict[str, SpanHead]

    #: By open root Dask span id: the caller's span it continues (from the ``otel``
    #: annotation's carrier, extracted once), None if there is none. Dropped when
    #: the root is exported.
    remote_parents: dict[str, SpanContext | None]
    #: The same for roots already exported when more work came under them: at
    #: most ``MAX_REOPENED_ROOTS``, oldest forgotten first
    reopened_parents: dict[str, SpanContext | None]
    #: By open Dask span id: the earliest client time a ``dask_otel.span`` block of
    #: it or of one of its sub-spans was entered. Dropped when it is exported.
    entered: dict[str, float]
    #: By open Dask span id: links to the Dask spans of other traces whose data its
    #: tasks consume (:mod:`dask_otel.links`), by producer span id. Dropped when it
    #: is exported.
    links: dict[str, dict[str, Link]]

    #: Counters for the bridge's self-metrics: spans and TaskGroup batches handed to
    #: the SDK, dropped by the sampler, and groups that got work after their export
    mirrored: int
    sampled_out: int
    reopened: int

    def __init__(self, scheduler: Scheduler, telemetry: Telemetry, config: OtelConfig):
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.config = config
        self.open_spans = {}
        self.open_groups = {}
        self.erred = defaultdict(int)
        self.ends = {}
        self.open_children = defaultdict(int)
        self.open_groups_of = defaultdict(int)
        self.idle = {}
        self.folded = {}
        self._metrics = {}
        self._heads = {}
        self._sink: SpanSink | None = None
        self.remote_parents = {}
        self.reopened_parents = {}
        self.entered = {}
        self.links = {}
        self._random = random.Random()
        self.mirrored = 0
        self.sampled_out = 0
        self.reopened = 0
        ext = self.extension
        if ext is None:
            self.spans_seen = 0
            return
        # A cluster instrumented while running: follow what is still in flight
        self.spans_seen = len(ext.spans)
        for span in ext.spans.values():
            if not span.done:  # Dask's own walk, once
                self._open(span)
                for tg in span.groups:
                    if not group_done(tg):
                        self._open_group(tg, GroupBatch(span))
        # Steps that finished before: walked once, now
        for span in self.open_spans.values():
            for child in span.children:
                if child.id not in self.open_spans:
                    self._fold(span.id, subtree_totals(child))
                    self._end_no_earlier(span.id, child.stop)

    @property
    def sink(self) -> SpanSink:
        # Telemetry.spans takes a lock: look it up once
        sink = self._sink
        if sink is None:
            sink = self._sink = self.telemetry.spans
        return sink  # type: ignore[return-value]

    @property
    def extension(self) -> SpansSchedulerExtension | None:
        return self.scheduler.extensions.get("spans")

    # --- discovery ---------------------------------------------------------------

    def observe_new_spans(self) -> None:
        """Open the Dask spans created since the last look"""
        ext = self.extension
        if ext is None or len(ext.spans) == self.spans_seen:
            return
        new = len(ext.spans) - self.spans_seen
        self.spans_seen = len(ext.spans)
        # In creation order, as in Dask: a parent before its sub-spans
        for span in reversed(list(islice(reversed(ext.spans.values()), new))):
            self._open(span)

    def _open(self, span: Span) -> None:
        self.open_spans[span.id] = span
        self.idle[span.id] = span
        parent = span.parent
        if parent is not None and parent.id in self.open_spans:
            self.open_children[parent.id] += 1
            self.idle.pop(parent.id, None)

    def _close(self, span: Span) -> None:
        del self.open_spans[span.id]
        self.idle.pop(span.id, None)
        self.open_children.pop(span.id, None)
        self.open_groups_of.pop(span.id, None)
        parent = span.parent
        if parent is not None and parent.id in self.open_children:
            left = self.open_children[parent.id] = self.open_children[parent.id] - 1
            if left <= 0:
                del self.open_children[parent.id]
                self._maybe_idle(parent)

    def _open_group(self, tg: TaskGroup, batch: GroupBatch) -> None:
        self.open_groups[tg] = batch
        span_id = batch.span.id
        if span_id in self.open_spans:
            self.open_groups_of[span_id] += 1
            self.idle.pop(span_id, None)

    def _close_group(self, tg: TaskGroup) -> GroupBatch:
        batch = self.open_groups.pop(tg)
        span_id = batch.span.id
        if span_id in self.open_groups_of:
            left = self.open_groups_of[span_id] = self.open_groups_of[span_id] - 1
            if left <= 0:
                del self.open_groups_of[span_id]
                self._maybe_idle(batch.span)
        return batch

    def _maybe_idle(self, span: Span) -> None:
        span_id = span.id
        if (
            span_id in self.open_spans
            and not self.open_children.get(span_id)
            and not self.open_groups_of.get(span_id)
        ):
            self.idle[span_id] = span

    def finished_at(self, span: Span) -> float | None:
        """When an open span finished if ``Span.done``, else None: its own groups'
        stop, its exported children's ends and its own tasks' failures (Dask's
        ``Span.stop`` knows neither), never before ``Span.enqueued``"""
        if self.open_children.get(span.id):
            return None
        stop = groups_stop(span.groups)
        if stop is None:
            return None
        return max(stop, self.ends.get(span.id, 0.0), span.enqueued)

    def observe_graph(self, keys: Iterable[Hashable]) -> None:
        """Open the TaskGroups of a graph that just reached the scheduler.

        Called from ``SchedulerPlugin.update_graph``, after Dask attached the tasks
        to their spans and before they run (new tasks are still ``released``). A
        group that is not open and has tasks from before this graph was exported
        (or ran before the bridge started): it opens again as a new batch, which is
        exported only if some task runs or errs in it.
        """
        ext = self.extension
        if ext is None:
            return
        self.observe_new_spans()
        # One task per group of the graph (the first), whose annotations are
        # those of all, and how many of the graph's tasks each group has. In C
        # (map, zip, Counter): this runs for every key of every graph.
        tss = [ts for ts in map(self.scheduler.tasks.get, keys) if ts is not None]
        groups = list(map(_GROUP, tss))
        first = dict(zip(reversed(groups), reversed(tss)))
        in_graph: Counter[TaskGroup] | None = None
        rerun: dict[TaskGroup, int] | None = None
        for tg, ts in first.items():
            if tg in self.open_groups or tg.span_id is None:
                continue
            span = ext.spans.get(tg.span_id)
            if span is None:
                continue
            states = tg.states
            total = sum(states.values())
            if in_graph is None:
                in_graph = Counter(groups)
            if not tg.stop and states.get("released", 0) == total == in_graph[tg]:
                # A new group: every task released, and in this graph
                self._open_group(tg, GroupBatch(span))
            else:
                if rerun is None:  # tasks of each group this graph (re)runs
                    rerun = Counter(g for g, t in zip(groups, tss) if t.state == "released")
                self._open_group(tg, GroupBatch.reopened(tg, span, rerun[tg]))
            self.observe_otel_annotation(ts)
            self._observe_links(ts, span)
            if span.id not in self.open_spans:
                # New work on a span that was already exported: its groups are
                # still exported as its children; the span itself is not again.
                self.reopened += 1

    def _observe_links(self, ts: TaskState, span: Span) -> None:
        """Links from an open Dask span to the spans of other traces that produced
        the inputs of ``ts``, one task of a TaskGroup it just got"""
        if not ts.dependencies or span.id not in self.open_spans:
            return
        links = self.links.setdefault(span.id, {})
        producer_links(ts, root_span(span), self.extension, links, self._sampled)
        if not links:
            del self.links[span.id]

    def _sampled(self, trace_id: int, root_tag: str, parent: SpanContext | None) -> bool:
        return trace_sampled(self.sink.sampler, trace_id, root_tag, parent)

    def observe_otel_annotation(self, ts: TaskState) -> None:
        """Read the ``otel`` annotation that ``dask_otel.span`` put on a task: when
        its blocks were entered, and the caller's span its root continues.

        Only spans still open are remembered. ``ts.annotations["span"]`` is the
        span of the task's group (Dask moves a task onto the span of the first
        TaskGroup of its key prefix); a carrier is taken for that root only if the
        annotation's own blocks include it, so a colliding task cannot bring
        another workflow's caller.
        """
        annotations = ts.annotations
        otel = annotations.get(ANNOTATION) if annotations else None
        span_annotation = annotations.get("span") if otel else None
        if not isinstance(otel, Mapping) or not isinstance(span_annotation, Mapping):
            return  # none, or an "otel" annotation someone else made: not ours
        ids = span_annotation.get("ids")
        entered = otel.get("entered")
        if not ids or not isinstance(entered, Mapping):
            return
        self._observe_entered(ids, entered)
        root_id = ids[0]
        if root_id not in entered:
            return  # the root is a distributed.span: its own trace
        carrier = root_carrier(otel, root_id)
        if root_id in self.open_spans:
            if root_id not in self.remote_parents:
                self.remote_parents[root_id] = remote_parent(carrier)
        elif root_id not in self.reopened_parents:
            if len(self.reopened_parents) >= MAX_REOPENED_ROOTS:
                del self.reopened_parents[next(iter(self.reopened_parents))]
            self.reopened_parents[root_id] = remote_parent(carrier)

    def _observe_entered(self, ids: tuple[str, ...], entered: Mapping[str, float]) -> None:
        """Keep, for each open span of ``ids`` (root first), the earliest time a
        block of it or of a span below it was entered: a parent then never starts
        after its children"""
        earliest = float("inf")
        for span_id in reversed(ids):  # innermost first: ancestors take the minimum
            t = entered.get(span_id)
            if isinstance(t, (int, float)):
                earliest = min(earliest, t)
            if span_id in self.open_spans and earliest < self.entered.get(span_id, earliest + 1):
                self.entered[span_id] = earliest

    def remote_parent(self, root_id: str) -> SpanContext | None:
        """The caller's span a root Dask span continues, if it was opened with
        ``dask_otel.span`` under a valid current span"""
        if root_id in self.remote_parents:
            return self.remote_parents[root_id]
        return self.reopened_parents.get(root_id)

    def started_at(self, span: Span) -> float:
        """When a Dask span starts: ``Span.enqueued``, or earlier if a client entered
        a ``dask_otel.span`` block of it, or of a span below it, before that"""
        entered = self.entered.get(span.id)
        return span.enqueued if entered is None else min(span.enqueued, entered)

    def _forget_exported(self, span: Span) -> None:
        """Drop what was kept about a span until its export"""
        self.entered.pop(span.id, None)
        self.remote_parents.pop(span.id, None)
        self.links.pop(span.id, None)

    def observe_erred(self, key: Hashable, failed: float, started: float = 0.0) -> None:
        """A task erred at ``failed`` (having started to run at ``started``, 0 if
        it did not run): count it for its open group and open spans (Dask's own
        state counts forget it once the client releases the future), and let its
        group and span end no earlier"""
        ts = self.scheduler.tasks.get(key)
        ext = self.extension
        if ts is None or ext is None:
            return
        tg = ts.group
        if (batch := self.open_groups.get(tg)) is not None:
            batch.erred += 1
            batch.failed = max(batch.failed, failed)
            if started and (not batch.started or started < batch.started):
                batch.started = started
        span = ext.spans.get(tg.span_id) if tg.span_id else None
        if span is not None and span.id in self.open_spans:
            self._end_no_earlier(span.id, failed)
        while span is not None:
            if span.id in self.open_spans:
                self.erred[span.id] += 1
            if self.config.span_totals == "own":
                break
            span = span.parent

    def _end_no_earlier(self, span_id: str, end: float) -> None:
        if end > self.ends.get(span_id, 0.0):
            self.ends[span_id] = end

    # --- export ------------------------------------------------------------------

    def poll(self) -> bool:
        """Export the open spans and groups that are finished, on the event loop.

        Stops after ``POLL_BUDGET`` seconds so as not to hold the event loop when
        many spans finish at once; returns True if there is more to do (the plugin
        then polls again on the next turn of the loop).
        """
        self.observe_new_spans()
        now = time()
        deadline = perf_counter() + POLL_BUDGET
        heard = min(
            (ws.last_seen for ws in self.scheduler.workers.values()), default=now
        )
        delay, timeout = self.config.export_delay, self.config.metrics_timeout
        try:
            due = [item for item in self.open_groups.items() if item[1].wake <= now]
            for tg, batch in due:
                # The cheap tests first (as _ready): its last task finished, or
                # it was still running, lately; then Dask's states
                end = max(batch.end(tg) or batch.since or batch.span.enqueued, batch.busy)
                waited = now - end
                if waited < delay:
                    batch.wake = end + delay
                    continue
                if heard <= end and waited < timeout:
                    continue  # a worker may still report its metrics: next poll
                if not group_done(tg):
                    batch.wake = now + delay
                    batch.busy = now
                    continue
                self._close_group(tg)
                self._export(self.mirror_group, tg, batch)
                if perf_counter() > deadline:
                    return True
            # Spans: only those with nothing open below them. A parent becomes
            # idle when its last sub-span is exported, and is looked at next, so
            # that its subtree totals and end include the sub-span's.
            pending = list(self.idle.values())
            while pending:
                span = pending.pop()
                stop = self.finished_at(span)
                if stop is not None and self._ready(stop, now, heard):
                    self._close(span)
                    self._export(self.mirror_span, span, stop)
                    parent = span.parent
                    if parent is not None and parent.id in self.idle:
                        pending.append(parent)
                    if perf_counter() > deadline:
                        return True
            return False
        finally:
            self._metrics.clear()
            self._heads.clear()

    def _ready(self, stop: float, now: float, heard: float) -> bool:
        waited = now - stop
        return waited >= self.config.export_delay and (
            heard > stop or waited >= self.config.metrics_timeout
        )

    def flush(self) -> None:
        """Export everything still open, finished or not (the scheduler is closing)"""
        self.observe_new_spans()
        for tg, batch in list(self.open_groups.items()):
            self._close_group(tg)
            self._export(self.mirror_group, tg, batch)
        for span in reversed(list(self.open_spans.values())):
            stop = self.finished_at(span)
            self._close(span)
            self._export(self.mirror_span, span, stop or time(), unfinished=stop is None)
        self.open_groups.clear()
        self.open_children.clear()
        self.open_groups_of.clear()
        self.idle.clear()
        self.folded.clear()
        self.erred.clear()
        self.ends.clear()
        self._metrics.clear()
        self._heads.clear()
        self.remote_parents.clear()
        self.reopened_parents.clear()
        self.entered.clear()
        self.links.clear()

    def _export(self, mirror: Any, *args: Any, **kwargs: Any) -> None:
        # Telemetry must never take the scheduler down: a span that cannot be
        # mirrored is logged and dropped.
        try:
            emitted = mirror(*args, **kwargs)
        except Exception:
            logger.exception("dask_otel: could not mirror %r; dropped", args[0])
            return
        if emitted:
            self.mirrored += 1
        elif emitted is not None:
            self.sampled_out += 1

    def _trace_id(self, span: Span) -> int | None:
        """The trace id of a span's tree, or None if the sampler drops that trace.

        One decision per trace, the same for every span of it and in every
        process (:func:`dask_otel.sampling.trace_sampled`, asked with the root
        Dask span's first tag, which every task of the trace knows).
        """
        root = root_span(span)
        # The caller's trace if the root continues one, else the root's UUID
        parent = self.remote_parent(root.id)
        trace_id = trace_id_of(root.id, parent)
        if not trace_sampled(self.sink.sampler, trace_id, str(root.name[0]), parent):
            return None
        return trace_id

    def _span_metrics(self, span: Span) -> SpanMetrics:
        """:class:`SpanMetrics` of a Dask span, read once per poll"""
        metrics = self._metrics.get(span.id)
        if metrics is None:
            metrics = self._metrics[span.id] = SpanMetrics.of(span)
        return metrics

    def _head(self, span: Span) -> SpanHead:
        """The :class:`SpanHead` of a Dask span, once per poll"""
        head = self._heads.get(span.id)
        if head is None:
            trace_id = self._trace_id(span)
            context = (
                SpanContext(trace_id, otel_span_id(span.id), False, _SAMPLED)
                if trace_id is not None
                else None
            )
            head = self._heads[span.id] = SpanHead(
                context, self.span_start(span), tuple(span.name)
            )
        return head

    def _own_start(self, span: Span) -> float:
        """When a Dask span started, before clamping into its parent: see
        :meth:`started_at`"""
        return self.started_at(span)

    def span_start(self, span: Span) -> float:
        """Where the OTel span of a Dask span starts: its own start, no earlier than
        any ancestor's (as Dask clamps ``Span.start``), so that a child starts
        within its parent; it walks the span's ancestors, never its subtree"""
        start = self._own_start(span)
        parent = span.parent
        while parent is not None:
            start = max(start, self._own_start(parent))
            parent = parent.parent
        return start

    def _bounded_links(self, links: dict[str, Link] | None) -> tuple[Link, ...]:
        if not links:
            return ()
        sink = self.sink
        count = sink.limits.max_link_attributes
        return tuple(
            Link(link.context, sink.event_attributes(dict(link.attributes), count))
            for link in links.values()
        )

    def _emit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start: float,
        end: float,
        attributes: dict[str, Any],
        status: Status | None,
        events: tuple[Event, ...] = (),
        links: tuple[Link, ...] = (),
    ) -> None:
        """Hand one finished span to the SDK's processors, with the attribute
        count and length limits the SDK's own spans get (``SpanLimits``)"""
        sink = self.sink
        sink.emit(
            ReadableSpan(
                _name(name),
                context=context,
                parent=parent,
                resource=sink.resource,
                attributes=sink.bounded(attributes),
                links=links,
                events=events,
                status=status or _UNSET,
                start_time=_ns(start),
                end_time=_ns(max(end, start)),
                instrumentation_scope=sink.scope,
            )
        )

    def totals(self, span: Span, folded: Totals | None) -> tuple[Totals, Totals]:
        """A span's own totals and its subtree's: its own plus its sub-spans',
        ``folded`` in as each was exported (sub-spans are exported before their
        parent)."""
        own = subtree = Totals.own(span, self._span_metrics(span))
        if folded is not None:
            folded.add(own)
            subtree = folded
        return own, subtree

    def _fold(self, span_id: str, totals: Totals) -> None:
        folded = self.folded.get(span_id)
        if folded is None:
            folded = self.folded[span_id] = Totals()
        folded.add(totals)

    def _fold_into_parent(self, span: Span, end: float, totals: Totals | None = None) -> None:
        """An exported child's end (and a sub-span's subtree totals) into its
        parent's, if the parent is still open: the parent then lies around it"""
        if span.id in self.open_spans:
            self._end_no_earlier(span.id, end)
            if totals is not None:
                self._fold(span.id, totals)

    def mirror_span(self, span: Span, stop: float, unfinished: bool = False) -> bool:
        """Export one Dask span as an OTel span with the ids derived from its UUID.

        Returns False, keeping nothing, if the sampler drops its trace (and so
        its parent's).
        """
        folded = self.folded.pop(span.id, None)
        erred = self.erred.pop(span.id, 0)
        end = max(stop, self.ends.pop(span.id, 0.0))
        head = self._head(span)
        parent = span.parent
        remote = self.remote_parent(span.id) if parent is None else None
        links = self._bounded_links(self.links.get(span.id))
        self._forget_exported(span)  # also when sampled out
        if head.context is None:
            return False
        start = head.start
        own, subtree = self.totals(span, folded)
        end = max(end, start)
        if parent is not None:
            self._fold_into_parent(parent, end, subtree)
        totals = subtree if self.config.span_totals == "subtree" else own
        active = active_cpu_seconds(span, end)
        attributes = {"dask.span.id": span.id, "dask.span.name": head.tags}
        attributes.update(totals.attributes())
        attributes["dask.active_cpu_seconds"] = active
        attributes.update(totals.metrics)
        if self.config.span_totals == "subtree":
            # As Span.cumulative_worker_metrics: thread time no task accounts for
            if (idle := active - totals.execute_seconds) > 0:
                attributes[_IDLE] = idle
        first_task = subtree.start and min(max(subtree.start, start), end)
        if self.config.export_code:
            attributes["dask.span.code"] = code_snippets(span)
        if unfinished:
            attributes["dask.span.unfinished"] = True
        status = _erred_status(attributes, erred)
        events = (
            (Event("dask.first_task_start", NO_ATTRIBUTES, _ns(first_task)),)
            if first_task
            else ()
        )
        self._emit(
            span.name[-1],
            head.context,
            self._head(parent).context if parent is not None else remote,
            start,
            end,
            attributes,
            status,
            events,
            links,
        )
        return True

    def mirror_group(self, tg: TaskGroup, batch: GroupBatch) -> bool | None:
        """Export one batch of a TaskGroup as a child of the OTel span of its Dask
        span, from its first task's start (a later batch: from when its graph
        arrived) to when its last task finished or failed, clamped into the Dask
        span's start. Returns False if the sampler drops the trace, None if
        nothing ran in a later batch; keeps nothing about the group either way."""
        span = batch.span
        prefix = tg.prefix.name
        counts = batch.attributes(tg, self._span_metrics(span).by_prefix.get(prefix, {}))
        if counts is None:
            return None
        head = self._head(span)
        parent = head.context
        if parent is None:
            return False
        attributes = {
            "dask.span.id": span.id,
            "dask.span.name": head.tags,
            "dask.taskgroup.name": str(tg.name),
            "dask.taskgroup.prefix": str(prefix),
        }
        attributes.update(counts)
        status = _erred_status(attributes, batch.erred)
        start = max(batch.start(tg) or span.enqueued, head.start)
        end = max(batch.end(tg) if group_done(tg) else time(), start)
        self._fold_into_parent(span, end)
        self._emit(
            str(prefix),
            SpanContext(parent.trace_id, self._random.getrandbits(64) or 1, False, _SAMPLED),
            parent,
            start,
            end,
            attributes,
            status,
        )
        return True
