"""Every version switch and every private surface of Dask or OpenTelemetry the
bridge reads, calls or writes, each one function with the versions that need it
(distributed's habit: ``distributed/compatibility.py``). It writes three:
``distributed.Client._graph_to_futures`` (wrapped: :func:`on_graph_sent`), the
``_parent`` of a Dask Span it built (:func:`detached_span`), and the retry backoff's
Event of an OTLP exporter it built, in opentelemetry 1.41 to 1.45.2 only
(:func:`cut_retry_waits`, gated by :data:`RETRY_WAIT_UP_TO`).

The floor is ``pyproject.toml``'s: distributed 2024.1.0, opentelemetry 1.41.
Nothing here serves a version below it. When the floor moves, delete what it
makes dead; a private name a new release drops fails the tripwire tests in
``tests/test_compat.py``, not a user's cluster.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import distributed
from distributed.protocol.serialize import ToPickle
from distributed.spans import Span
from packaging.version import Version


# --- distributed: versions ------------------------------------------------------

#: ``remove-worker`` events list the keys lost with the worker (:func:`remove_worker_lost_keys`)
REMOVE_WORKER_LISTS_LOST_KEYS = Version(distributed.__version__) >= Version("2024.3.0")


def span_code_blocks(span: Span) -> Iterable[Iterable[Any]]:
    """``Span.code``'s blocks of ``SourceCode``: distributed 2024.1 keeps each still
    wrapped in the ``ToPickle`` the client sent"""
    return (block.data if isinstance(block, ToPickle) else block for block in span.code)


def task_function(run_spec: Any) -> Callable | None:
    """The function Dask runs for a task: a ``Task``'s ``func`` (dask 2024.12+), or
    the first item of the ``(function, args, kwargs)`` tuple older ones keep"""
    func = getattr(run_spec, "func", None)
    if func is None and isinstance(run_spec, tuple) and run_spec and callable(run_spec[0]):
        func = run_spec[0]
    return func if callable(func) else None


# --- distributed: private attributes ---------------------------------------------

# The span mirror and the scheduler's fine metrics (tests/test_compat.py::test_dask_*)


def span_own_metrics(span: Span) -> Mapping[tuple[Hashable, ...], float]:
    """``Span._cumulative_worker_metrics``: a Dask span's own fine performance
    metrics (the public ``cumulative_worker_metrics`` walks and sums its subtree);
    empty if this Dask has none"""
    return getattr(span, "_cumulative_worker_metrics", {})


def span_nthreads_history(span: Span) -> tuple[list[tuple[float, int]], int] | None:
    """``Span._total_nthreads_history`` and ``Span._total_nthreads_offset``: the
    cluster's thread counts over time, from where the span was enqueued (what
    the public ``Span.active_cpu_seconds`` reads); None if this Dask has none"""
    try:
        return span._total_nthreads_history, span._total_nthreads_offset
    except AttributeError:
        return None


# The client (dask_otel/client.py): every graph a Client sends (submit, map, compute,
# persist, get) goes through its private ``Client._graph_to_futures``, under the
# annotations it sends (distributed 2024.1.0 to 2026.8.0; tests/test_compat.py::test_dask_client_*).


def on_graph_sent(sent: Callable[[Any], None]) -> None:
    """Have ``sent(client)`` called as any Client sends a graph, in its caller's
    thread (what it raises is dropped)"""
    send = distributed.Client._graph_to_futures

    @functools.wraps(send)
    def graph_to_futures(client: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            sent(client)
        except Exception:
            pass  # never into the caller's submit
        return send(client, *args, **kwargs)

    distributed.Client._graph_to_futures = graph_to_futures


def sent_annotations(scheduler: Any) -> tuple[Any, Mapping[str, Any]]:
    """In the ``update_graph`` hook, ``Scheduler.computations[-1]`` and its
    ``annotations``: the graph's global ones as its client sent them, before the
    spans extension rewrote its tasks' ``span`` (2024.1.0 to 2026.8.0), and what
    earlier graphs of the computation sent for other keys"""
    computations = getattr(scheduler, "computations", None)
    last = computations[-1] if computations else None
    return last, getattr(last, "annotations", None) or {}


def detached_span(name: tuple[str, ...], span_id: str, parent: Span | None, scheduler: Any) -> Span:
    """A ``distributed.spans.Span`` no extension holds (2024.1.0 to 2026.8.0), its
    ``_parent`` written strong: a detached parent has no other holder"""
    span = Span(name, span_id, parent, scheduler.total_nthreads_history)
    span._parent = (lambda: parent) if parent is not None else None
    return span


# --- opentelemetry-sdk: versions --------------------------------------------------


@functools.cache
def sdk_version() -> Version:
    from opentelemetry.sdk.version import __version__

    return Version(__version__)


# The series limits of the bridge's metric streams (dask_otel/export/instruments.py;
# tests/test_compat.py::test_limits_*): opentelemetry-sdk 1.45.2, a patch release, folds
# every attribute set past 2,000 per stream into one `otel.metric.overflow` point unless a
# View's `aggregation_cardinality_limit` (new there) sets the limit; 1.41 to 1.45.1 have
# none, and their View refuses the argument.

#: The first SDK release whose metric streams have a series limit
SERIES_LIMIT_SINCE = Version("1.45.2")


def series_limit_view_options(limit: int) -> dict[str, int]:
    """The keyword of a View that sets its streams' series limit to ``limit``, if any"""
    return {} if sdk_version() < SERIES_LIMIT_SINCE else {"aggregation_cardinality_limit": limit}


