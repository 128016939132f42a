"""Workflow outcomes and removed workers as metrics: did it run, did it fail, is
it slow, and why workers left.

Emitted by the scheduler (names in :data:`WORKFLOW_DURATION`, :data:`WORKFLOW_RUNS`,
:data:`WORKERS_REMOVED`; what they mean and their Prometheus names:
docs/metrics.md, "Workflow outcomes and removed workers"):

- ``dask.workflow.duration`` (histogram, ``s``) and ``dask.workflow.runs``
  (counter, ``{run}``), once per root Dask span the mirror finishes (a trace the
  sampler drops included), with ``dask.workflow.name`` and
  ``dask.workflow.result`` (:data:`RESULTS`). Both are recorded in the root
  span's OTel context, so the SDK's exemplar filter (``OTEL_METRICS_EXEMPLAR_FILTER``,
  default ``trace_based``) gives each point an exemplar of a sampled run's trace.
- ``dask.worker.removed`` (counter, ``{worker}``) with
  ``dask.worker.removed.reason`` (:data:`REMOVED_REASONS`), once per
  ``remove-worker`` event; :mod:`dask_otel.scheduler.events` tells the reason.

Invariants: span names are unbounded user data, so a root's first tag is a
``dask.workflow.name`` only where the user says it is bounded (its block opened
with ``dask_otel.span(..., workflow=True)``, :func:`dask_otel.annotation.workflow_named`,
a match of ``otel.metrics.workflows``, or Dask's own :data:`DEFAULT`), at most
:data:`MAX_WORKFLOW_NAMES` of them; every other run is :data:`OTHER`. So an instrument has at most
``(MAX_WORKFLOW_NAMES + 1) * len(RESULTS)`` series.

Cost: nothing per task but per erred task (a walk to its root); per graph, one
task's annotations; per root span, one record of two instruments. What is kept
about open roots is bounded (:data:`MAX_OPEN_ROOTS` per kind).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import dask_otel.attributes as attr
from dask_otel._version import __version__
from dask_otel.annotation import ANNOTATION, read_block_exit, workflow_named
from dask_otel.span_context import root_span

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable, Iterable

    from distributed import Scheduler
    from opentelemetry.metrics import Counter, Histogram, MeterProvider

    from dask_otel.scheduler.record import SpanHead, SpanRecord

logger = logging.getLogger("dask_otel")

WORKFLOW_DURATION = "dask.workflow.duration"
WORKFLOW_RUNS = "dask.workflow.runs"
WORKERS_REMOVED = "dask.worker.removed"

#: ``dask.workflow.result``: no task of the run erred; a task erred (its trace's
#: root span has the ERROR status); the run did not finish: the client that
#: opened its ``dask_otel.span`` block left the scheduler with the block open,
#: or the scheduler closed under it
OK, ERRED, CANCELLED = "ok", "erred", "cancelled"
RESULTS = (OK, ERRED, CANCELLED)
#: ``dask.workflow.name`` of every run whose name is not known to be bounded
OTHER = "other"
#: The name of Dask's own root span of work computed outside any span (one per
#: idle-to-idle period): bounded, as Dask names it
DEFAULT = "default"
#: Distinct workflow names given; later ones are :data:`OTHER`
MAX_WORKFLOW_NAMES = 100
#: Open roots remembered as named, erred or cancelled, each; oldest forgotten first
MAX_OPEN_ROOTS = 1024
#: ``dask.worker.removed.reason``: its nanny restarted it over its memory limit;
#: it failed hard; it was retired (``retire_workers``, a cluster scaling down);
#: it closed itself (``Worker.close``, its nanny closing it); it was lost
#: without a word (heartbeats or its connection lost)
MEMORY_RESTART, FAIL_HARD, RETIRED, CLOSED, LOST = (
    "memory_restart", "fail_hard", "retired", "closed", "lost",
)
REMOVED_REASONS = (MEMORY_RESTART, FAIL_HARD, RETIRED, CLOSED, LOST)
#: Bucket bounds of ``dask.workflow.duration``, seconds: from a 100 ms run to a day
DURATION_BUCKETS = (
    0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400,
    43200, 86400,
)

class OutcomeInstruments:
    """The three instruments on one MeterProvider: created once per provider, as
    several schedulers of one process share it"""

    #: ``dask.workflow.duration``
    duration: Histogram
    #: ``dask.workflow.runs``
    runs: Counter
    #: ``dask.worker.removed``
    removed: Counter

    def __init__(self, meter_provider: MeterProvider):
        meter = meter_provider.get_meter("dask_otel", __version__)
        self.duration = meter.create_histogram(
            WORKFLOW_DURATION, unit="s",
            description="Workflow runs (root Dask spans), from start to end, by name and result",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self.runs = meter.create_counter(
            WORKFLOW_RUNS, unit="{run}",
            description="Workflow runs (root Dask spans) that ended, by name and result",
        )
        self.removed = meter.create_counter(
            WORKERS_REMOVED, unit="{worker}",
            description="Workers the scheduler removed, by why they left",
        )

    @classmethod
    def of(cls, meter_provider: MeterProvider) -> OutcomeInstruments:
        with _lock:
            instruments = _by_provider.get(meter_provider)
            if instruments is None:
                instruments = _by_provider[meter_provider] = cls(meter_provider)
            return instruments


_by_provider: WeakKeyDictionary[MeterProvider, OutcomeInstruments] = WeakKeyDictionary()
_lock = threading.Lock()


class Outcomes:
    """One scheduler's workflow outcomes and removed workers: the scheduler
    plugin feeds it from Dask's hooks, the span mirror from each root it
    finishes (``SpanMirror.span_of``)"""

    #: The scheduler (an erred task's Dask span)
    scheduler: Scheduler
    #: Where the points go
    instruments: OutcomeInstruments
    #: Attributes on every point (``ServerTelemetry.metric_attributes``)
    attributes: dict[str, Any]
    #: ``otel.metrics.workflows``
    patterns: tuple[str, ...]
    #: Root Dask span ids, until their export: whose block said ``workflow=True``,
    #: which had a task err, which were left by their client with the block open;
    #: each at most :data:`MAX_OPEN_ROOTS`
    named: dict[str, bool]
    erred: dict[str, bool]
    cancelled: dict[str, bool]
    #: The workflow names given so far, at most :data:`MAX_WORKFLOW_NAMES`
    names: set[str]

    def __init__(
        self,
        scheduler: Scheduler,
        meter_provider: MeterProvider,
        attributes: Mapping[str, Any],
        patterns: Collection[str] = (),
    ):
        self.scheduler = scheduler
        self.instruments = OutcomeInstruments.of(meter_provider)
        self.attributes = dict(attributes)
        self.patterns = tuple(patterns)
        self.named, self.erred, self.cancelled = {}, {}, {}
        self.names = set()

    # --- what the hooks learn ------------------------------------------------------

    def observe_graph(self, annotations: Any) -> None:
        """A graph reached the scheduler (``update_graph``'s ``annotations``, by
        name then key): its first annotated task says whether its root's block was
        opened with ``workflow=True``. One task per graph, whatever its size."""
        if not isinstance(annotations, Mapping):
            return
        otel_by_key, span_by_key = annotations.get(ANNOTATION), annotations.get("span")
        if not isinstance(otel_by_key, Mapping) or not isinstance(span_by_key, Mapping):
            return
        for key, otel in otel_by_key.items():
            span = span_by_key.get(key)
            ids = span.get("ids") if isinstance(span, Mapping) else None
            if workflow_named(otel) and ids:
                _remember(self.named, str(ids[0]))
            return

    def observe_exit(self, msg: Any) -> None:
        """A client left a ``dask_otel.span`` block: a root block opened with
        ``workflow=True`` names its root, whatever graph came first"""
        block = read_block_exit(msg)
        if block is not None:
            ids, _, own, otel, _ = block
            if own == len(ids) and workflow_named(otel):
                _remember(self.named, ids[0])

    def observe_erred(self, key: Hashable) -> None:
        """A task erred: its root's run erred"""
        ts = self.scheduler.tasks.get(key)
        ext = self.scheduler.extensions.get("spans")
        span_id = ts.group.span_id if ts is not None else None
        span = ext.spans.get(span_id) if ext is not None and span_id is not None else None
        if span is not None:
            _remember(self.erred, root_span(span).id)

    def observe_left_open(self, records: Iterable[SpanRecord]) -> None:
        """Blocks their client left open (:func:`dask_otel.scheduler.blocks.observe_client_gone`):
        their runs did not finish"""
        for record in records:
            _remember(self.cancelled, root_span(record.span).id)

    # --- out -----------------------------------------------------------------------

    def observe_root(
        self, record: SpanRecord, head: SpanHead, end: float, unfinished: bool = False
    ) -> None:
        """A root Dask span is finished (exported, or dropped by the sampler):
        one run, its duration as its OTel span's (``head.start`` to ``end``), in
        its trace's context. Never raises: the span is exported whatever happens here"""
        try:
            self._record_run(record, head, end, unfinished)
        except Exception:
            logger.exception("dask_otel: could not record the run of %r", record)

    def _record_run(
        self, record: SpanRecord, head: SpanHead, end: float, unfinished: bool
    ) -> None:
        from opentelemetry.context import Context
        from opentelemetry.trace import NonRecordingSpan, set_span_in_context

        span = record.span
        erred = self.erred.pop(span.id, False) or record.erred > 0
        cancelled = self.cancelled.pop(span.id, False) or unfinished
        named = self.named.pop(span.id, False)
        result = ERRED if erred else CANCELLED if cancelled else OK
        attributes = {
            **self.attributes,
            attr.WORKFLOW_NAME: self.workflow_name(str(span.name[0]), named),
            attr.WORKFLOW_RESULT: result,
        }
        # No sampled span: an empty context, never the scheduler's current one
        context = set_span_in_context(NonRecordingSpan(head.context)) if head.context else Context()
        self.instruments.duration.record(end - head.start, attributes, context=context)
        self.instruments.runs.add(1, attributes, context=context)

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
        self.instruments.removed.add(
            1, {**self.attributes, attr.WORKER_REMOVED_REASON: reason}
        )


def _remember(roots: dict[str, bool], root_id: str) -> None:
    if root_id not in roots and len(roots) >= MAX_OPEN_ROOTS:
        del roots[next(iter(roots))]
    roots[root_id] = True
