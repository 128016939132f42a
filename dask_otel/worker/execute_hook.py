"""The hook around a worker instance's ``execute`` that runs every task in its OTel context
(:mod:`~dask_otel.worker.task_context`) and tells the task spans
(:mod:`~dask_otel.worker.task_spans`) before and after each run: docs/traces.md,
"Inside tasks". ``Worker.execute`` runs sync tasks with ``run_in_executor_with_context``
(contextvars reach the executor thread) and coroutine tasks on the event loop. An error
while building a context runs the task without one. Cost: ``benchmarks/task_context.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dask
import distributed
from opentelemetry import context as otel_context

from dask_otel._compat import execute_hookable
from dask_otel.annotation import ANNOTATION
from dask_otel.log import logger
from dask_otel.worker.task_spans import TaskRun

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed import Worker

    from dask_otel.worker.task_context import DaskSpanContext, TaskContexts
    from dask_otel.worker.task_spans import TaskSpans

#: Logged the "cannot install" INFO line in this process already
_told_unhookable = False


@dataclass(slots=True)
class TaskContextHook:
    """Wraps one worker's ``execute`` (:meth:`install`, :meth:`uninstall`) so that
    every task runs in its OTel context"""

    worker: Worker
    #: builds each task's context from its annotations
    contexts: TaskContexts
    #: told before and after the runs that may get a task span (None: this
    #: worker exports no traces)
    task_spans: TaskSpans | None = None
    #: False after :meth:`uninstall`: the wrapper then only calls the original
    active: bool = True
    #: tasks that ran without context because building it failed
    errors: int = 0
    #: the wrapper in ``worker.execute`` (None: not installed)
    wrapper: Callable | None = None

    @classmethod
    def install(cls, worker: Worker, contexts: TaskContexts, task_spans: TaskSpans | None = None
                ) -> TaskContextHook | None:
        """Wrap ``worker.execute``; None (and one INFO log per process) when this
        distributed does not have the shape the hook needs"""
        global _told_unhookable
        if (reason := execute_hookable(worker)) is not None:
            if not _told_unhookable:
                _told_unhookable = True
                logger.info("dask_otel: tasks run without an OpenTelemetry context on this worker "
                            "(%s; distributed %s)", reason, distributed.__version__)
            return None
        hook = cls(worker, contexts, task_spans)
        hook.wrap(worker.execute)
        return hook

    def wrap(self, original: Callable) -> None:
        prepare = self.prepare
        attach, detach = otel_context.attach, otel_context.detach

        async def execute(key: Key, *args: Any, **kwargs: Any) -> Any:
            run = prepare(key)
            if run is None:
                return await original(key, *args, **kwargs)
            token = attach(run.context)
            try:
                if run.otel is None:
                    event = await original(key, *args, **kwargs)
                else:  # sub-tasks (worker_client()) inherit it, as they inherit span
                    with dask.annotate(**{ANNOTATION: run.otel}):
                        event = await original(key, *args, **kwargs)
            finally:
                detach(token)
            if type(run) is TaskRun:  # not a plain Dask span context
                try:
                    self.task_spans.finish(run, event)  # type: ignore[union-attr]
                except Exception:
                    self._failed("export the span of task %r", run.key)
            return event

        execute.__wrapped__ = original  # type: ignore[attr-defined]
        self.wrapper = execute
        self.worker.execute = execute  # type: ignore[method-assign]

    def prepare(self, key: Key) -> TaskRun | DaskSpanContext | None:
        """The run of the task ``key``: a :class:`TaskRun` when it may get a task
        span, its Dask span's context when it cannot, or None to run it untouched;
        never raises. Both have the ``context`` and ``otel`` the wrapper needs."""
        if not self.active:
            return None
        try:
            ts = self.worker.state.tasks.get(key)
            dask_span = self.contexts.of(ts.annotations) if ts is not None else None
            if dask_span is None or dask_span.rules is None:
                return dask_span
            return self.task_spans.start(key, dask_span)  # type: ignore[union-attr]
        except Exception:
            self._failed("build the context of task %r", key)
            return None

    def _failed(self, what: str, key: Key) -> None:
        self.errors += 1
        if self.errors == 1:
            logger.exception("dask_otel: could not %s; the task runs without it (logged once)",
                             what % (key,))
        else:
            logger.debug("dask_otel: could not %s", what % (key,), exc_info=True)

    def uninstall(self) -> None:
        """Put ``Worker.execute`` back; if another wrapper sits on ours, ours
        becomes a pass-through instead"""
        self.active = False
        if vars(self.worker).get("execute") is self.wrapper:
            del self.worker.execute
