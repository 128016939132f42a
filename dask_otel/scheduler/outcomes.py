"""Workflow outcomes and removed workers as metrics: ``dask.workflow.duration``,
``dask.workflow.runs`` (once per root Dask span the mirror finishes, from its
record; the open ones: ``.active``, ``.tasks``) and ``dask.worker.removed`` (from
:mod:`dask_otel.scheduler.events`).
Only the instruments and the naming rule live here. What each means, its bounds
and Prometheus names: docs/metrics.md, "Workflow outcomes and removed workers".
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from distributed.scheduler import ALL_TASK_STATES
from opentelemetry.context import Context

import dask_otel.attributes as attr
from dask_otel.export.instruments import of_provider
from dask_otel.log import logger
from dask_otel.span_context import in_context

if TYPE_CHECKING:
    from collections.abc import Collection

    from opentelemetry.metrics import Counter as OTelCounter, Histogram, Meter, MeterProvider
    from opentelemetry.trace import SpanContext

    from dask_otel.scheduler.ledger import Ledger
    from dask_otel.scheduler.record import SpanRecord

WORKERS_REMOVED = "dask.worker.removed"

#: ``dask.workflow.result``: no task erred; a task erred; the run did not finish
#: (its client left with its block open, or the scheduler closed under it)
OK, ERRED, CANCELLED = "ok", "erred", "cancelled"
#: ``dask.workflow.name`` of every run whose name is not known to be bounded
OTHER = "other"
#: Dask's own root span of work outside any span: a bounded name
DEFAULT = "default"
#: Distinct workflow names given (and values of each label); later ones are :data:`OTHER`
MAX_WORKFLOW_NAMES = 100
#: Characters of a label's value kept on the metrics
MAX_LABEL_LENGTH = 64
#: ``dask.worker.removed.reason`` (docs/metrics.md has what each means)
MEMORY_RESTART, FAIL_HARD, RETIRED, CLOSED = "memory_restart", "fail_hard", "retired", "closed"
LOST = "lost"
#: Bucket bounds of ``dask.workflow.duration``, seconds: from a 100 ms run to a day
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400,
                    43200, 86400)


class OutcomeInstruments:
    """The three instruments on one MeterProvider (:func:`of_provider`)"""

    of = classmethod(of_provider)

    def __init__(self, meter: Meter):
        self.duration: Histogram = meter.create_histogram(
            "dask.workflow.duration", unit="s",
            description="Workflow runs (root Dask spans), from start to end, by name and result",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self.runs: OTelCounter = meter.create_counter(
            "dask.workflow.runs", unit="{run}",
            description="Workflow runs (root Dask spans) that ended, by name and result")
        self.removed: OTelCounter = meter.create_counter(
            WORKERS_REMOVED, unit="{worker}",
            description="Workers the scheduler removed, by why they left")


class Outcomes:
    """One scheduler's workflow outcomes (each root the mirror finishes,
    ``SpanMirror.span_of``) and removed workers"""

    def __init__(self, meter_provider: MeterProvider, attributes: Mapping[str, Any],
                 patterns: Collection[str] = (), labels: Collection[str] = ()):
        self.instruments = OutcomeInstruments.of(meter_provider)
        #: Attributes on every point (``ServerTelemetry.metric_attributes``)
        self.attributes = dict(attributes)
        #: ``otel.metrics.workflows``
        self.patterns = tuple(patterns)
        #: The workflow names given so far, at most :data:`MAX_WORKFLOW_NAMES`
        self.names: set[str] = set()
        self.lock = threading.Lock()
        #: The workflow names of the runs seen open (a bounded name each)
        self.watched: set[str] = set()
        #: ``otel.metrics.labels``, and the values given so far of each
        self.labels: dict[str, set[str]] = {key: set() for key in labels}

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
                **self.labels_of(record.labels or {}),
            }
            # No sampled span: an empty context, never the scheduler's current one
            in_trace = in_context(context) or Context()
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
        with self.lock:  # the loop's and the metric reader's threads: never past the bound
            if not bounded or len(self.names) >= MAX_WORKFLOW_NAMES:
                return OTHER
            self.names.add(name)
        return name

    def labels_of(self, labels: Mapping[str, Any]) -> dict[str, str]:
        """A run's allow-listed str, bool or int labels as strings, cut to :data:`MAX_LABEL_LENGTH`:
        the first :data:`MAX_WORKFLOW_NAMES` values of each, then :data:`OTHER`"""
        bounded = {}
        for key in self.labels.keys() & labels.keys():
            if isinstance(value := labels[key], (str, bool, int)):
                value = str(value).lower() if isinstance(value, bool) else str(value)[:MAX_LABEL_LENGTH]
                if len(seen := self.labels[key]) < MAX_WORKFLOW_NAMES:
                    seen.add(value)
                bounded[key] = value if value in seen else OTHER
        return bounded

    def open_runs(self, ledger: Ledger, by_state: bool) -> list[tuple[int, dict]]:
        """``dask.workflow.active`` now (``by_state``: ``dask.workflow.tasks``): the open
        runs of the mirror's ``ledger``, or their tasks by state as Dask's ``Span.states``
        counts them, by workflow; 0 for a workflow seen open before (its series ends at 0)"""
        counts: dict[str, Counter] = {name: Counter() for name in self.watched}
        for record in list(ledger.records.values()):  # in C: the loop changes it
            if (span := record.span).parent is None:
                name = self.workflow_name(str(span.name[0]), record.workflow)
                self.watched.add(name)
                counts.setdefault(name, Counter()).update(span.states if by_state else {"": 1})
        if not by_state:
            return [(c[""], {attr.WORKFLOW_NAME: name}) for name, c in counts.items()]
        return [(c[state], {attr.WORKFLOW_NAME: name, attr.TASK_STATE: state})
                for name, c in counts.items() for state in sorted(ALL_TASK_STATES)]

    def worker_removed(self, reason: str) -> None:
        """A worker was removed, for ``reason`` (``dask.worker.removed.reason``)"""
        self.instruments.removed.add(1, {**self.attributes, attr.WORKER_REMOVED_REASON: reason})
