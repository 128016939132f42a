"""Task spans: each chosen task run as an OpenTelemetry span, built by the worker
that ran it (``otel.tasks.spans: true``); the scheduler does no work for them.
What is exported and which tasks: docs/traces.md, "Task spans (opt-in)".

Owns the rules that choose a run (:func:`key_chosen`: a hash of the key, the same
in every process and retry; ``slower-than`` and ``erred`` decide after the run;
:class:`TaskRules`: the worker's ``otel.tasks.*``, or a client block's values over
them, ``dask_otel.span(tasks=...)``) and the span's times and attributes. Invariants:

- only in traces the sampler keeps (the decision the mirror gets,
  :func:`dask_otel.span_context.trace_sampled`); a child of the task's Dask span,
  with a random id (:func:`dask_otel.span_context.child_context`);
- its times are Dask's (``ExecuteSuccessEvent``/``ExecuteFailureEvent``), shifted
  by Dask onto the scheduler's clock; on the scheduler's host that shift is
  undone (exact: it is the offset Dask used), so the span lies inside its Dask
  span; elsewhere it starts no earlier than the client entered the block of
  its Dask span;
- a run rescheduled (``Reschedule``, worker closing) exports nothing; one that
  failed before its function ran is a zero-length span at the failure.

Cost: per task in a sampled trace, a random id, and a hash of its key when the
ratio is strictly between 0 and 1; per task span exported, one attribute dict
and the sink's checks (``benchmarks/task_context.py``).
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Mapping
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.metrics import time
from distributed.worker_state_machine import ExecuteFailureEvent, ExecuteSuccessEvent
from opentelemetry import trace
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import NonRecordingSpan, Status, StatusCode

import dask_otel.attributes as attr
from dask_otel._compat import task_function
from dask_otel.annotation import entered_at
from dask_otel.span_context import child_context

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
_UNSET = Status(StatusCode.UNSET)
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


class TaskRules:
    """Which runs of a task get a span: the ``otel.tasks.*`` values, a worker's
    config or a client block's over it (``dask_otel.span(tasks=...)``)"""

    __slots__ = ("after_run", "erred", "ratio", "slower_than", "spans")

    #: otel.tasks.spans
    spans: bool
    #: otel.tasks.sample-ratio
    ratio: float
    #: otel.tasks.slower-than, seconds, or None
    slower_than: float | None
    #: otel.tasks.erred
    erred: bool
    #: a rule may export a task after its run: it needs a span id ready
    after_run: bool

    def __init__(self, spans: bool, ratio: float, slower_than: float | None, erred: bool):
        self.spans = spans
        self.ratio = ratio
        self.slower_than = slower_than
        self.erred = erred
        self.after_run = slower_than is not None or erred

    @classmethod
    def of(cls, config: OtelConfig) -> TaskRules:
        return cls(
            config.task_spans, config.task_sample_ratio, config.task_slower_than,
            config.task_erred,
        )

    def over(self, tasks: Mapping[str, Any]) -> TaskRules:
        """These rules with a block's values (read by
        :func:`dask_otel.annotation.task_rules`) over them"""
        return TaskRules(
            tasks.get("spans", self.spans),
            tasks.get("sample-ratio", self.ratio),
            tasks.get("slower-than", self.slower_than),
            tasks.get("erred", self.erred),
        )


class TaskRun:
    """One run of a task in a sampled trace, which may get a task span: built by
    :meth:`TaskSpans.start`, handed back to :meth:`TaskSpans.finish` by the hook"""

    __slots__ = ("chosen", "context", "dask_span", "delay", "key", "otel", "rules", "span_id")

    #: the task's key
    key: Key
    #: the task's ``otel`` annotation, passed on to its sub-tasks
    otel: Mapping[str, Any] | None
    #: the task's Dask span context
    dask_span: DaskSpanContext
    #: the context the task runs in: its Dask span's, or its task span's
    context: Context
    #: the task span's id, kept for the rules that decide after the run
    span_id: int
    #: True when the task span is ``context``'s current span (chosen by ratio)
    chosen: bool
    #: ``Worker.scheduler_delay`` as the run reads it (no await between this
    #: and Dask's read): the offset Dask adds to the run's times
    delay: float
    #: the rules that chose it, and decide after it
    rules: TaskRules

    def __init__(
        self,
        key: Key,
        dask_span: DaskSpanContext,
        context: Context,
        span_id: int,
        otel: Mapping[str, Any] | None,
        rules: TaskRules,
    ):
        self.key = key
        self.rules = rules
        self.otel = otel
        self.dask_span = dask_span
        self.context = context
        self.span_id = span_id
        self.chosen = False
        self.delay = 0.0