# --- opentelemetry-configuration (declarative) ------------------------------------
# opentelemetry-configuration 0.66b2 (experimental; it pins opentelemetry-sdk 1.45.2)
# builds whole providers publicly (create_tracer_provider, ...) but a processor's or
# reader's exporter only privately: the bridge builds the processors itself, to wrap each
# exporter in its export accounting (dask_otel/export/declarative.py).
# tests/test_compat.py::test_declarative_* trips when a release renames them.


def _declared(module: str, name: str) -> Callable[..., Any]:
    """``opentelemetry.configuration.<module>.<name>``, imported when first called"""
    def build(*args: Any) -> Any:
        return getattr(importlib.import_module(f"opentelemetry.configuration.{module}"),
                       name)(*args)

    return build


#: The SDK object of a section of the file, by its kind: a ``SpanExporter``; the
#: SpanLimits of ``tracer_provider.limits`` and ``attribute_limits``, as the package
#: gives its TracerProvider; a ``PushMetricExporter``, ``View``, exemplar filter, or
#: ``LogRecordExporter``
declared_span_exporter = _declared("_tracer_provider", "_create_span_exporter")
declared_span_limits = _declared("_tracer_provider", "_create_span_limits")
declared_metric_exporter = _declared("_meter_provider", "_create_push_metric_exporter")
declared_view = _declared("_meter_provider", "_create_view")
declared_exemplar_filter = _declared("_meter_provider", "_create_exemplar_filter")
declared_log_exporter = _declared("_logger_provider", "_create_log_record_exporter")


# ---- controls
# The in-task context (dask_otel/worker/execute_hook.py) wraps the worker instance's
# ``execute``: a coroutine method taking the task's key first, with the task's
# annotations in ``state.tasks`` (distributed 2024.1.0 to 2026.8.0; feature-detected,
# tests/test_task_context.py::test_unhookable_*).


def execute_hookable(worker: Any) -> str | None:
    """Why ``worker.execute`` cannot carry the in-task context, or None if it can"""
    execute = getattr(type(worker), "execute", None)
    if execute is None or not inspect.iscoroutinefunction(execute):
        return "Worker.execute is not a coroutine function"
    if (params := list(inspect.signature(execute).parameters))[1:2] != ["key"]:
        return f"Worker.execute takes {params[1:]}, not (key, ...)"
    if "execute" in vars(worker):
        return "Worker.execute is already replaced on this worker"
    if not isinstance(getattr(getattr(worker, "state", None), "tasks", None), Mapping):
        return "the worker has no state.tasks"
    return None


