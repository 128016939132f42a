"""Arithmetic over Dask's objects: what a Dask span's or TaskGroup's attributes sum,
and when they ran; the one decoder of a fine-metric key. No state: the loop's
readings (:mod:`dask_otel.spans`) and the builder thread
(:mod:`dask_otel.scheduler.builder`) both count with it. docs/traces.md.
"""

from __future__ import annotations

import ast
from collections.abc import Hashable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from distributed.metrics import time
from distributed.scheduler import ALL_TASK_STATES
from opentelemetry.trace import Status, StatusCode

import dask_otel.attributes as attr
from dask_otel._compat import span_nthreads_history, span_own_metrics

if TYPE_CHECKING:
    from distributed.scheduler import TaskGroup, TaskState
    from distributed.spans import Span


class FineKey(NamedTuple):
    """A fine-metric key ``(context, [prefix or where...], activity, unit)``, read once"""

    context: str
    #: The task prefix of an ``execute`` key (None: none), the middle of another's
    prefix: str | None
    where: str | None
    activity: str
    unit: str
    #: ``dask.metrics.<context>.<activity>.<unit>``, a Dask span's attribute
    name: str


@lru_cache(maxsize=1 << 16)  # unbounded task prefixes: stay bounded
def fine_key(key: Hashable) -> FineKey | None:
    """The one decoder of a key of Dask's fine metrics (None: another key,
    ``"latency"``, ``"tick-duration"``...)"""
    if not isinstance(key, tuple) or len(key) < 3:
        return None
    context, *middle, activity, unit = map(str, key)
    execute = context == "execute" and bool(middle)
    return FineKey(context, middle[0] if execute else None,
                   " ".join(middle) if middle and not execute else None, activity, unit,
                   "dask.metrics.{}.{}.{}".format(*map(attr.snake, (context, activity, unit))))


@dataclass(slots=True)
class SpanMetrics:
    """The fine performance metrics of one Dask span (its own, not its
    sub-spans'), as attributes, in one pass: summed over task prefixes for the
    span, and by task prefix for its TaskGroups."""

    #: ``dask.metrics.<context>.<activity>.<unit>``, summed over prefixes
    total: dict[str, float] = field(default_factory=dict)
    #: the same by task prefix, ``execute`` context only
    by_prefix: dict[str, dict[str, float]] = field(default_factory=dict)
    #: seconds of the execute context, for "idle or other spans"
    execute_seconds: float = 0.0

    @classmethod
    def of(cls, metrics: Mapping[Hashable, float]) -> SpanMetrics:
        """Of a Dask span's own metrics (``Span._cumulative_worker_metrics``, or
        the copy the loop took of them)"""
        out = cls()
        total, by_prefix = out.total, out.by_prefix
        for key, value in metrics.items():
            if not value or (fk := fine_key(key)) is None:
                continue
            total[fk.name] = total.get(fk.name, 0) + value
            if fk.prefix is not None:
                attrs = by_prefix.setdefault(fk.prefix, {})
                attrs[fk.name] = attrs.get(fk.name, 0) + value
            if fk.context == "execute" and fk.unit == "seconds":
                out.execute_seconds += value
        return out

    def add(self, other: SpanMetrics) -> SpanMetrics:
        """Sum ``other``'s totals and execute seconds into these"""
        total = self.total
        for name, value in other.total.items():
            total[name] = total.get(name, 0) + value
        self.execute_seconds += other.execute_seconds
        return self


#: ``dask.tasks.<state>`` by state: built once, not per span
_STATE_NAMES = {state: attr.TASKS_PREFIX + attr.snake(state) for state in ALL_TASK_STATES}


def task_counts(states: Mapping[str, int], total: int, nbytes: int, duration: float
                ) -> dict[str, Any]:
    """The attributes every mirrored span has of its tasks: the count of each
    state (those above 0), the total, output bytes and duration"""
    out: dict[str, Any] = {_STATE_NAMES.get(state) or attr.TASKS_PREFIX + attr.snake(state): n
                           for state, n in states.items() if n > 0}
    out.update({attr.TASKS_TOTAL: total, attr.OUTPUT_BYTES: nbytes, attr.DURATION: duration})
    return out


def erred_status(attributes: dict[str, Any], erred: int, error_type: str | None = None
                 ) -> Status | None:
    """Record the erred count (the transitions the mirror saw, or the state
    count) and ``error.type`` in ``attributes`` and return the ERROR status, if
    any task erred"""
    erred = max(erred, attributes.get(attr.TASKS_ERRED, 0))
    if not erred:
        return None
    attributes[attr.TASKS_ERRED] = erred
    attributes[attr.ERROR_TYPE] = error_type or attr.OTHER_ERROR
    if error_type == "KilledWorker":  # say why: no exception of the task's own
        return Status(StatusCode.ERROR, f"{erred} tasks erred: KilledWorker, the workers "
                      f"running them died (see the {attr.WORKER_LOST} span events)")
    return Status(StatusCode.ERROR, f"{erred} tasks erred")


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


