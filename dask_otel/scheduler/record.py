"""What the bridge keeps about what is open: a :class:`SpanRecord` per open Dask
span (everything the hooks learn of it that Dask does not keep, with its own
writers), a :class:`GroupBatch` per open TaskGroup batch, and the
:class:`SpanHead` a poll works out once. Forgetting a span is one deletion.
docs/traces.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.metrics import time

from dask_otel._compat import span_own_metrics
from dask_otel.scheduler.totals import SpanMetrics, group_done, observed

if TYPE_CHECKING:
    from collections.abc import Mapping

    from distributed.scheduler import TaskGroup
    from distributed.spans import Span
    from opentelemetry.trace import Link, SpanContext

    from dask_otel.scheduler.totals import Failure

#: Span events kept per Dask span (``dask.worker.lost``): a span whose workers keep
#: dying would otherwise grow without bound
MAX_SPAN_EVENTS = 16
#: ``exception`` events (``Failure.event``) per TaskGroup batch and per root span
MAX_FAILURE_EVENTS = 3


@dataclass(slots=True)
class SpanHead:
    """What the OTel spans of one Dask span and of its TaskGroups share: worked
    out once per poll, which usually exports a span's groups together"""

    #: The Dask span's OTel SpanContext (the parent of its TaskGroups' spans);
    #: None if the sampler drops its trace, or traces are off
    context: SpanContext | None
    #: Where its OTel span starts (``Ledger.span_start``)
    start: float
    #: ``Span.name`` as an attribute value
    tags: tuple[str, ...]
    #: Its record's labels, on its TaskGroups' spans too (None: none)
    labels: dict[str, Any] | None = None
    #: A run the sampler dropped that ``otel.traces.keep`` may keep: its root
    #: record's ``held`` (its readings wait there for the root's end); else None
    held: list[Any] | None = None


