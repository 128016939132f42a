"""Dask's events -> OpenTelemetry log records and span events: why a worker died.

Dask records what happens to workers as structured events (``Scheduler.log_event``,
which every scheduler plugin sees through ``SchedulerPlugin.log_event``): the
scheduler's ``remove-worker``, the worker's ``closing-worker`` and
``worker-fail-hard``, its nanny's ``worker-restart-memory``, ``print``/``warn``
from ``distributed.print``/``distributed.warn`` in tasks, and whatever users log
with ``Client.log_event``. :class:`DaskEvents` turns those selected by
``otel.events.topics`` into log-based events emitted through the process's
LoggerProvider (when logs are on): each record has a fixed ``event_name``
(:data:`EVENT_NAMES`) and, for Dask's events, ``dask.worker.address``. It gives
the Dask spans a lost worker was computing for, or held results of, a
``dask.worker.lost`` span event, and tells each removed worker's reason to
``dask.worker.removed`` (:mod:`dask_otel.scheduler.outcomes`) whatever the topics:
the reason is what the worker's events said before its ``remove-worker``
(``closing-worker``, the nanny's ``worker-restart-memory``, ``worker-fail-hard``,
or the ``worker-status-change`` to ``closing_gracefully`` that ``retire_workers``
logs first), else ``lost``.

Cost: one set lookup per event; the work below happens only for the rare events
selected, and is proportional to the tasks on the worker concerned. Nothing is
done per task. A span event goes to the open Dask span's record through the
mirror (``SpanMirror.observe_worker_lost``), never written here; the remembered
reasons are bounded (:data:`MAX_REASONS`). What each record holds: docs/events.md.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Callable, Collection, Hashable, Iterable
from itertools import islice
from time import time_ns
from typing import TYPE_CHECKING, Any

import dask_otel.attributes as attr
from dask_otel._compat import REMOVE_WORKER_LISTS_LOST_KEYS
from dask_otel.scheduler.outcomes import CLOSED, FAIL_HARD, LOST, MEMORY_RESTART, RETIRED

if TYPE_CHECKING:
    from distributed import Scheduler
    from opentelemetry._logs import Logger
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.trace import SpanContext

    from dask_otel.spans import SpanMirror

logger = logging.getLogger("dask_otel")

#: Dask's own events, by name, that ``dask`` in ``otel.events.topics`` stands for.
#: ``stealing`` and the per-task topics are left out: they come once per task.
DASK_EVENTS = frozenset({
    "remove-worker",
    "closing-worker",
    "worker-restart-memory",
    "worker-fail-hard",
    "print",
    "warn",
})

#: The log record's ``event_name`` of each of Dask's events: fixed names, nothing
#: dynamic in them (the topic stays in ``dask.event.topic``)
EVENT_NAMES = {
    "remove-worker": "dask.worker.removed",
    "closing-worker": "dask.worker.closing",
    "worker-restart-memory": "dask.worker.restart_memory",
    "worker-fail-hard": "dask.worker.fail_hard",
    "print": "dask.task.print",
    "warn": "dask.task.warn",
}
#: The ``event_name`` of the records of users' own topics (``Client.log_event``)
USER_EVENT = "dask.event"
#: ``dask.worker.removed.reason`` (dask_otel.scheduler.outcomes) of the event that
#: said why a worker closed
_REMOVED_BY = {
    "closing-worker": CLOSED,
    "worker-restart-memory": MEMORY_RESTART,
    "worker-fail-hard": FAIL_HARD,
}

#: Keys listed in an attribute (``dask.event.processing_tasks``...): the first
#: this many; the ``.count`` attribute beside it is always exact
MAX_KEYS = 20
#: Dask spans a remove-worker event is reported on: a log record and a span event
#: each; the event's counts are exact whatever the number
MAX_SPANS = 16
#: Workers whose last reason for closing is remembered until they are removed
MAX_REASONS = 1024

#: The key lists of a remove-worker event, and the attribute names they take
_KEY_FIELDS = {
    "processing-tasks": attr.EVENT_PREFIX + "processing_tasks",
    "lost-computed-tasks": attr.EVENT_PREFIX + "lost_computed_tasks",
    "lost-scattered-tasks": attr.EVENT_PREFIX + "lost_scattered_tasks",
}


def topics_to_export(topics: Collection[str]) -> frozenset[str]:
    """``otel.events.topics`` with ``dask`` expanded to :data:`DASK_EVENTS`"""
    names = set(topics)
    if "dask" in names:
        names.discard("dask")
        names |= DASK_EVENTS
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


class DaskEvents:
    """Turns the scheduler's events into log records and span events"""

    #: The scheduler whose events these are
    scheduler: Scheduler
    #: The span mirror the span events go to (None: traces are off)
    mirror: SpanMirror | None
    #: The event names to export (``otel.events.topics``, expanded)
    topics: frozenset[str]
    #: otel.logs.level: the records' lowest level, as for Python's log records
    level: int
    #: The LoggerProvider's logger the records go to (None: logs are off)
    logger: Logger | None
    #: worker address -> why it closed, as its closing-worker, nanny or
    #: fail-hard event said: ``(dask.worker.removed.reason, text)``, until its
    #: remove-worker event
    reasons: dict[str, tuple[str, str | None]]
    #: Counts a removed worker by its ``dask.worker.removed.reason``
    #: (``Outcomes.worker_removed``; None: metrics are off)
    removed: Callable[[str], None] | None

    def __init__(
        self,
        scheduler: Scheduler,
        mirror: SpanMirror | None,
        logger_provider: LoggerProvider | None,
        topics: Collection[str],
        level: int = logging.NOTSET,
        removed: Callable[[str], None] | None = None,
    ):
        self.scheduler = scheduler
        self.mirror = mirror
        self.topics = topics_to_export(topics)
        self.level = level
        self.logger = (
            logger_provider.get_logger("dask_otel.events") if logger_provider is not None else None
        )
        self.reasons = {}
        self.removed = removed

    def observe(self, topic: Any, msg: Any) -> None:
        """The hook: every event on every topic passes here"""
        name = event_name(topic, msg)
        if name is None:
            if isinstance(msg, dict) and msg.get("action") == "worker-status-change":
                self._note_status(str(topic), msg.get("status"))
            return
        if name in _REMOVED_BY:
            self._note_reason(name, topic, msg)
        if name == "remove-worker":
            # counted whatever otel.events.topics says; its reason taken either way
            address = str(msg.get("worker"))
            kind, reason = self.reasons.pop(address, (None, None))
            if self.removed is not None:
                self.removed(kind or LOST)
            if name in self.topics:
                self._remove_worker(msg, address, reason)
            return
        if name not in self.topics:
            return
        if name in ("print", "warn"):
            self._task_output(name, msg)
        else:
            attributes = _fields(msg)
            address = _worker_of(topic, msg)
            if address:
                attributes[attr.WORKER_ADDRESS] = address
            self._emit(name, _SEVERITY.get(name, "INFO"), _body(name, msg), attributes)

    # --- a worker lost ------------------------------------------------------------

    def _note_reason(self, name: str, topic: str, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        address = msg.get("worker") or topic
        if name == "closing-worker":
            reason = f"closing-worker: {msg.get('reason')}"
        elif name == "worker-restart-memory":
            reason = f"worker-restart-memory: rss {msg.get('rss')} bytes, nanny restarted it"
        else:
            reason = f"worker-fail-hard: {msg.get('exception_text', '')}"
        address, kind = str(address), _REMOVED_BY[name]
        # closing-worker follows the nanny's restart: keep the first, more precise;
        # but a memory restart or a hard failure says more than a retirement
        if kind != CLOSED and self._retired(address):
            del self.reasons[address]
        self._keep_first(address, kind, reason)

    def _note_status(self, address: str, status: Any) -> None:
        """A worker's status changed (Dask logs it under the worker's address):
        ``retire_workers`` sets ``closing_gracefully`` before it removes a worker,
        on every supported version; a retirement given up sets it back"""
        if status == "closing_gracefully":
            self._keep_first(address, RETIRED, None)
        elif self._retired(address):
            del self.reasons[address]

    def _keep_first(self, address: str, kind: str, reason: str | None) -> None:
        """Note why ``address`` is leaving, unless a reason is noted already; at
        most :data:`MAX_REASONS` workers, the oldest forgotten first"""
        if len(self.reasons) >= MAX_REASONS and address not in self.reasons:
            del self.reasons[next(iter(self.reasons))]
        self.reasons.setdefault(address, (kind, reason))

    def _retired(self, address: str) -> bool:
        return self.reasons.get(address, ("",))[0] == RETIRED

    def _remove_worker(self, msg: dict, address: str, reason: str | None) -> None:
        processing = msg.get("processing-tasks") or ()
        if REMOVE_WORKER_LISTS_LOST_KEYS:
            computed = msg.get("lost-computed-tasks") or ()
            scattered = msg.get("lost-scattered-tasks") or ()
        else:  # read before the scheduler forgets the replicas
            computed, scattered = self._lost_keys(address)
        attributes = _fields(msg)
        for field, keys in (
            ("processing-tasks", processing),
            ("lost-computed-tasks", computed),
            ("lost-scattered-tasks", scattered),
        ):
            attributes[_KEY_FIELDS[field]] = [str(k) for k in islice(keys, MAX_KEYS)]
            attributes[_KEY_FIELDS[field] + ".count"] = len(keys)
        attributes[attr.WORKER_ADDRESS] = address
        if reason:
            attributes[attr.WORKER_LOST_REASON] = reason
        severity = "ERROR" if scattered else "WARNING" if (computed or processing) else "INFO"
        body = f"worker {address} removed" + (f" ({reason})" if reason else "")
        by_span = self._spans_of(processing, computed)
        if not by_span:
            self._emit("remove-worker", severity, body, attributes)
            return
        now = time_ns()
        for span_id, (n_processing, n_lost) in islice(by_span.items(), MAX_SPANS):
            context = self._on_span(span_id, address, reason, n_processing, n_lost, now)
            per_span = dict(attributes)
            per_span[attr.SPAN_ID] = span_id
            per_span[attr.SPAN_TASKS_PROCESSING] = n_processing
            per_span[attr.SPAN_TASKS_LOST_COMPUTED] = n_lost
            self._emit("remove-worker", severity, body, per_span, context, now)

    def _lost_keys(self, address: str) -> tuple[list[Hashable], list[Hashable]]:
        ws = self.scheduler.workers.get(address)
        if ws is None:
            return [], []
        computed, scattered = [], []
        for ts in ws.has_what:
            if len(ts.who_has) <= 1:
                (computed if ts.run_spec else scattered).append(ts.key)
        return computed, scattered

    def _spans_of(
        self, processing: Iterable[Hashable], computed: Iterable[Hashable]
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

    def _on_span(
        self, span_id: str, address: str, reason: str | None, processing: int, lost: int, now: int
    ) -> SpanContext | None:
        """Tell the mirror (a ``dask.worker.lost`` span event, if the Dask span is
        open); its OTel span context (None if the mirror is off or its trace is
        sampled out)"""
        mirror = self.mirror
        if mirror is None:
            return None
        attributes: dict[str, Any] = {
            attr.WORKER_ADDRESS: address,
            attr.TASKS_PROCESSING: processing,
            attr.TASKS_LOST_COMPUTED: lost,
        }
        if reason:
            attributes[attr.WORKER_LOST_REASON] = reason
        mirror.observe_worker_lost(span_id, attributes, now)
        return mirror.context_of(span_id)

    # --- print and warn from tasks ------------------------------------------------

    def _task_output(self, name: str, msg: Any) -> None:
        attributes = _fields(msg) if name == "print" else {}
        address = msg.get("worker") if isinstance(msg, dict) else None
        if address:
            attributes[attr.WORKER_ADDRESS] = str(address)
        context = None
        span_id = self._running_span(address)
        if span_id is not None:
            attributes[attr.SPAN_ID] = span_id
            context = self.mirror.context_of(span_id) if self.mirror is not None else None
        if name == "warn":
            category = _builtins_only(msg.get("category")) if isinstance(msg, dict) else None
            if isinstance(category, type):
                attributes[attr.EVENT_CATEGORY] = category.__name__
        self._emit(name, _SEVERITY[name], _body(name, msg), attributes, context)

    def _running_span(self, address: Any) -> str | None:
        """The Dask span of the tasks running on the worker that printed, if they
        are all of one: the worker sends the event on the stream that reports the
        task's end later, so the task is still processing here"""
        ws = self.scheduler.workers.get(address) if address else None
        if ws is None:
            return None
        span_ids = {ts.group.span_id for ts in islice(ws.processing, 1000)}
        return span_ids.pop() if len(span_ids) == 1 else None

    # --- out ----------------------------------------------------------------------

    def _emit(
        self,
        name: str,
        severity: str,
        body: str,
        attributes: dict[str, Any],
        context: SpanContext | None = None,
        timestamp: int | None = None,
    ) -> None:
        if self.logger is None or logging.getLevelName(severity) < self.level:
            return
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.trace import NonRecordingSpan, set_span_in_context

        attributes[attr.EVENT_TOPIC] = name
        self.logger.emit(LogRecord(
            event_name=EVENT_NAMES.get(name, USER_EVENT),
            timestamp=timestamp or time_ns(),
            context=set_span_in_context(NonRecordingSpan(context)) if context else None,
            severity_text=severity,
            severity_number=getattr(SeverityNumber, _SEVERITY_NUMBER[severity]),
            body=body,
            attributes=attributes,
        ))


_SEVERITY = {
    "remove-worker": "WARNING",
    "closing-worker": "INFO",
    "worker-restart-memory": "WARNING",
    "worker-fail-hard": "ERROR",
    "print": "INFO",
    "warn": "WARNING",
}
_SEVERITY_NUMBER = {"INFO": "INFO", "WARNING": "WARN", "ERROR": "ERROR"}


def _worker_of(topic: str, msg: Any) -> str | None:
    """The worker an event concerns: its ``worker`` field (the scheduler adds it to
    what a worker logs under another topic; the nanny writes it), else the topic
    when it is a worker's address (``closing-worker``); None for users' topics"""
    address = msg.get("worker") if isinstance(msg, dict) else None
    if address:
        return str(address)
    return topic if "://" in topic else None


def _fields(msg: Any) -> dict[str, Any]:
    """An event's scalar fields as ``dask.event.*`` attributes (key lists and
    Dask's pickled payloads are handled, or left out, by the caller)"""
    if not isinstance(msg, dict):
        return {}
    attributes = {}
    for field, value in msg.items():
        if field in _KEY_FIELDS or field in ("action", "worker", "args", "exception", "traceback"):
            continue
        if isinstance(value, (str, bool, int, float)):
            attributes[attr.EVENT_PREFIX + str(field).replace("-", "_")] = value
    return attributes


def _body(name: str, msg: Any) -> str:
    if name == "print" and isinstance(msg, dict):
        sep = msg.get("sep")
        return (" " if sep is None else str(sep)).join(map(str, msg.get("args") or ()))
    if name == "warn" and isinstance(msg, dict):
        message = _builtins_only(msg.get("message"))
        return str(message) if message is not None else "warning (not readable on the scheduler)"
    if isinstance(msg, str):
        return msg
    if name == "worker-restart-memory" and isinstance(msg, dict):
        return f"nanny restarts worker {msg.get('worker')}: rss {msg.get('rss')} bytes"
    if name == "worker-fail-hard" and isinstance(msg, dict):
        return f"worker failed hard: {msg.get('exception_text', '')}"
    if name == "closing-worker" and isinstance(msg, dict):
        return f"worker closing: {msg.get('reason')}"
    return name


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