#: TaskGroup states in which a task has yet to finish: ``TaskGroup.done`` is "no
#: task in any of these"
_PENDING = tuple(sorted(ALL_TASK_STATES - {"memory", "erred", "released", "forgotten"}))


@dataclass(frozen=True, slots=True)
class Failure:
    """A task that erred, read once from Dask's ``erred`` transition"""

    #: OTel's ``error.type``: the class name of the exception it (or the task it
    #: depends on) erred with, read from ``exception_text`` (the scheduler may not
    #: have its class); ``KilledWorker`` when its workers died too often (Dask
    #: gives that no text)
    kind: str
    #: When it ran and failed: its ``compute`` in the ``startstops`` the worker
    #: sent with the error (already in the scheduler's clock); else (0, now): it
    #: erred because a dependency did, or an older worker sent no times
    started: float
    failed: float
    #: The task, for its ``exception`` event (:meth:`event`), with its message and
    #: traceback or not (``otel.errors.messages``)
    ts: TaskState = None  # type: ignore[assignment]
    messages: bool = True

    @classmethod
    def of(cls, ts: TaskState, startstops: Iterable[Mapping[str, Any]] | None,
           allowed_failures: int, messages: bool = True) -> Failure:
        failing = ts.exception_blame or ts
        kind = (failing.exception_text or "").partition("(")[0]
        if not kind.isidentifier():
            kind = "KilledWorker" if failing.suspicious > allowed_failures else attr.OTHER_ERROR
        for startstop in startstops or ():
            if startstop.get("action") == "compute" and startstop.get("stop"):
                return cls(kind, startstop.get("start") or 0.0, startstop["stop"], ts, messages)
        return cls(kind, 0.0, time(), ts, messages)

    def event(self, at: float) -> tuple[str, dict[str, Any], int]:
        """Its ``exception`` span event at ``at``; the message: in the parentheses of
        ``exception_text`` (a repr), a string literal read; KilledWorker's says why"""
        failing = self.ts.exception_blame or self.ts
        attributes = {attr.EXCEPTION_TYPE: self.kind, attr.TASK_KEY: str(self.ts.key),
                      attr.WORKER_ADDRESS: next(iter(failing.erred_on or ()), "")}
        if self.messages:
            message = (failing.exception_text or "")[len(self.kind) + 1:].removesuffix(")") or (
                f"its workers died: see the {attr.WORKER_LOST} span events"
                * (self.kind == "KilledWorker"))
            with suppress(Exception):
                message = str(ast.literal_eval(message)) if message[:1] in "'\"" else message
            attributes |= {attr.EXCEPTION_MESSAGE: message,
                           attr.EXCEPTION_STACKTRACE: failing.traceback_text or ""}
        return attr.EXCEPTION_EVENT, attributes, int(at * 1e9)


def group_done(tg: TaskGroup) -> bool:
    """``TaskGroup.done``, in a quarter of the time: polls ask it of every open group"""
    states = tg.states
    for state in _PENDING:
        if states.get(state):
            return False
    return True


@dataclass(slots=True)
class Totals:
    """What a Dask span's attributes sum over TaskGroups and fine metrics: of its
    own groups, or of its whole subtree (its own plus its sub-spans' subtree
    totals, summed as they are built: ``SpanBuilder.folded``, the one subtree ledger)."""

    #: tasks by state (``TaskGroup.states``, summed)
    states: dict[str, int] = field(default_factory=dict)
    #: ``TaskGroup.nbytes_total`` and ``TaskGroup.duration``, summed
    nbytes: int = 0
    duration: float = 0.0
    #: when the first task started (0: none has), as ``Span.start``
    start: float = 0.0
    #: fine metrics (``total`` and execute seconds; ``by_prefix``, in the subtree
    #: ledger: what its exported TaskGroup spans carried of its own)
    fine: SpanMetrics = field(default_factory=SpanMetrics)

    @classmethod
    def own(cls, span: Span) -> Totals:
        """Of a span's own groups (its fine metrics: named on the builder thread)"""
        totals = cls()
        for tg in span.groups:  # read, never kept
            totals.add(cls(tg.states, tg.nbytes_total, tg.duration, tg.start))
        return totals

    @classmethod
    def of_subtree(cls, span: Span) -> Totals:
        """Of a span and all its sub-spans, fine metrics included, by walking the tree"""
        totals = cls.own(span)
        totals.fine.add(SpanMetrics.of(span_own_metrics(span)))
        for child in span.children:
            totals.add(cls.of_subtree(child))
        return totals

    def add(self, other: Totals) -> Totals:
        for state, n in other.states.items():
            if n:
                self.states[state] = self.states.get(state, 0) + n
        self.fine.add(other.fine)
        self.nbytes += other.nbytes
        self.duration += other.duration
        if other.start and (not self.start or other.start < self.start):
            self.start = other.start
        return self