@dataclass(slots=True, eq=False)
class SpanRecord:
    """One open Dask span: created when the mirror first sees it, taken whole
    when it is exported (or dropped by the sampler)."""

    #: The Dask span (``SpansSchedulerExtension.spans[id]``)
    span: Span
    #: Its open sub-spans and TaskGroup batches: it can be ready only when both
    #: are 0, so polls never walk its tree
    open_children: int = 0
    open_groups: int = 0
    #: Tasks that erred in its subtree (its own with ``otel.spans.totals: own``):
    #: Dask's state counts forget one once its future is released
    erred: int = 0
    #: ``error.type`` of the first of them (:attr:`~dask_otel.scheduler.totals.Failure.kind`)
    error_type: str | None = None
    #: The latest end of its exported children and failure of its own tasks: its
    #: own end is no earlier (Dask's ``Span.stop`` knows neither)
    end: float = 0.0
    #: The earliest client time a ``dask_otel.span`` block of it or of a span
    #: below it was entered (the ``otel`` annotation's ``entered``); None: none
    entered: float | None = None
    #: When the client left its ``dask_otel.span`` block (client time; 0: not
    #: yet); the client whose block is open (None: no block waits for an exit),
    #: and the client that sent the exit (None: unknown, or none yet)
    exited: float = 0.0
    block_client: str | None = None
    exit_client: str | None = None
    #: When ``block_client`` left the scheduler with the block open, while its exit
    #: may still come (``blocks.CLIENT_GONE_GRACE``; 0: it did not)
    client_left: float = 0.0
    #: Roots: the caller's span it continues (the ``otel`` carrier, read once)
    remote_parent: SpanContext | None = None
    carrier_read: bool = False
    #: Links to the Dask spans of other traces whose data its tasks consume, by
    #: producer Dask span id (:mod:`dask_otel.scheduler.links`)
    links: dict[str, Link] | None = None
    #: Something below it went to the builder's queue: a full queue keeps it
    child_kept: bool = False
    #: Span events to export with it, ``(name, attributes, time in ns)``, at most
    #: :data:`MAX_SPAN_EVENTS` (``dask.worker.lost``); None: none
    events: list[tuple[str, dict[str, Any], int]] | None = None
    #: Roots, as a workflow run (:mod:`dask_otel.scheduler.outcomes`): its name is
    #: bounded (a root block opened with ``workflow=True``); a task anywhere in
    #: its tree erred, whatever ``otel.spans.totals``; its client left with its
    #: block open
    workflow: bool = False
    run_erred: bool = False
    cancelled: bool = False
    #: Dask made no span of its block (the TaskGroup collision): the mirror did
    collided: bool = False
    #: Roots of a run the sampler dropped, as ``otel.traces.keep`` asks: the readings
    #: of its subtree, held until its end decides (None: not held), and why it was
    #: kept then (``erred``, ``slow``; None: dropped, or sampled)
    held: list[Any] | None = None
    kept: str | None = None
    #: Roots: the root block's ``keep=`` (``otel.traces.keep.*`` by last part; None: none)
    keep: Mapping[str, Any] | None = None
    #: Its block's labels (``Block.labels``: of its tasks' or its exit's); None: none
    labels: dict[str, Any] | None = None

    @property
    def leaf(self) -> bool:
        """Nothing below it is open: it may be ready"""
        return not self.open_children and not self.open_groups

    def finished_at(self) -> float | None:
        """When the span finished if ``Span.done`` and its block (if announced)
        was left, else None: the later of its block's exit and its tasks' end as
        the mirror bounded them, never before ``Span.enqueued``"""
        waiting_exit = self.block_client is not None and not self.exited
        if self.open_children or self.client_left or waiting_exit:
            return None
        if not all(map(group_done, groups := self.span.groups)):
            return None
        stop = max((tg.stop for tg in groups), default=0.0)
        # Dask's own TaskGroup.stop only for groups finished before the bridge
        # started; the others' bounded ends are in ``end``
        return max(self.end or stop, self.exited, self.span.enqueued)

    def due(self, now: float, heard: float, delay: float, timeout: float) -> float | None:
        """When it finished, if it may be exported ``now`` (as ``GroupBatch.ready``);
        else None"""
        if (stop := self.finished_at()) is None:
            return None
        waited = now - stop
        return stop if waited >= delay and (heard > stop or waited >= timeout) else None

    def end_no_earlier(self, end: float) -> None:
        self.end = max(self.end, end)

    def count_erred(self, error_type: str) -> None:
        """A task of its subtree (or its own) erred with ``error_type``"""
        self.erred += 1
        self.error_type = self.error_type or error_type

    def observe_entered(self, earliest: float, own_block: bool, client: str | None) -> None:
        """A client entered a block of it (``own_block``) or below it, the earliest
        at ``earliest`` (inf: unknown); while ``client``'s own block is open, it
        waits for the exit"""
        if client is not None and own_block and not self.exited and self.block_client is None:
            self.block_client = client
        if earliest != float("inf") and (self.entered is None or earliest < self.entered):
            self.entered = earliest

    def observe_caller(self, parent: SpanContext | None) -> None:
        """A root's caller's span, from the first ``otel`` annotation of it seen"""
        self.remote_parent = parent
        self.carrier_read = True

    def left_block(self, exited: float, sender: str | None = None, workflow: bool = False) -> None:
        """Its client left its ``dask_otel.span`` block at ``exited``, as client
        ``sender`` said (or left the scheduler then): no earlier than an exit
        already heard. ``workflow``: a root block opened with ``workflow=True``"""
        self.exited = max(self.exited, exited)
        if sender is not None:
            self.exit_client = sender
        self.workflow = self.workflow or workflow

    def add_event(self, name: str, attributes: dict[str, Any], timestamp: int) -> None:
        """A span event at ``timestamp`` (ns), within the span's end"""
        if self.events is None:
            self.events = []
        if len(self.events) < MAX_SPAN_EVENTS:
            self.events.append((name, attributes, timestamp))
        self.end_no_earlier(timestamp / 1e9)

    def __repr__(self) -> str:
        return f"<SpanRecord {self.span.name!r} {self.span.id}>"


