"""Every attribute key (and span event name) the bridge puts on its spans, metric
points and log records, spelled once (a blocked event loop's: :mod:`dask_otel.stalls`).

The standard ones come from ``opentelemetry.semconv``'s stable attributes (the
same names in semantic-conventions 0.62b0, which opentelemetry 1.41 pulls in, and
0.66b2); the ``dask.*`` ones are the bridge's. What each means, on which spans:
docs/traces.md; every name with its type and unit: the registry, model/. Constants
and :func:`snake`: importing this module costs one import of ``opentelemetry.semconv``'s
small attribute modules, nothing per span.
"""

from __future__ import annotations

import re

# Re-exported (``X as X``): the stable names, as the conventions spell them
from opentelemetry.semconv.attributes.code_attributes import (
    CODE_FUNCTION_NAME as CODE_FUNCTION_NAME,
)
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE as ERROR_TYPE
from opentelemetry.semconv.attributes.error_attributes import ErrorTypeValues
from opentelemetry.semconv.attributes.exception_attributes import (
    EXCEPTION_MESSAGE as EXCEPTION_MESSAGE, EXCEPTION_STACKTRACE as EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE as EXCEPTION_TYPE,
)

#: ``error.type`` when Dask kept no exception text (the conventions' fallback)
OTHER_ERROR: str = ErrorTypeValues.OTHER.value
#: ``thread.id`` and ``thread.name`` of the thread a task ran in: in
#: semantic-conventions 0.62b0 to 0.66b2 only in ``opentelemetry.semconv._incubating``
#: (a private module path), so spelled here
THREAD_ID, THREAD_NAME = "thread.id", "thread.name"
#: The span event of an erred task span, as the conventions name it
EXCEPTION_EVENT = "exception"
#: The registry (model/manifest.yaml): the schema_url of every scope of the bridge
SCHEMA_URL = "https://dask-otel.dev/schemas/1.0.0"


def snake(part: object) -> str:
    """Dask's word (activity, state, event field) as a name's part: thread-cpu -> thread_cpu"""
    return re.sub(r"[^a-z0-9]+", "_", str(part).lower()).strip("_") or "_"

# --- a Dask span: on its OTel span, its TaskGroups', its task spans, links, events

#: The Dask span's UUID; never cut to the length limit (dask_otel.export.sink)
SPAN_ID = "dask.span.id"
#: ``Span.name``: every tag, root first
SPAN_NAME = "dask.span.name"
SPAN_CODE = "dask.span.code"
SPAN_UNFINISHED = "dask.span.unfinished"
#: A span Dask made none of: every task of its block joined an older TaskGroup
SPAN_COLLIDED = "dask.span.collided"
#: Why a run the sampler dropped was kept (``otel.traces.keep``): ``erred``, ``slow``
TRACE_KEPT = "dask.trace.kept"
ACTIVE_CPU_SECONDS = "dask.active_cpu_seconds"
#: Thread time of a span that no task accounts for, as Dask's
#: ``Span.cumulative_worker_metrics`` has it
IDLE = "dask.metrics.execute.idle_or_other_spans.seconds"
FIRST_TASK_START = "dask.first_task_start"

# --- task counts (a Dask span's, a TaskGroup batch's)

#: ``dask.tasks.<state>`` is each state's count; ``TASKS_TOTAL`` their sum
TASKS_PREFIX = "dask.tasks."
TASKS_TOTAL = "dask.tasks.total"
TASKS_ERRED = "dask.tasks.erred"
OUTPUT_BYTES = "dask.output.bytes"
DURATION = "dask.duration"

# --- TaskGroup spans and task spans

TASKGROUP_NAME = "dask.taskgroup.name"
TASKGROUP_PREFIX = "dask.taskgroup.prefix"
TASK_KEY = "dask.task.key"
WORKER_ADDRESS = "dask.worker.address"

# --- a worker lost (dask_otel.scheduler.events): the span event and its log records

WORKER_LOST = "dask.worker.lost"
WORKER_LOST_REASON = "dask.worker.lost.reason"
TASKS_PROCESSING = "dask.tasks.processing"
TASKS_LOST_COMPUTED = "dask.tasks.lost_computed"
SPAN_TASKS_PROCESSING = "dask.span.tasks.processing"
SPAN_TASKS_LOST_COMPUTED = "dask.span.tasks.lost_computed"

#: Dask's events as log records: ``dask.event.<field>`` for an event's scalar fields
EVENT_PREFIX = "dask.event."
EVENT_TOPIC = "dask.event.topic"
EVENT_CATEGORY = "dask.event.category"

# --- metric points (docs/metrics.md): the fine metrics, the spill instruments,
# Dask's families, the self-metrics; and the resource

SCHEDULER_ADDRESS = "dask.scheduler.address"
WORKER_NAME = "dask.worker.name"
#: Same attribute on the fine performance metrics and the spill counters
ACTIVITY = "dask.activity.name"
ACTIVITY_CONTEXT = "dask.activity.context"
ACTIVITY_WHERE = "dask.activity.where"
TASK_PREFIX = "dask.task.prefix"
THRESHOLD = "dask.threshold"
OTEL_EXPORTER = "dask.otel.exporter"
OTEL_SIGNAL = "dask.otel.signal"

# --- outcomes (dask_otel.scheduler.outcomes: docs/metrics.md, "Workflow outcomes and
# removed workers")

#: The root Dask span's first tag where the user says it is bounded, else ``other``
WORKFLOW_NAME = "dask.workflow.name"
#: A state of Dask's tasks (``TaskState.state``), on ``dask.workflow.tasks``
TASK_STATE = "dask.task.state"
#: How a workflow run ended: ``ok``, ``erred`` or ``cancelled``
WORKFLOW_RESULT = "dask.workflow.result"
#: Why a worker left: ``memory_restart``, ``fail_hard``, ``retired``, ``closed``, ``lost``
WORKER_REMOVED_REASON = "dask.worker.removed.reason"
