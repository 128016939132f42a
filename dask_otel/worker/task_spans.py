"""Task spans: a chosen run of a task as an OpenTelemetry span, built by the
worker that ran it (the scheduler does no work for them), and :class:`TaskRules`,
which chooses the runs (``otel.tasks.*``, or a client block's values over them).
What is exported, which tasks, and their times: docs/traces.md, "Task spans
(opt-in)" and "One workflow's controls". Cost: ``benchmarks/task_context.py``.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.comm import get_address_host
from distributed.metrics import time
from distributed.protocol import pickle
from distributed.worker_state_machine import ExecuteFailureEvent, ExecuteSuccessEvent
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Status, StatusCode

import dask_otel.attributes as attr
from dask_otel._compat import task_function
from dask_otel.annotation import entered_at, labels
from dask_otel.span_context import child_context, in_context

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed import Worker
    from distributed.worker_state_machine import StateMachineEvent
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan

    from dask_otel.config import OtelConfig
    from dask_otel.export.sink import SpanSink
    from dask_otel.worker.task_context import DaskSpanContext

#: A task span's name: its task prefix behind a word of its own (contrib Celery's
#: ``run/<task>``), so that a trace UI lists tasks apart from their TaskGroup and Dask
#: span (docs/traces.md "Span names")
TASK_SPAN_NAME = "run/{}"
_HASH_SPACE = 1 << 64


def key_chosen(key: Key, ratio: float) -> bool:
    """Whether ``otel.tasks.sample-ratio`` chooses this key: a hash of ``str(key)``
    compared with ``ratio * 2**64``, so the same in every process and every run"""
    if ratio >= 1:
        return True
    if ratio <= 0:
        return False
    digest = blake2b(str(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < ratio * _HASH_SPACE


@dataclass(slots=True, frozen=True)
class TaskRules:
    """The ``otel.tasks.*`` values that choose which runs of a task get a span"""

    spans: bool
    sample_ratio: float
    #: seconds; None: no such rule
    slower_than: float | None
    erred: bool

    @classmethod
    def of(cls, config: OtelConfig) -> TaskRules:
        """A worker's own, from its config"""
        return cls(config.task_spans, config.task_sample_ratio, config.task_slower_than,
                   config.task_erred)

    def of_span(self, block: Mapping[str, Any] | None, sampled: bool) -> TaskRules | None:
        """The rules of one Dask span's tasks: these with its client block's values
        (:func:`dask_otel.annotation.task_rules`) over them, key by key; None when
        none of its tasks can get a span (its trace is dropped, or ``spans`` is off)"""
        if not sampled:
            return None
        given = {k.replace("-", "_"): v for k, v in (block or {}).items()}
        rules = replace(self, **given) if given else self
        return rules if rules.spans else None

    def decide(self, key: Key, erred: bool | None = None, duration: float = 0.0) -> bool | None:
        """Whether a run of ``key`` gets a task span. Before the run (``erred``
        None): True if its key is chosen (its span is then current while it runs),
        None if only the ``erred`` and ``slower-than`` rules can tell, after it,
        False if neither can. After it: whether they do."""
        if erred is None:
            if key_chosen(key, self.sample_ratio):
                return True
            return None if self.erred or self.slower_than is not None else False
        return (erred and self.erred) or (
            self.slower_than is not None and duration >= self.slower_than
        )


@dataclass(slots=True)
class TaskRun:
    """One run of a task that may get a task span: made by :meth:`TaskSpans.start`,
    handed back to :meth:`TaskSpans.finish` by the hook"""

    key: Key
    dask_span: DaskSpanContext
    #: the context the task runs in: its task span's if ``chosen``, else its Dask span's
    context: Context
    #: the task span's id, ready for the rules that decide after the run
    span_id: int
    #: chosen before the run (:meth:`TaskRules.decide`)
    chosen: bool
    #: ``Worker.scheduler_delay`` as the run reads it (no await between this and
    #: Dask's read): the offset Dask adds to the run's times
    delay: float

    @property
    def otel(self) -> Mapping[str, Any] | None:
        """The task's ``otel`` annotation, passed on to its sub-tasks"""
        return self.dask_span.otel


