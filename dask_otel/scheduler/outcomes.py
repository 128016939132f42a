"""Workflow outcomes and removed workers as metrics: ``dask.workflow.duration``,
``dask.workflow.runs`` (once per root Dask span the mirror finishes, from its
record), ``dask.worker.removed`` and ``dask.event_loop.blocked.duration`` (from
:mod:`dask_otel.scheduler.events`).
Only the instruments and the naming rule live here. What each means, its bounds
and Prometheus names: docs/metrics.md, "Workflow outcomes and removed workers".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, set_span_in_context

import dask_otel.attributes as attr
from dask_otel._version import __version__

if TYPE_CHECKING:
    from collections.abc import Collection

    from opentelemetry.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.trace import SpanContext

    from dask_otel.scheduler.record import SpanRecord

logger = logging.getLogger("dask_otel")

WORKFLOW_DURATION = "dask.workflow.duration"
WORKFLOW_RUNS = "dask.workflow.runs"
WORKERS_REMOVED = "dask.worker.removed"

#: ``dask.workflow.result``: no task erred; a task erred; the run did not finish
#: (its client left with its block open, or the scheduler closed under it)
OK, ERRED, CANCELLED = "ok", "erred", "cancelled"
RESULTS = (OK, ERRED, CANCELLED)
#: ``dask.workflow.name`` of every run whose name is not known to be bounded
OTHER = "other"
#: Dask's own root span of work outside any span: a bounded name
DEFAULT = "default"
#: Distinct workflow names given; later ones are :data:`OTHER`
MAX_WORKFLOW_NAMES = 100
#: ``dask.worker.removed.reason`` (docs/metrics.md has what each means)
MEMORY_RESTART, FAIL_HARD, RETIRED, CLOSED = "memory_restart", "fail_hard", "retired", "closed"
LOST = "lost"
REMOVED_REASONS = (MEMORY_RESTART, FAIL_HARD, RETIRED, CLOSED, LOST)
#: Bucket bounds of ``dask.workflow.duration``, seconds: from a 100 ms run to a day
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400,
                    43200, 86400)
#: Bucket bounds of ``dask.event_loop.blocked.duration``, seconds: from a limit
#: set low to a stall that loses workers (distributed.comm.timeouts)
BLOCKED_BUCKETS = (0.5, 1, 2, 3, 5, 10, 30, 60, 120, 300)


class OutcomeInstruments:
    """The four instruments on one MeterProvider: created once per provider, as
    several schedulers of one process share it"""

    def __init__(self, meter_provider: MeterProvider):
        meter = meter_provider.get_meter("dask_otel", __version__)
        self.duration: Histogram = meter.create_histogram(
            WORKFLOW_DURATION, unit="s",
            description="Workflow runs (root Dask spans), from start to end, by name and result",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self.runs: Counter = meter.create_counter(
            WORKFLOW_RUNS, unit="{run}",
            description="Workflow runs (root Dask spans) that ended, by name and result")
        self.removed: Counter = meter.create_counter(
            WORKERS_REMOVED, unit="{worker}",
            description="Workers the scheduler removed, by why they left")
        self.blocked: Histogram = meter.create_histogram(
            attr.LOOP_BLOCKED_DURATION, unit="s",
            description="Event loops blocked past distributed.admin.tick.limit, by server kind",
            explicit_bucket_boundaries_advisory=list(BLOCKED_BUCKETS),
        )

    @classmethod
    def of(cls, meter_provider: MeterProvider) -> OutcomeInstruments:
        with _lock:
            if (instruments := _by_provider.get(meter_provider)) is None:
                instruments = _by_provider[meter_provider] = cls(meter_provider)
            return instruments


_by_provider: WeakKeyDictionary[MeterProvider, OutcomeInstruments] = WeakKeyDictionary()
_lock = threading.Lock()


class Outcomes:
    """One scheduler's workflow outcomes and removed workers: the span mirror
    records each root it finishes (``SpanMirror.span_of``), the events each
    removed worker"""

    def __init__(self, meter_provider: MeterProvider, attributes: Mapping[str, Any],
                 patterns: Collection[str] = ()):
        self.instruments = OutcomeInstruments.of(meter_provider)
        #: Attributes on every point (``ServerTelemetry.metric_attributes``)
        self.attributes = dict(attributes)
        #: ``otel.metrics.workflows``
        self.patterns = tuple(patterns)
        #: The workflow names given so far, at most :data:`MAX_WORKFLOW_NAMES`
        self.names: set[str] = set()

    def record_run(self, record: SpanRecord, context: SpanContext | None, start: float, end: float,
                   unfinished: bool = False) -> None:
        """Root ``record`` finished (exported, or dropped by the sampler): one run
        from ``start`` to ``end`` (its OTel span's), in its trace's ``context``
        (None: not sampled). Never raises: the span is exported whatever happens here"""
        try:
            result = (ERRED if record.run_erred or record.erred
                      else CANCELLED if record.cancelled or unfinished else OK)
            attributes = {
                **self.attributes,
                attr.WORKFLOW_NAME: self.workflow_name(str(record.span.name[0]), record.workflow),
                attr.WORKFLOW_RESULT: result,
            }
            # No sampled span: an empty context, never the scheduler's current one
            in_trace = set_span_in_context(NonRecordingSpan(context)) if context else Context()
            self.instruments.duration.record(end - start, attributes, context=in_trace)
            self.instruments.runs.add(1, attributes, context=in_trace)
        except Exception:
            logger.exception("dask_otel: could not record the run of %r", record)

    def workflow_name(self, name: str, named: bool) -> str:
        """``name`` if it is bounded (``named``, Dask's ``default``, or matched by a
        pattern) and one of the first :data:`MAX_WORKFLOW_NAMES`, else :data:`OTHER`"""
        if name in self.names:
            return name
        bounded = named or name == DEFAULT or any(fnmatchcase(name, p) for p in self.patterns)
        if not bounded or len(self.names) >= MAX_WORKFLOW_NAMES:
            return OTHER
        self.names.add(name)
        return name

    def worker_removed(self, reason: str) -> None:
        """A worker was removed, for ``reason`` (:data:`REMOVED_REASONS`)"""
        self.instruments.removed.add(1, {**self.attributes, attr.WORKER_REMOVED_REASON: reason})

    def loop_blocked(self, kind: str, seconds: float, context: SpanContext | None) -> None:
        """A ``kind`` server's event loop was blocked for ``seconds``, hitting the
        workflow of ``context`` (None: none sampled), its exemplar"""
        in_trace = set_span_in_context(NonRecordingSpan(context)) if context else Context()
        self.instruments.blocked.record(seconds, {**self.attributes, attr.SERVER_KIND: kind},
                                        context=in_trace)
