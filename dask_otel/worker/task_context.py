"""The OpenTelemetry context of a task, built from its annotations.

A task's annotations already name its Dask span (``ts.annotations["span"]``:
``ids`` root first, own last, and ``name``) and, when the workflow joined a
caller's trace, carry the caller's propagated context (the ``otel`` annotation,
:mod:`dask_otel.annotation`). :class:`TaskContexts` turns them into the context
the task runs in: its Dask span as the current span, with the ids the
scheduler's mirror exports it with (:func:`dask_otel.span_context.dask_span_context`),
over the caller's baggage, with its client block's controls (``sampled``, the
``tasks`` rules: :mod:`dask_otel.annotation`). Nothing is sent for this. Contexts are cached per Dask
span (a bounded dict, :data:`MAX_CACHED_SPANS`), so a task costs a dict lookup.
The rules: docs/traces.md, "Inside a task".
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from dask_otel.annotation import block_controls, extract_caller, otel_of, root_carrier
from dask_otel.span_context import dask_span_context

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.sampling import Sampler

logger = logging.getLogger("dask_otel")

#: Most Dask spans whose context a worker keeps; past it the cache starts over
MAX_CACHED_SPANS = 4096


class DaskSpanContext:
    """What a task of one Dask span runs in: built once per Dask span and carrier"""

    __slots__ = ("context", "dask_id", "otel", "rules", "sampled", "span_context", "tasks")

    #: the ``otel`` annotation of the span's tasks, passed on to sub-tasks
    otel: Mapping[str, Any] | None
    #: the Dask span's UUID (``ts.annotations["span"]["ids"][-1]``)
    dask_id: str
    #: the Dask span's ids, as the scheduler's mirror exports them
    span_context: SpanContext
    #: ``span_context`` as the current span, over the carrier's baggage if any
    context: Context
    #: the whole trace's sampling decision
    sampled: bool
    #: the ``otel.tasks.*`` values its client block set (``dask_otel.span(tasks=)``,
    #: :func:`dask_otel.annotation.task_rules`); None: the worker's config alone
    tasks: Mapping[str, Any] | None
    #: the task span rules of its tasks, the worker's config with ``tasks`` over
    #: it: set by :class:`~dask_otel.worker.task_spans.TaskSpans` on first use
    rules: Any

    def __init__(
        self,
        span_context: SpanContext,
        base: Context | None,
        dask_id: str,
        otel: Mapping[str, Any] | None,
        tasks: Mapping[str, Any] | None = None,
    ):
        self.otel = otel
        self.dask_id = dask_id
        self.span_context = span_context
        self.context = trace.set_span_in_context(NonRecordingSpan(span_context), base)
        self.sampled = span_context.trace_flags.sampled
        self.tasks = tasks
        self.rules = None


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
        otel = otel_of(annotations)
        if otel is None:  # most tasks: a distributed.span, no caller (per task: no ABC check)
            carrier = forced = tasks = None
            key: tuple = (ids[-1], ids[0], None)
        else:
            carrier = root_carrier(otel, ids[0])  # as the scheduler reads it
            key = (ids[-1], ids[0], _carrier_key(carrier) if carrier else None)
            # the block's controls (dask_otel.span(sampled=, tasks=)): rare
            controls = block_controls(otel, ids[0])
            if controls is None:
                forced = tasks = None
            else:
                forced, tasks = controls
                key += (forced, tuple(tasks.items()) if tasks else None)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_CACHED_SPANS:
                self._cache.clear()
            cached = self._cache[key] = self._build(
                ids, span["name"], carrier, otel, forced, tasks
            )
        return cached

    def _build(
        self,
        ids: tuple[str, ...],
        name: tuple[str, ...],
        carrier: Mapping[str, str] | None,
        otel: Mapping[str, Any] | None,
        forced: bool | None = None,
        tasks: Mapping[str, Any] | None = None,
    ) -> DaskSpanContext:
        root_tag = str(name[0]) if name else "default"
        base, remote = extract_caller(carrier)
        # is_remote: the Dask span is made by the scheduler, in another process
        span_context = dask_span_context(
            ids[0], ids[-1], root_tag, remote, self.sampler, is_remote=True, forced=forced
        )
        return DaskSpanContext(span_context, base, str(ids[-1]), otel, tasks)


def default_sampler() -> Sampler:
    """The sampler the SDK builds from OTEL_TRACES_SAMPLER / _ARG (default:
    parent-based always-on), for a worker where the bridge builds no TracerProvider"""
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(shutdown_on_exit=False).sampler