@dataclass(eq=False)
class TaskSpans:
    """Starts and exports the task spans of one worker"""

    worker: Worker
    #: the worker process's span processors
    sink: SpanSink
    #: ``otel.errors.messages``: exception messages and tracebacks exported
    messages: bool = True
    #: task spans handed to the span processors
    exported: int = 0
    _random: random.Random = field(default_factory=random.Random)
    #: Whether this worker shares the scheduler's clock (same host); None:
    #: not looked at yet (the scheduler's address is known once running)
    _same_clock: bool | None = None
    #: ``thread.name`` by thread id: the process's live threads when last
    #: listed (Dask's executor threads live as long as the worker)
    _thread_names: dict[int, str] = field(default_factory=dict)

    def start(self, key: Key, dask_span: DaskSpanContext) -> TaskRun | DaskSpanContext:
        """The run of a task whose Dask span's tasks may get spans (``dask_span.rules``): in
        its task span's context if its key is chosen, else in its Dask span's"""
        chosen = dask_span.rules.decide(key)  # type: ignore[union-attr]
        if chosen is False:
            return dask_span  # runs as if there were no task spans
        span_id = self._random.getrandbits(64) or 1
        context = dask_span.context
        if chosen:
            context = in_context(child_context(dask_span.span_context, span_id), context)
        return TaskRun(key, dask_span, context, span_id, chosen, self.worker.scheduler_delay)

    def finish(self, run: TaskRun, event: StateMachineEvent) -> None:
        """Export the run's span if a rule says so, from the event ``execute``
        returned (a RescheduleEvent exports nothing)"""
        erred = isinstance(event, ExecuteFailureEvent)
        if not erred and not isinstance(event, ExecuteSuccessEvent):
            return
        start, stop = event.start, event.stop
        if start is None or stop is None:  # failed before the function ran
            start = stop = time()
        elif self.same_clock():  # the worker's own clock: Dask's offset undone
            start, stop = start - run.delay, stop - run.delay
        duration = max(stop - start, 0.0)  # as Dask measured it
        # the Dask span starts no later than the client entered its block
        start = max(start, entered_at(run.otel, run.dask_span.dask_id))
        stop = max(stop, start)
        if not (run.chosen or run.dask_span.rules.decide(run.key, erred, duration)):
            return
        self.sink.emit(self._span(run, event, start, stop, duration, erred))
        self.exported += 1

    def same_clock(self) -> bool:
        """Whether the worker runs on the scheduler's host (then it reads the
        same clock: Dask's estimated offset is only error)"""
        if self._same_clock is None:
            try:
                scheduler = self.worker.scheduler.address
                self._same_clock = scheduler.startswith("inproc://") or (
                    get_address_host(scheduler) == get_address_host(self.worker.address))
            except Exception:
                self._same_clock = False
        return self._same_clock

    def thread_name(self, ident: int) -> str | None:
        """The name of the thread ``ident`` (``Dask-Default-Threads-4211-0``); the
        live threads are listed again only for an id not seen yet"""
        name = self._thread_names.get(ident)
        if name is None:
            self._thread_names = {t.ident: t.name for t in threading.enumerate() if t.ident}
            name = self._thread_names.get(ident)
        return name

    def _span(self, run: TaskRun, event: ExecuteSuccessEvent | ExecuteFailureEvent,
              start: float, stop: float, duration: float, erred: bool) -> ReadableSpan:
        sink = self.sink
        parent = run.dask_span.kept or run.dask_span.span_context
        attributes: dict[str, Any] = {
            attr.TASK_KEY: str(run.key),
            attr.SPAN_ID: run.dask_span.dask_id,
            attr.WORKER_ADDRESS: self.worker.address,
            attr.DURATION: duration,
        }
        thread = self.worker.threads.get(run.key)
        if thread is not None:
            attributes[attr.THREAD_ID] = thread
            if (name := self.thread_name(thread)) is not None:
                attributes[attr.THREAD_NAME] = name
        ts = self.worker.state.tasks.get(run.key)
        if ts is not None and (function := function_name(ts.run_spec)) is not None:
            attributes[attr.CODE_FUNCTION_NAME] = function
        events: tuple[Event, ...] = ()
        status: Status | None = None
        if erred:
            exc_type, message = _exception_type_and_message(event)
            status = Status(StatusCode.ERROR, sink.name(f"{exc_type}: {message}"
                                                        if self.messages else exc_type))
            attributes[attr.ERROR_TYPE] = exc_type
            exception = {attr.EXCEPTION_TYPE: exc_type}
            if self.messages:
                exception[attr.EXCEPTION_MESSAGE] = message
                exception[attr.EXCEPTION_STACKTRACE] = event.traceback_text or ""
            limited = sink.event_attributes(exception, count=sink.limits.max_event_attributes)
            events = (Event(attr.EXCEPTION_EVENT, limited, int(stop * 1e9)),)
        else:
            attributes[attr.OUTPUT_BYTES] = event.nbytes
        attributes.update(labels(run.otel))  # its block's
        # The task span is this worker's; its parent, the Dask span, is the
        # scheduler's (remote here), with the ids every process composes alike
        context = child_context(parent, run.span_id)
        return sink.span(TASK_SPAN_NAME.format(key_split(run.key)), context, parent, start, stop,
                         attributes, status, events)


def function_name(run_spec: Any) -> str | None:
    """OTel's ``code.function.name`` of a task: ``module.qualname`` of the function
    Dask runs for it, through ``functools.partial``; None for an alias or data"""
    func = task_function(run_spec)
    if func is None:
        return None
    while isinstance(func, functools.partial):
        func = func.func
    qualname = getattr(func, "__qualname__", None)
    if not isinstance(qualname, str):  # a callable object
        func = type(func)
        qualname = func.__qualname__
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _exception_type_and_message(event: ExecuteFailureEvent) -> tuple[str, str]:
    """The exception's type name (as the SDK's ``record_exception`` writes it) and
    message, from the pickled exception the event holds, else from its ``repr``"""
    try:
        exc = pickle.loads(event.exception.data)
        if isinstance(exc, BaseException):
            return type(exc).__qualname__, str(exc)
    except Exception:
        pass
    text = event.exception_text or ""
    name, paren, rest = text.partition("(")
    if paren and name.isidentifier():
        return name, rest.removesuffix(")")
    return "Exception", text