@dataclass(slots=True, eq=False)
class GroupBatch:
    """A TaskGroup batch seen and not yet exported: the Dask span it is exported
    under, and what its export covers. A group's first batch covers all of it; a
    later one (new tasks joined it after its export) holds a snapshot of the
    group's cumulative values then, so that it covers only what ran since."""

    #: The Dask span it is exported under: ``TaskGroup.span_id``'s, but for a
    #: later batch submitted in another span (the TaskGroup collision)
    span: Span
    #: When new work joined an exported group (0: the group's first batch, which
    #: starts at ``TaskGroup.start``)
    since: float = 0.0
    #: ``TaskGroup.states`` when the group opened again (None: first batch)
    states: dict[str, int] | None = None
    #: Tasks of the group then, less those the new graph (re)runs
    total: int = 0
    #: ``TaskGroup.nbytes_total`` and ``TaskGroup.duration`` then
    nbytes: int = 0
    duration: float = 0.0
    #: ``dask.metrics.*`` of the group's prefix within its Dask span then
    metrics: dict[str, float] = field(default_factory=dict)
    #: Tasks of this batch that erred, when the last did and when the first of
    #: them started running (0: none): Dask records no run time for them
    erred: int = 0
    failed: float = 0.0
    started: float = 0.0
    #: ``error.type`` of the first task of this batch that erred, and the
    #: ``exception`` events of the first :data:`MAX_FAILURE_EVENTS`
    error_type: str | None = None
    events: list[tuple[str, dict[str, Any], int]] = field(default_factory=list)
    #: On the scheduler's clock: when it first sent a task of the batch and last
    #: heard one finish or fail (0: not yet), which bound the batch's times
    sent: float = 0.0
    received: float = 0.0
    #: When a poll last found the group still running (0: never)
    busy: float = 0.0
    #: Its OTel span's id, named when it opened (0: at its export)
    span_id: int = 0
    #: The earliest time the group can be ready, as the last poll found: polls
    #: pass it over until then (a group's end only moves later)
    wake: float = 0.0

    @classmethod
    def reopened(cls, tg: TaskGroup, span: Span, own: Span, rerun: int) -> GroupBatch:
        """A batch of new work in a group that was exported, under ``span``:
        ``rerun`` tasks of the new graph are to run. ``own`` is the group's Dask
        span, which Dask's fine metrics of its tasks go to."""
        states = dict(tg.states)
        carried = SpanMetrics.of(span_own_metrics(own)).by_prefix.get(tg.prefix.name, {})
        return cls(span, time(), states, sum(states.values()) - rerun, tg.nbytes_total,
                   tg.duration, carried)

    def end(self, tg: TaskGroup) -> float:
        """When the group's last task finished or failed (0: none did yet),
        bounded by the scheduler's clock"""
        end = max(tg.stop, self.failed)
        return observed(end, self.sent, self.received) if end else 0.0

    def bounds(self, tg: TaskGroup, no_earlier: float) -> tuple[float, float]:
        """Its span's start and end, bounded by the scheduler's clock: a later batch
        starts when its graph arrived, a first one when its first task started (else
        its Dask span was enqueued), no earlier than ``no_earlier`` (its Dask span's
        start); it ends when the group's last task did (now if it is not done)"""
        first = min(filter(None, (tg.start, self.started)), default=0.0)  # the earlier known
        start = self.since or (observed(first, self.sent, self.received) if first else 0.0)
        start = max(start or self.span.enqueued, no_earlier)
        return start, max(self.end(tg) if group_done(tg) else time(), start)

    def ready(self, tg: TaskGroup, now: float, heard: float, delay: float, timeout: float) -> bool:
        """Whether the batch may be exported ``now``: its last task finished
        ``delay`` ago, every worker has sent a heartbeat since (``heard``: the
        oldest last one) or ``timeout`` passed, and Dask has the group done. If
        not, it notes when to look again (:attr:`wake`). Cheap tests first."""
        end = max(self.end(tg) or self.since or self.span.enqueued, self.busy)
        waited = now - end
        if waited < delay:
            self.wake = end + delay
            return False
        if heard <= end and waited < timeout:
            return False  # a worker may still report its metrics: next poll
        if not group_done(tg):
            self.wake = now + delay
            self.busy = now
            return False
        return True

    def observe_erred(self, failure: Failure) -> None:
        """A task of the batch erred (started to run at ``failure.started``, 0: it did not)"""
        self.erred += 1
        self.error_type = self.error_type or failure.kind
        if len(self.events) < MAX_FAILURE_EVENTS:
            self.events.append(failure.event(failure.failed))
        self.failed = max(self.failed, failure.failed)
        if failure.started and (not self.started or failure.started < self.started):
            self.started = failure.started

    def observe_processing(self, sent: bool) -> None:
        """The scheduler sent a task of it (the first bounds its start), or heard one
        finish or fail (the last bounds its end)"""
        if not sent:
            self.received = time()
        elif not self.sent:
            self.sent = time()

    def figures(self, tg: TaskGroup, held: int = 0) -> tuple[dict[str, int], int, float] | None:
        """The group's states, output bytes and duration now, less ``held`` released
        tasks (a new graph's, of the next batch), read for its span's attributes
        (``builder.taskgroup_span``); None for a later batch in which nothing ran"""
        states = dict(tg.states)
        states["released"] = states.get("released", 0) - held
        # float: an int 0 in distributed 2024.1 until a task ran
        figures = (states, tg.nbytes_total, float(tg.duration))
        ran = self.states is None or self.erred or figures[2] > self.duration
        return figures if ran or sum(states.values()) > self.total else None
