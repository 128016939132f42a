"""The OpenTelemetry context that code inside a Dask task runs in.

While a task runs on a worker with the bridge on, ``trace.get_current_span()`` is
the task's Dask span as the scheduler's mirror exports it (or its task span, see
:mod:`dask_otel.task_spans`): spans that instrumented libraries or
``tracer.start_as_current_span`` make inside the task are its children, in its
trace, and log records carry its ids. Nothing is sent for this: a task's
annotations already name its Dask span (``ts.annotations["span"]["ids"]``, root
first, own last) and, when the workflow joined a caller's trace, the caller's
propagated context (``ts.annotations["otel"]["carrier"]``, see
:mod:`dask_otel.client`).

Ids (the mapping contract)
    span id = the low 64 bits of the task's own Dask span UUID; trace id = the
    remote parent's trace id if the carrier holds one, else the root Dask span's
    UUID. The sampled flag is :func:`dask_otel.sampling.trace_sampled`, the answer
    the scheduler's mirror gets too. The carrier's baggage and trace state are kept,
    so outgoing instrumented calls propagate them.

Mechanism
    distributed has no public "around a task" hook. ``Worker.execute(key, *,
    stimulus_id)`` is the coroutine the worker's state machine calls, as
    ``self.execute``, in an asyncio task of its own; it runs sync tasks with
    ``run_in_executor_with_context`` (contextvars are copied into the executor
    thread) and coroutine tasks on the event loop. :class:`TaskContextHook` puts a
    wrapper in the worker *instance*'s ``execute`` attribute that attaches the
    task's context, awaits the original and detaches, and removes it on teardown.
    It is installed only where feature detection finds that shape (distributed
    2024.1.0 to 2026.8 at least); elsewhere it logs once at INFO and tasks run
    untouched. Any error while building a context runs the task without one: the
    bridge never fails a task. Tasks of a ``ProcessPoolExecutor`` run in another
    process, which contextvars do not reach: they get no context.

Cost
    Contexts are cached per Dask span (a bounded dict), so a task costs two dict
    lookups, an attach and a detach; ``benchmarks/task_context.py`` measures it.

Sub-tasks
    A task that submits tasks with ``worker_client()`` hands them its Dask span
    (distributed's own ``dask.annotate(span=...)``) and, here, its ``otel``
    annotation, so that their context joins the same trace on whichever worker
    runs them.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import dask
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dask_otel.client import root_carrier
from dask_otel.sampling import trace_sampled
from dask_otel.ids import otel_span_id, trace_id_of
from dask_otel.telemetry import adopt_global_tracer_provider

if TYPE_CHECKING:
    from distributed import Worker
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.sampling import Sampler

    from dask_otel.telemetry import Telemetry

logger = logging.getLogger("dask_otel")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
#: Most Dask spans whose context a worker keeps; past it the cache starts over
MAX_CACHED_SPANS = 4096


class DaskSpanContext:
    """What a task of one Dask span runs in: built once per Dask span and carrier"""

    __slots__ = ("context", "dask_id", "otel", "root_tag", "sampled", "span_context")

    #: no task span: the hook treats a DaskSpanContext as a run without one
    span_id = 0

    def __init__(
        self,
        span_context: SpanContext,
        base: Context | None,
        root_tag: str,
        dask_id: str,
        otel: Mapping[str, Any] | None,
    ):
        #: the ``otel`` annotation of the span's tasks, passed on to sub-tasks
        self.otel = otel
        #: the Dask span's UUID (``ts.annotations["span"]["ids"][-1]``)
        self.dask_id = dask_id
        #: the Dask span's ids, as the scheduler's mirror exports them
        self.span_context = span_context
        #: ``span_context`` as the current span, over the carrier's baggage if any
        self.context = trace.set_span_in_context(NonRecordingSpan(span_context), base)
        #: the whole trace's sampling decision
        self.sampled = span_context.trace_flags.sampled
        #: the root Dask span's first tag (what the sampler is asked about)
        self.root_tag = root_tag


def _carrier_key(carrier: Mapping[str, str]) -> Hashable:
    return tuple(carrier.items())


class TaskContexts:
    """Builds the OTel context of tasks from their annotations, cached per Dask span.

    ``sampler`` is the one the scheduler's mirror asks too (``OTEL_TRACES_SAMPLER``);
    its decisions are part of the cached value, so it must not change.
    """

    #: the sampler that decides whether a trace is sampled
    sampler: Sampler
    #: by (own Dask span id, root Dask span id, carrier items)
    _cache: dict[Hashable, DaskSpanContext]

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._cache = {}

    def of(self, annotations: Mapping[str, Any] | None) -> DaskSpanContext | None:
        """The context of a task with these annotations; None for a task in no
        Dask span (annotations lost to graph optimisation, hand-made graphs).

        Raises on malformed annotations; the caller runs the task without context.
        """
        if not annotations:
            return None
        span = annotations.get("span")
        if not span:
            return None
        ids = span["ids"]
        otel = annotations.get("otel")
        if otel is None:  # most tasks: a distributed.span, no caller (per task: no ABC check)
            carrier = None
            key = (ids[-1], ids[0], None)
        else:
            carrier = root_carrier(otel, ids[0])  # as the scheduler reads it
            key = (ids[-1], ids[0], _carrier_key(carrier) if carrier else None)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_CACHED_SPANS:
                self._cache.clear()
            cached = self._cache[key] = self._build(ids, span["name"], carrier, otel)
        return cached

    def _build(
        self,
        ids: tuple[str, ...],
        name: tuple[str, ...],
        carrier: Mapping[str, str] | None,
        otel: Mapping[str, Any] | None,
    ) -> DaskSpanContext:
        root_tag = str(name[0]) if name else "default"
        base = remote = None
        if carrier:
            # The globally configured propagators decide the format (OTEL_PROPAGATORS)
            base = propagate.extract(carrier)
            remote = trace.get_current_span(base).get_span_context()
            if not remote.is_valid:
                remote = None
        trace_id = trace_id_of(ids[0], remote)
        sampled = trace_sampled(self.sampler, trace_id, root_tag, remote)
        span_context = SpanContext(
            trace_id,
            otel_span_id(ids[-1]),
            is_remote=True,  # made by the scheduler, in another process
            trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
            trace_state=remote.trace_state if remote else None,
        )
        return DaskSpanContext(span_context, base, root_tag, str(ids[-1]), otel)


def default_sampler() -> Sampler:
    """The sampler the SDK builds from OTEL_TRACES_SAMPLER / _ARG (default:
    parent-based always-on), for a worker where the bridge builds no TracerProvider"""
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(shutdown_on_exit=False).sampler


def start_task_context(worker: Worker, telemetry: Telemetry) -> TaskContextHook | None:
    """Install the in-task context on ``worker``; None where it cannot be.

    The sampler is the bridge's TracerProvider's when traces are exported (the
    one the scheduler's mirror asks), else the SDK's default from OTEL_*.
    """
    sink = telemetry.spans  # built here: user spans inside tasks need a provider
    sampler = sink.provider.sampler if sink is not None else default_sampler()
    task_spans = None
    if sink is not None:
        adopt_global_tracer_provider()
        if telemetry.config.task_spans:
            from dask_otel.task_spans import TaskSpans

            task_spans = TaskSpans(worker, sink, telemetry.config)
    return TaskContextHook.install(worker, TaskContexts(sampler), task_spans)


def execute_hookable(worker: Any) -> str | None:
    """Why ``worker.execute`` cannot carry the in-task context, or None if it can.

    The hook needs ``execute`` to be a coroutine function taking the task's key
    as its first argument and the worker state machine's ``state.tasks`` to find
    the task's annotations.
    """
    execute = getattr(type(worker), "execute", None)
    if execute is None or not inspect.iscoroutinefunction(execute):
        return "Worker.execute is not a coroutine function"
    params = list(inspect.signature(execute).parameters)
    if params[1:2] != ["key"]:
        return f"Worker.execute takes {params[1:]}, not (key, ...)"
    if "execute" in vars(worker):
        return "Worker.execute is already replaced on this worker"
    tasks = getattr(getattr(worker, "state", None), "tasks", None)
    if not isinstance(tasks, Mapping):
        return "the worker has no state.tasks"
    return None


#: Logged the "cannot install" INFO line in this process already
_told_unhookable = False


def _tell_unhookable(reason: str) -> None:
    global _told_unhookable
    if not _told_unhookable:
        _told_unhookable = True
        logger.info(
            "dask_otel: tasks run without an OpenTelemetry context on this worker "
            "(%s; distributed %s)", reason, _distributed_version(),
        )


def _distributed_version() -> str:
    import distributed

    return getattr(distributed, "__version__", "?")


class TaskRun:
    """One run of one task with a context: the hook hands it to the task spans"""

    __slots__ = ("chosen", "context", "dask_span", "key", "otel", "span_id")

    def __init__(
        self,
        key: Any,
        dask_span: DaskSpanContext,
        context: Context,
        span_id: int,
        otel: Mapping[str, Any] | None,
    ):
        self.key = key
        #: the task's ``otel`` annotation, passed on to its sub-tasks
        self.otel = otel
        #: the task's Dask span context
        self.dask_span = dask_span
        #: the context the task runs in: its Dask span's, or its task span's
        self.context = context
        #: the task span's id; 0 when the task can have no task span
        self.span_id = span_id
        #: True when the task span is ``context``'s current span (chosen by ratio)
        self.chosen = False


class TaskContextHook:
    """Wraps one worker's ``execute`` so that every task runs in its OTel context.

    ``task_spans`` (optional, :class:`dask_otel.task_spans.TaskSpans`) is told
    before and after each run. Install with :meth:`install`; :meth:`uninstall`
    puts ``Worker.execute`` back (or, when something wrapped it after us, turns
    ours into a pass-through).
    """

    #: the worker whose ``execute`` is wrapped
    worker: Worker
    contexts: TaskContexts
    #: :class:`dask_otel.task_spans.TaskSpans` or None
    task_spans: Any
    #: False after :meth:`uninstall`: the wrapper then only calls the original
    active: bool
    #: tasks that ran without context because building it failed
    errors: int

    def __init__(self, worker: Worker, contexts: TaskContexts, task_spans: Any = None):
        self.worker = worker
        self.contexts = contexts
        self.task_spans = task_spans
        self.active = True
        self.errors = 0
        self._wrapper: Callable | None = None
        # WorkerState creates its tasks dict once and keeps it
        self._tasks = worker.state.tasks

    @classmethod
    def install(
        cls, worker: Worker, contexts: TaskContexts, task_spans: Any = None
    ) -> TaskContextHook | None:
        """Wrap ``worker.execute``; None (and one INFO log per process) when this
        distributed does not have the shape the hook needs"""
        reason = execute_hookable(worker)
        if reason is not None:
            _tell_unhookable(reason)
            return None
        hook = cls(worker, contexts, task_spans)
        hook._wrap(worker.execute)
        return hook

    def _wrap(self, original: Callable) -> None:
        prepare = self.prepare
        finish = self.finish
        attach, detach = otel_context.attach, otel_context.detach

        async def execute(key: Any, *args: Any, **kwargs: Any) -> Any:
            run = prepare(key)
            if run is None:
                return await original(key, *args, **kwargs)
            token = attach(run.context)
            try:
                if run.otel is None:
                    event = await original(key, *args, **kwargs)
                else:
                    # Sub-tasks submitted from inside the task (worker_client())
                    # inherit the otel annotation, as distributed makes them
                    # inherit span
                    with dask.annotate(otel=run.otel):
                        event = await original(key, *args, **kwargs)
            finally:
                detach(token)
            if run.span_id:
                finish(run, event)
            return event

        execute.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapper = execute
        self.worker.execute = execute  # type: ignore[method-assign]

    def prepare(self, key: Any) -> TaskRun | DaskSpanContext | None:
        """The run of the task ``key`` (its Dask span's context when it can have no
        task span), or None to run it untouched; never raises"""
        if not self.active:
            return None
        try:
            ts = self._tasks.get(key)
            if ts is None:
                return None
            dask_span = self.contexts.of(ts.annotations)
            if dask_span is None or self.task_spans is None or not dask_span.sampled:
                return dask_span
            return self.task_spans.start(key, ts, dask_span)
        except Exception:
            self._failed("build the context of task %r", key)
            return None

    def finish(self, run: TaskRun, event: Any) -> None:
        """Hand a finished run to the task spans; never raises"""
        try:
            self.task_spans.finish(run, event)
        except Exception:
            self._failed("export the span of task %r", run.key)

    def _failed(self, what: str, key: Any) -> None:
        self.errors += 1
        what = what % (key,)
        if self.errors == 1:
            logger.exception(
                "dask_otel: could not %s; the task runs without it (logged once)", what
            )
        else:
            logger.debug("dask_otel: could not %s", what, exc_info=True)

    def uninstall(self) -> None:
        """Put ``Worker.execute`` back; if another wrapper sits on ours, ours
        becomes a pass-through instead"""
        self.active = False
        if vars(self.worker).get("execute") is self._wrapper:
            del self.worker.execute