# ---- events


def remove_worker_lost_keys(scheduler: Any, msg: dict) -> tuple[Any, Any]:
    """The computed and the scattered keys lost with a removed worker: listed by
    its remove-worker event from distributed 2024.3.0; before, read from the
    scheduler, which still holds the worker's replicas when it logs the event"""
    if REMOVE_WORKER_LISTS_LOST_KEYS:
        return msg.get("lost-computed-tasks") or (), msg.get("lost-scattered-tasks") or ()
    ws = scheduler.workers.get(msg.get("worker"))
    lost = [ts for ts in (ws.has_what if ws is not None else ()) if len(ts.who_has) <= 1]
    return [ts.key for ts in lost if ts.run_spec], [ts.key for ts in lost if not ts.run_spec]


# ---- export
# The outage policy's one adapter (dask_otel/export/accounting.py). The SDK's OTLP
# exporters (gRPC and HTTP) retry a failed export inside export() with backoff until their
# timeout, and offer no public way to stop that cycle
# (https://github.com/open-telemetry/opentelemetry-python/issues/3815, /issues/4331).
# In 1.41 to 1.45.2 each waits out its backoff on a threading.Event that its public
# shutdown() sets; the adapter writes, in place of that Event, one whose wait() asks the
# policy first, so the export ends there failed, and the exporter (its channel, its
# session) stays as it was built. Above those versions the policy runs on what is public
# (the exporter's timeout, FAILURE). tests/test_compat.py::test_sdk_* trips on a change.


#: The last SDK release whose exporters wait as above (from the floor)
RETRY_WAIT_UP_TO = Version("1.45.2")
#: Where the OTLP exporters keep that Event: gRPC, and HTTP spans and metrics up to
#: 1.44; HTTP logs 1.41-1.44; HTTP from 1.45 (opentelemetry-exporter-otlp-common)
RETRY_WAITS = ("_shutdown_in_progress", "_shutdown_is_occuring", "_client._shutdown_event")


class _RetryWait(threading.Event):
    """The Event an exporter's retry backoff waits on, with ``cut()`` asked first:
    True ends the wait at once, as the exporter's shutdown() would"""

    def __init__(self, cut: Callable[[], bool]):
        super().__init__()
        self.cut = cut

    def wait(self, timeout: float | None = None) -> bool:
        return self.cut() or super().wait(timeout)


def cut_retry_waits(exporter: Any, cut: Callable[[], bool]) -> bool:
    """Have ``cut()`` asked where ``exporter`` (an OTLP exporter of opentelemetry
    1.41 to 1.45.2) is about to wait before a retry; False if it has no such wait"""
    if sdk_version() > RETRY_WAIT_UP_TO:
        return False
    for path in RETRY_WAITS:
        owner, _, name = path.rpartition(".")
        holder = getattr(exporter, owner, None) if owner else exporter
        if type(getattr(holder, name, None)) is threading.Event:
            setattr(holder, name, _RetryWait(cut))
            return True
    return False


# ---- volume
# The size of an OTLP request (dask_otel/export/accounting.py): the SDK's OTLP
# exporters, gRPC and HTTP, send what the signal's encoder of
# opentelemetry-exporter-otlp-proto-common makes of the batch; the logs' is public
# only under a private module name (1.41 to 1.45.2; tests/test_compat.py::test_sdk_*).

#: Each signal's encoder: module of opentelemetry.exporter.otlp.proto.common, function
OTLP_ENCODERS = {"spans": ("trace_encoder", "encode_spans"),
                 "metrics": ("metrics_encoder", "encode_metrics"),
                 "logs": ("_log_encoder", "encode_logs")}


def otlp_encoder(signal: str, exporter: Any) -> Callable[[Any], Any] | None:
    """The encoder of ``exporter``'s requests, if it is one of the SDK's OTLP exporters
    (None: another exporter, or a release that moved it: no bytes counted)"""
    if not type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto."):
        return None
    module, name = OTLP_ENCODERS[signal]
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.common.{module}")
    except ImportError:
        return None
    return getattr(module, name, None)
