"""The OpenTelemetry context a task runs in, built from its annotations: its Dask
span (``ts.annotations["span"]``) as the current span, with the ids the scheduler's
mirror exports it with, over the caller's baggage, and its client block's controls
(``sampled``, ``tasks``) read once per Dask span from the ``otel`` annotation.
Nothing is sent for this: a task costs a dict lookup. docs/traces.md, "Inside tasks".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanContext

from dask_otel.annotation import (extract_caller, forced_sampling, keep_rules, otel_of,
                                  root_carrier, task_rules)
from dask_otel.span_context import dask_span_context, in_context, kept_context

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.sampling import Sampler

#: Most Dask spans whose context a worker keeps; past it the cache starts over
MAX_CACHED_SPANS = 4096


@dataclass(slots=True)
class DaskSpanContext:
    """What the tasks of one Dask span run in: built once per Dask span, carrier
    and controls"""

    #: the Dask span's ids, as the scheduler's mirror exports them
    span_context: SpanContext
    #: ``span_context`` as the current span, over the carrier's baggage if any
    context: Context
    #: the Dask span's UUID (``ts.annotations["span"]["ids"][-1]``)
    dask_id: str
    #: the ``otel`` annotation of its tasks, passed on to sub-tasks
    otel: Mapping[str, Any] | None
    #: which of its tasks get task spans (:class:`~dask_otel.worker.task_spans.TaskRules`,
    #: the worker's with its block's over them); None when none can
    rules: Any
    #: A dropped run that ``otel.traces.keep`` keeps if it errs: the Dask span's
    #: context in the kept trace, the parent of its erred tasks' spans (None: not so)
    kept: SpanContext | None = None


@dataclass(eq=False)
class TaskContexts:
    """Builds the OTel context of tasks from their annotations, cached per Dask span"""

    #: the sampler the scheduler's mirror asks too (``OTEL_TRACES_SAMPLER``); part
    #: of the cached values, so it must not change (nor ``rules``)
    sampler: Sampler
    #: the worker's own task span rules (None: it exports no traces)
    rules: Any = None
    #: ``otel.traces.keep.erred`` in the worker's config
    keep_erred: bool = False
    #: by (own Dask span id, root Dask span id, carrier items, the block's controls as sent)
    _cache: dict[tuple, DaskSpanContext] = field(default_factory=dict)

    def of(self, annotations: Mapping[str, Any] | None) -> DaskSpanContext | None:
        """The context of a task with these annotations; None for a task in no
        Dask span (annotations lost to graph optimisation, hand-made graphs).
        Raises on malformed annotations; the caller runs the task without context."""
        span = annotations.get("span") if annotations else None
        if not span:
            return None
        ids, otel = span["ids"], otel_of(annotations)
        # most tasks have no otel annotation (a distributed.span, no caller); the carrier
        # is read as the scheduler reads it
        carrier = None if otel is None else root_carrier(otel, ids[0])
        key: tuple = (ids[-1], ids[0], tuple(carrier.items()) if carrier else None)
        if type(otel) is dict and ("sampled" in otel or "tasks" in otel or "keep" in otel):
            # rare, no ABC check; as sent, unread: they are read once, below
            key += (repr((otel.get("sampled"), otel.get("tasks"), otel.get("keep"))),)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_CACHED_SPANS:
                self._cache.clear()
            cached = self._cache[key] = self._build(ids, span["name"], carrier, otel)
        return cached

    def _build(self, ids: tuple[str, ...], name: tuple[str, ...], carrier: Mapping | None,
               otel: Any) -> DaskSpanContext:
        base, remote = extract_caller(carrier)
        # is_remote: the Dask span is made by the scheduler, in another process
        span_context = dask_span_context(
            ids[0], ids[-1], str(name[0]) if name else "default", remote, self.sampler,
            is_remote=True, forced=(forced := forced_sampling(otel, ids[0])))
        sampled, kept = span_context.trace_flags.sampled, None
        if not sampled and self.rules and forced is None and (
                keep_rules(otel, ids[0]) or {}).get("erred", self.keep_erred):
            # its erred tasks' spans, in the trace the scheduler keeps if the run errs
            kept = kept_context(ids[0], ids[-1], is_remote=True)
        rules = self.rules and self.rules.of_span(task_rules(otel), sampled or kept is not None)
        if kept is not None and rules:
            rules = replace(rules, sample_ratio=0.0, slower_than=None)  # erred tasks only
        return DaskSpanContext(span_context, in_context(span_context, base), str(ids[-1]), otel,
                               rules, kept)


def default_sampler() -> Sampler:
    """The sampler the SDK builds from OTEL_TRACES_SAMPLER / _ARG (default:
    parent-based always-on), for a worker where the bridge builds no TracerProvider"""
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(shutdown_on_exit=False).sampler
