"""Arithmetic over Dask's objects: what a Dask span's or TaskGroup's attributes sum,
and when they ran. No state. docs/traces.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.metrics import time
from distributed.scheduler import ALL_TASK_STATES

import dask_otel.attributes as attr
from dask_otel._compat import span_code_blocks, span_nthreads_history, span_own_metrics
from dask_otel.scheduler.builder import SpanMetrics

if TYPE_CHECKING:
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span


def active_cpu_seconds(span: Span, stop: float) -> float:
    """``Span.active_cpu_seconds`` of a span that is not a merge, given its stop:
    the property walks the subtree four times and the cluster's whole thread-count
    history; this reads only the history since the span was enqueued."""
    read = span_nthreads_history(span)
    if read is None:  # another Dask version: the public, slower way
        return span.active_cpu_seconds
    history, first = read
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


def observed(t: float, sent: float, received: float) -> float:
    """The causal bound: a time a worker reported (shifted by Dask's estimate of
    its clock offset), moved into what the scheduler saw on its own clock: no
    earlier than it ``sent`` the task and no later than it ``received`` its
    completion or failure (0: not known)."""
    return max(min(t, received) if received else t, sent)


def failure_time(startstops: Iterable[Mapping[str, Any]] | None) -> tuple[float, float]:
    """When an erred task ran and failed: its ``compute`` in the ``startstops`` the
    worker sent with the error (already in the scheduler's clock); else (0, now):
    it erred because a dependency did, or an older worker sent no times."""
    for startstop in startstops or ():
        if startstop.get("action") == "compute" and startstop.get("stop"):
            return startstop.get("start") or 0.0, startstop["stop"]
    return 0.0, time()


#: TaskGroup states in which a task has yet to finish: ``TaskGroup.done`` is "no
#: task in any of these"
_PENDING = tuple(sorted(ALL_TASK_STATES - {"memory", "erred", "released", "forgotten"}))


def span_code(span: Span) -> tuple[str, ...]:
    """The source of the code a Dask span ran (``Span.code``; empty: Dask recorded none)"""
    return tuple(sc.code for block in span_code_blocks(span) for sc in block)


def error_type(ts: TaskState, allowed_failures: int) -> str:
    """OTel's ``error.type`` for an erred task: the class name of the exception it
    (or the task it depends on) erred with, read from ``exception_text`` (the
    scheduler may not have its class); ``KilledWorker`` when its workers died
    too often (Dask gives that no text)."""
    failing = ts.exception_blame or ts
    name = (failing.exception_text or "").partition("(")[0]
    if name.isidentifier():
        return name
    if failing.suspicious > allowed_failures:
        return "KilledWorker"
    return attr.OTHER_ERROR


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
        stop = max(stop, tg.stop)
    return stop


@dataclass(slots=True)
class Totals:
    """What a Dask span's attributes sum over TaskGroups and fine metrics: of its
    own groups, or of its whole subtree (its own plus its sub-spans' subtree
    totals, summed as they are exported: ``SpanRecord.folded``)."""

    #: tasks by state (``TaskGroup.states``, summed)
    states: dict[str, int] = field(default_factory=dict)
    #: ``TaskGroup.nbytes_total`` and ``TaskGroup.duration``, summed
    nbytes: int = 0
    duration: float = 0.0
    #: when the first task started (0: none has), as ``Span.start``
    start: float = 0.0
    #: when the last task finished, as ``Span.stop`` of a finished span
    stop: float = 0.0
    #: fine metrics (``total`` and execute seconds): only of sub-spans that finished
    #: before the bridge started (``Ledger.follow_running``); the others' are
    #: summed on the builder thread
    fine: SpanMetrics = field(default_factory=SpanMetrics)

    @classmethod
    def own(cls, span: Span, metrics: bool = False) -> Totals:
        """Of a span's own groups; with ``metrics``, of its fine metrics too (the
        mirror's polls leave those to the builder thread)"""
        totals = cls()
        totals.add_groups(span.groups)
        if metrics:
            totals.fine.add(SpanMetrics.of(span_own_metrics(span)))
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
            self.stop = max(self.stop, tg.stop)

    def _started(self, start: float) -> None:
        if start and (not self.start or start < self.start):
            self.start = start

    def add(self, other: Totals) -> None:
        for state, n in other.states.items():
            self.states[state] = self.states.get(state, 0) + n
        self.fine.add(other.fine)
        self.nbytes += other.nbytes
        self.duration += other.duration
        self._started(other.start)
        self.stop = max(self.stop, other.stop)


def subtree_totals(span: Span) -> Totals:
    """:class:`Totals` of a span and all its sub-spans, by walking the tree"""
    totals = Totals.own(span, metrics=True)
    for child in span.children:
        totals.add(subtree_totals(child))
    return totals
