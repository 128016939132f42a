"""Dask's events (``SchedulerPlugin.log_event``) -> OpenTelemetry log records,
``dask.worker.lost`` span events and each removed worker's reason. One table,
:data:`DASK_EVENTS`, says what each of Dask's events becomes; users' topics are
exported as they are. What each record holds: docs/events.md.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import InitVar, dataclass, field
from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

from opentelemetry._logs import LogRecord, SeverityNumber

import dask_otel.attributes as attr
from dask_otel._compat import remove_worker_lost_keys
from dask_otel.scheduler.outcomes import CLOSED, FAIL_HARD, LOST, MEMORY_RESTART, RETIRED
from dask_otel.span_context import in_context
from dask_otel.stalls import STALL_EVENT, STALL_TOPIC

if TYPE_CHECKING:
    from distributed import Scheduler
    from opentelemetry._logs import Logger
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.trace import SpanContext

    from dask_otel.scheduler.outcomes import Outcomes
    from dask_otel.spans import SpanMirror

#: Keys listed in an attribute (``dask.event.processing_tasks``...): the first
#: this many; the ``.count`` attribute beside it is always exact
MAX_KEYS = 20
#: Dask spans a remove-worker event is reported on: a log record and a span event
#: each; the event's counts are exact whatever the number
MAX_SPANS = 16
#: Workers whose first reason for leaving is remembered until they are removed
MAX_REASONS = 1024


@dataclass(frozen=True, slots=True)
class DaskEvent:
    """What one of Dask's events becomes: a row of docs/events.md's table"""

    #: The log record's ``event_name``: fixed, nothing of the event in it
    event_name: str
    #: The record's severity, a Python level (remove-worker's is raised by what
    #: the worker held: :meth:`DaskEvents._remove_worker`)
    severity: int
    #: ``dask.worker.removed.reason`` of the worker the event says is leaving
    #: (None: it says nothing of that)
    removal: str | None
    #: The record's body, from the event's fields; for an event with a removal
    #: reason, also the ``dask.worker.lost.reason`` of the worker's removal
    text: Callable[[dict], str]


def _printed(msg: dict) -> str:
    sep = msg.get("sep")
    return (" " if sep is None else str(sep)).join(map(str, msg.get("args") or ()))


def _warning(msg: dict) -> str:
    message = _builtins_only(msg.get("message"))
    return str(message) if message is not None else "warning (not readable on the scheduler)"


#: Dask's own events, by name: what ``dask`` in ``otel.events.topics`` stands for.
#: ``stealing`` and the per-task topics are left out: they come once per task.
DASK_EVENTS: dict[str, DaskEvent] = {
    "remove-worker": DaskEvent(
        "dask.worker.removed", logging.INFO, None, lambda m: f"worker {m.get('worker')} removed"
    ),
    "closing-worker": DaskEvent(
        "dask.worker.closing", logging.INFO, CLOSED, lambda m: f"worker closing: {m.get('reason')}"
    ),
    "worker-restart-memory": DaskEvent(
        "dask.worker.restart_memory", logging.WARNING, MEMORY_RESTART,
        lambda m: f"nanny restarts worker {m.get('worker')}: rss {m.get('rss')} bytes",
    ),
    "worker-fail-hard": DaskEvent(
        "dask.worker.fail_hard", logging.ERROR, FAIL_HARD,
        lambda m: f"worker failed hard: {m.get('exception_text', '')}",
    ),
    "workflow-started": DaskEvent("dask.workflow.started", logging.INFO, None, str),
    "print": DaskEvent("dask.task.print", logging.INFO, None, _printed),
    "warn": DaskEvent("dask.task.warn", logging.WARNING, None, _warning),
    STALL_TOPIC: DaskEvent(STALL_EVENT, logging.WARNING, None, str),  # stalls.Stalls's
}
#: The ``event_name`` of the records of users' own topics (``Client.log_event``),
#: exported at INFO
USER_EVENT = "dask.event"
_SEVERITY_NUMBERS = {logging.INFO: SeverityNumber.INFO, logging.WARNING: SeverityNumber.WARN,
                     logging.ERROR: SeverityNumber.ERROR}


def topics_to_export(topics: Collection[str]) -> frozenset[str]:
    """``otel.events.topics`` with ``dask`` expanded to :data:`DASK_EVENTS`"""
    names = set(topics)
    if "dask" in names:
        names.discard("dask")
        names.update(DASK_EVENTS)
    return frozenset(names)


def event_name(topic: Any, msg: Any) -> str | None:
    """The name an event is selected by: Dask's action for the events it logs under
    ``all`` or under a worker's address, else the topic. None for the copies
    (``remove-worker`` is logged under the address and under ``all``) and Dask's
    other bookkeeping under those topics."""
    if not isinstance(topic, str):
        return None
    action = msg.get("action") if isinstance(msg, dict) else None
    if topic == "all":
        return "remove-worker" if action == "remove-worker" else None
    if "://" in topic:  # a worker's own topic
        return "closing-worker" if action == "closing-worker" else None
    return topic


@dataclass(slots=True)
class DaskEvents:
    """Turns the scheduler's events into log records and span events"""

    #: The scheduler whose events these are
    scheduler: Scheduler
    #: The span mirror the span events go to (it runs whenever events do)
    mirror: SpanMirror
    logger_provider: InitVar[LoggerProvider | None]
    #: The event names to export (``otel.events.topics``; ``dask`` expanded)
    topics: Collection[str]
    #: otel.logs.level: the records' lowest level, as for Python's log records
    level: int = logging.NOTSET
    #: Counts removed workers (None: metrics are off)
    outcomes: Outcomes | None = None
    messages: bool = True  # otel.errors.messages: False drops exception and traceback texts
    #: The LoggerProvider's logger the records go to (None: logs are off)
    logger: Logger | None = field(init=False)
    #: worker address -> ``(dask.worker.removed.reason, dask.worker.lost.reason)``
    #: of the first event that said why it is leaving, until its remove-worker
    reasons: dict[str, tuple[str, str | None]] = field(init=False, default_factory=dict)

    def __post_init__(self, logger_provider: LoggerProvider | None) -> None:
        self.topics = topics_to_export(self.topics)
        self.logger = (logger_provider.get_logger("dask_otel.events", schema_url=attr.SCHEMA_URL)
                       if logger_provider is not None else None)

    def observe(self, topic: Any, msg: Any) -> None:
        """The hook: every event on every topic passes here"""
        if not self.messages and isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if k not in ("exception_text", "traceback_text")}
        name = event_name(topic, msg)
        if name is None:
            if isinstance(msg, dict) and msg.get("action") == "worker-status-change":
                # retire_workers sets it before it removes the worker, on every supported
                # version; a retirement given up sets it back
                gracefully = msg.get("status") == "closing_gracefully"
                self._note(str(topic), RETIRED if gracefully else None)
            return
        row = DASK_EVENTS.get(name)
        if row is not None and row.removal is not None and isinstance(msg, dict):
            self._note(str(msg.get("worker") or topic), row.removal, row.text(msg))
        if name == "remove-worker":
            # counted whatever otel.events.topics says
            address = str(msg.get("worker"))
            kind, reason = self.reasons.pop(address, (LOST, None))
            if self.outcomes is not None:
                self.outcomes.worker_removed(kind)
            if name in self.topics:
                self._remove_worker(msg, address, reason)
        elif name in self.topics:
            self._export(name, topic, msg)

    # --- why a worker leaves --------------------------------------------------------

    def _note(self, address: str, kind: str | None, reason: str | None = None) -> None:
        """Why the worker at ``address`` leaves (None: a retirement given up). The first
        reason is kept, more precise (closing-worker follows the nanny's restart and a
        hard failure), but any other than closing says more than a retirement"""
        if kind not in (RETIRED, CLOSED) and self.reasons.get(address, ("",))[0] == RETIRED:
            del self.reasons[address]
        if kind is None:
            return
        if len(self.reasons) >= MAX_REASONS and address not in self.reasons:
            del self.reasons[next(iter(self.reasons))]  # the oldest
        self.reasons.setdefault(address, (kind, reason))

    def runs_started(self, known: int) -> None:
        """The root Dask spans the mirror opened past its first ``known``: a record each,
        after their graph's annotation was read, in their trace (sampled, traces on)"""
        spans = self.mirror.dask_spans
        for span in islice(reversed(spans.values()), len(spans) - known):
            if span.parent is None and "workflow-started" in self.topics:
                self.emit("workflow-started", logging.INFO, f"run of {span.name[0]!r} started",
                          {attr.SPAN_ID: span.id, attr.SPAN_NAME: tuple(span.name)},
                          self.mirror.context_of(span.id))

    # --- a worker removed ----------------------------------------------------------

    def _remove_worker(self, msg: dict, address: str, reason: str | None) -> None:
        processing = msg.get("processing-tasks") or ()
        computed, scattered = remove_worker_lost_keys(self.scheduler, msg)
        attributes = _fields(msg)
        for name, keys in (("processing_tasks", processing), ("lost_computed_tasks", computed),
                           ("lost_scattered_tasks", scattered)):
            attributes[attr.EVENT_PREFIX + name] = [str(k) for k in islice(keys, MAX_KEYS)]
            attributes[attr.EVENT_PREFIX + name + "_count"] = len(keys)
        attributes[attr.WORKER_ADDRESS] = address
        if reason:
            attributes[attr.WORKER_LOST_REASON] = reason
        level = (
            logging.ERROR if scattered else logging.WARNING if computed or processing
            else DASK_EVENTS["remove-worker"].severity
        )
        body = DASK_EVENTS["remove-worker"].text(msg) + (f" ({reason})" if reason else "")
        by_span = self._spans_of(processing, computed)
        if not by_span:
            self.emit("remove-worker", level, body, attributes)
            return
        now, mirror = time_ns(), self.mirror
        for span_id, (n_processing, n_lost) in islice(by_span.items(), MAX_SPANS):
            # a dask.worker.lost span event, if the span is open
            lost = {attr.WORKER_ADDRESS: address, attr.TASKS_PROCESSING: n_processing,
                    attr.TASKS_LOST_COMPUTED: n_lost}
            if reason:
                lost[attr.WORKER_LOST_REASON] = reason
            mirror.add_span_event(attr.WORKER_LOST, lost, now, [span_id], up=False)
            per_span = {**attributes, attr.SPAN_ID: span_id,
                        attr.SPAN_TASKS_PROCESSING: n_processing,
                        attr.SPAN_TASKS_LOST_COMPUTED: n_lost}
            self.emit("remove-worker", level, body, per_span, mirror.context_of(span_id), now)

    def _spans_of(self, processing: Iterable[Hashable], computed: Iterable[Hashable]
                  ) -> dict[str, list[int]]:
        """Dask span id -> [tasks processing, computed tasks lost] on the worker"""
        tasks = self.scheduler.tasks
        by_span: dict[str, list[int]] = {}
        for index, keys in enumerate((processing, computed)):
            for key in keys:
                ts = tasks.get(key)
                span_id = ts.group.span_id if ts is not None else None
                if span_id is not None:
                    by_span.setdefault(span_id, [0, 0])[index] += 1
        return by_span

    # --- every other event -----------------------------------------------------------

    def _export(self, name: str, topic: str, msg: Any) -> None:
        attributes = _fields(msg)
        address = msg.get("worker") if isinstance(msg, dict) else None
        address = str(address) if address else topic if "://" in topic else None
        if address:
            attributes[attr.WORKER_ADDRESS] = address
        context = None
        if name in ("print", "warn"):
            span_id = self._running_span(address)
            if span_id is not None:
                attributes[attr.SPAN_ID] = span_id
                context = self.mirror.context_of(span_id)
            category = _builtins_only(msg.get("category")) if isinstance(msg, dict) else None
            if isinstance(category, type):
                attributes[attr.EVENT_CATEGORY] = category.__name__
        row = DASK_EVENTS.get(name)
        body = (row.text(msg) if row is not None and isinstance(msg, dict)
                else msg if isinstance(msg, str) else name)
        self.emit(name, row.severity if row else logging.INFO, body, attributes, context)

    def _running_span(self, address: str | None) -> str | None:
        """The Dask span of the tasks running on the worker that printed, if they
        are all of one: the worker sends the event on the stream that reports the
        task's end later, so the task is still processing here"""
        ws = self.scheduler.workers.get(address) if address else None
        if ws is None:
            return None
        span_ids = {ts.group.span_id for ts in islice(ws.processing, 1000)}
        return span_ids.pop() if len(span_ids) == 1 else None

    def emit(self, name: str, level: int, body: str, attributes: dict[str, Any],
             context: SpanContext | None = None, timestamp: int | None = None) -> None:
        if self.logger is None or level < self.level:
            return
        attributes[attr.EVENT_TOPIC] = name
        row = DASK_EVENTS.get(name)
        self.logger.emit(LogRecord(
            event_name=row.event_name if row is not None else USER_EVENT,
            timestamp=timestamp or time_ns(), context=in_context(context), body=body,
            severity_text=logging.getLevelName(level), severity_number=_SEVERITY_NUMBERS[level],
            attributes=attributes))


def _fields(msg: Any) -> dict[str, Any]:
    """An event's scalar fields as ``dask.event.*`` attributes (key lists are not
    scalars; Dask's pickled payloads are left out)"""
    if not isinstance(msg, dict):
        return {}
    return {attr.EVENT_PREFIX + attr.snake(name): value for name, value in msg.items()
            if isinstance(value, (str, bool, int, float))
            and name not in ("action", "worker", "exception", "traceback")}


class _BuiltinsUnpickler(pickle.Unpickler):
    """distributed.warn pickles the message and category for the client: read them
    only when they are built-in (a str, UserWarning...), never importing user code
    into the scheduler"""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _builtins_only(data: Any) -> Any:
    if not isinstance(data, bytes):
        return None
    try:
        return _BuiltinsUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 (whatever the bytes: no body, never a failed hook)
        return None