class TaskSpans:
    """Starts and exports the task spans of one worker"""

    #: the worker whose tasks these are
    worker: Worker
    #: the worker process's span processors
    sink: SpanSink
    #: the worker's otel.tasks.* config
    rules: TaskRules
    #: task spans handed to the span processors
    exported: int

    def __init__(self, worker: Worker, sink: SpanSink, config: OtelConfig):
        self.worker = worker
        self.sink = sink
        self.rules = TaskRules.of(config)
        self.exported = 0
        self._random = random.Random()
        #: Whether this worker shares the scheduler's clock (same host); None:
        #: not looked at yet (the scheduler's address is known once running)
        self._same_clock: bool | None = None
        #: ``thread.name`` by thread id: the process's live threads when last
        #: listed (Dask's executor threads live as long as the worker)
        self._thread_names: dict[int, str] = {}

    def start(self, key: Key, dask_span: DaskSpanContext) -> TaskRun | DaskSpanContext:
        """The run of a task in a sampled trace: in its task span's context if its
        key is chosen, else in its Dask span's (with a span id kept for the
        threshold and erred rules, or none). The rules are the worker's, or its
        client block's over them (``dask_span.tasks``)."""
        rules = dask_span.rules
        if rules is None:  # once per Dask span (the worker caches its context)
            tasks = dask_span.tasks
            rules = dask_span.rules = self.rules if tasks is None else self.rules.over(tasks)
        if not rules.spans:
            return dask_span
        otel = dask_span.otel
        span_id = self._random.getrandbits(64) or 1
        if key_chosen(key, rules.ratio):
            own = child_context(dask_span.span_context, span_id)
            context = trace.set_span_in_context(NonRecordingSpan(own), dask_span.context)
            run = TaskRun(key, dask_span, context, span_id, otel, rules)
            run.chosen = True
        elif not rules.after_run:
            return dask_span  # runs as if there were no task spans
        else:
            run = TaskRun(key, dask_span, dask_span.context, span_id, otel, rules)
        run.delay = self.worker.scheduler_delay
        return run

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
        rules = run.rules
        if not (
            run.chosen
            or (erred and rules.erred)
            or (rules.slower_than is not None and duration >= rules.slower_than)
        ):
            return
        self.sink.emit(self._span(run, event, start, stop, duration, erred))
        self.exported += 1

    def same_clock(self) -> bool:
        """Whether the worker runs on the scheduler's host (then it reads the
        same clock: Dask's estimated offset is only error)"""
        if self._same_clock is None:
            try:
                from distributed.comm import get_address_host

                scheduler = self.worker.scheduler.address
                self._same_clock = scheduler.startswith("inproc://") or (
                    get_address_host(scheduler) == get_address_host(self.worker.address)
                )
            except Exception:
                self._same_clock = False
        return self._same_clock

    def thread_name(self, ident: int) -> str | None:
        """The name of the thread ``ident`` (Dask names its executor threads,
        e.g. ``Dask-Default-Threads-4211-0``): a dict lookup; the live threads
        are listed again only for an id not seen yet, so the cache holds no
        dead thread for long"""
        name = self._thread_names.get(ident)
        if name is None:
            self._thread_names = {t.ident: t.name for t in threading.enumerate() if t.ident}
            name = self._thread_names.get(ident)
        return name

    def _span(
        self,
        run: TaskRun,
        event: ExecuteSuccessEvent | ExecuteFailureEvent,
        start: float,
        stop: float,
        duration: float,
        erred: bool,
    ) -> ReadableSpan:
        sink = self.sink
        parent = run.dask_span.span_context
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
        status = _UNSET
        if erred:
            exc_type, message = _exception_type_and_message(event)
            status = Status(StatusCode.ERROR, sink.name(f"{exc_type}: {message}"))
            attributes[attr.ERROR_TYPE] = exc_type
            events = (
                Event(
                    attr.EXCEPTION_EVENT,
                    sink.event_attributes(
                        {
                            attr.EXCEPTION_TYPE: exc_type,
                            attr.EXCEPTION_MESSAGE: message,
                            attr.EXCEPTION_STACKTRACE: event.traceback_text or "",
                        },
                        count=sink.limits.max_event_attributes,
                    ),
                    int(stop * 1e9),
                ),
            )
        else:
            attributes[attr.OUTPUT_BYTES] = event.nbytes
        # The task span is this worker's; its parent, the Dask span, is the
        # scheduler's (remote here), with the ids every process composes alike
        context = child_context(parent, run.span_id)
        return sink.span(
            TASK_SPAN_NAME.format(key_split(run.key)), context, parent, start, stop,
            attributes, status, events,
        )


def function_name(run_spec: Any) -> str | None:
    """OTel's ``code.function.name`` of a task: the fully qualified name
    (``module.qualname``) of the function Dask runs for it
    (:func:`dask_otel._compat.task_function`), through ``functools.partial``;
    None for an alias or a data node."""
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
    message. The event holds the exception pickled (Dask truncates huge ones
    first); if it does not unpickle here, its ``repr`` is parsed instead."""
    try:
        from distributed.protocol import pickle

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
