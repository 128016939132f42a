"""The hook around ``Worker.execute`` that runs every task in its OTel context.

While a task runs on a worker with the bridge on, ``trace.get_current_span()`` is
the task's Dask span as the scheduler's mirror exports it (or its task span,
:mod:`dask_otel.worker.task_spans`): spans that instrumented libraries or
``tracer.start_as_current_span`` make inside the task are its children, in its
trace, and log records carry its ids (:mod:`dask_otel.worker.task_context`
builds the context).

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

Sub-tasks
    A task that submits tasks with ``worker_client()`` hands them its Dask span
    (distributed's own ``dask.annotate(span=...)``) and, here, its ``otel``
    annotation, so that their context joins the same trace on whichever worker
    runs them.

Cost: two dict lookups, an attach and a detach per task
(``benchmarks/task_context.py``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import dask
from opentelemetry import context as otel_context

from dask_otel.annotation import ANNOTATION
from dask_otel.worker.task_spans import TaskRun

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed import Worker
    from distributed.worker_state_machine import StateMachineEvent

    from dask_otel.worker.task_context import DaskSpanContext, TaskContexts
    from dask_otel.worker.task_spans import TaskSpans

logger = logging.getLogger("dask_otel")


def execute_hookable(worker: Worker) -> str | None:
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


class TaskContextHook:
    """Wraps one worker's ``execute`` so that every task runs in its OTel context.

    ``task_spans`` (optional, :class:`~dask_otel.worker.task_spans.TaskSpans`)
    is told before and after each run. Install with :meth:`install`; :meth:`uninstall`
    puts ``Worker.execute`` back (or, when something wrapped it after us, turns
    ours into a pass-through).
    """

    #: the worker whose ``execute`` is wrapped
    worker: Worker
    #: builds each task's context from its annotations
    contexts: TaskContexts
    #: told before and after each run (None: task spans are off in the worker's config)
    task_spans: TaskSpans | None
    #: told before and after the runs of tasks whose client block set task span
    #: rules (``dask_otel.span(tasks=...)``), whatever the worker's config says;
    #: ``task_spans`` itself when that is on (None: no span is exported here)
    on_request: TaskSpans | None
    #: False after :meth:`uninstall`: the wrapper then only calls the original
    active: bool
    #: tasks that ran without context because building it failed
    errors: int

    def __init__(
        self,
        worker: Worker,
        contexts: TaskContexts,
        task_spans: TaskSpans | None = None,
        on_request: TaskSpans | None = None,
    ):
        self.worker = worker
        self.contexts = contexts
        self.task_spans = task_spans
        self.on_request = task_spans if task_spans is not None else on_request
        self.active = True
        self.errors = 0
        #: the wrapper in ``worker.execute`` (None: not installed)
        self._wrapper: Callable | None = None
        #: ``worker.state.tasks``: WorkerState creates it once and keeps it
        self._tasks = worker.state.tasks

    @classmethod
    def install(
        cls,
        worker: Worker,
        contexts: TaskContexts,
        task_spans: TaskSpans | None = None,
        on_request: TaskSpans | None = None,
    ) -> TaskContextHook | None:
        """Wrap ``worker.execute``; None (and one INFO log per process) when this
        distributed does not have the shape the hook needs"""
        reason = execute_hookable(worker)
        if reason is not None:
            _tell_unhookable(reason)
            return None
        hook = cls(worker, contexts, task_spans, on_request)
        hook._wrap(worker.execute)
        return hook

    def _wrap(self, original: Callable) -> None:
        prepare = self.prepare
        finish = self.finish
        attach, detach = otel_context.attach, otel_context.detach

        async def execute(key: Key, *args: Any, **kwargs: Any) -> Any:
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
                    with dask.annotate(**{ANNOTATION: run.otel}):
                        event = await original(key, *args, **kwargs)
            finally:
                detach(token)
            if type(run) is TaskRun:  # not a plain Dask span context
                finish(run, event)
            return event

        execute.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapper = execute
        self.worker.execute = execute  # type: ignore[method-assign]

    def prepare(self, key: Key) -> TaskRun | DaskSpanContext | None:
        """The run of the task ``key``: a :class:`TaskRun` when it may have a task
        span, its Dask span's context when it cannot, or None to run it
        untouched; never raises. Both have the ``context`` and ``otel`` the
        wrapper needs."""
        if not self.active:
            return None
        try:
            ts = self._tasks.get(key)
            if ts is None:
                return None
            dask_span = self.contexts.of(ts.annotations)
            if dask_span is None or not dask_span.sampled:
                return dask_span
            task_spans = self.task_spans
            if task_spans is None:  # off here, unless the task's block asks
                if dask_span.tasks is None or (task_spans := self.on_request) is None:
                    return dask_span
            return task_spans.start(key, dask_span)
        except Exception:
            self._failed("build the context of task %r", key)
            return None

    def finish(self, run: TaskRun, event: StateMachineEvent) -> None:
        """Hand a finished run to the task spans; never raises"""
        try:
            self.on_request.finish(run, event)  # type: ignore[union-attr]
        except Exception:
            self._failed("export the span of task %r", run.key)

    def _failed(self, what: str, key: Key) -> None:
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
