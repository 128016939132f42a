"""Export accounting and the outage policy, one engine for the three signals
(docs/deploy.md, "Volume" and "When telemetry fails"): :class:`AccountedExporter`
counts every item handed to the SDK's exporter once, as exported or dropped (batching,
queues and timeouts stay the SDK's); :class:`ExportInstruments` publishes the counts
of every process with a bridge (docs/metrics.md).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dask_otel._compat import cut_retry_waits, otlp_encoder
from dask_otel.attributes import ERROR_TYPE, OTEL_EXPORTER, OTEL_SIGNAL
from dask_otel.export.exporters import SIGNALS
from dask_otel.export.instruments import (COUNTER, Attached, MetricSpec, ProcessInstruments,
                                          Reading)
from dask_otel.log import logger

#: Seconds without an answer after which an export counts as an outage: a healthy
#: collector answers within milliseconds, and shutdown should not wait for one
#: that does not
STALLED_AFTER = 1.0
#: Share of the export interval after which the next export is a probe: the SDK's
#: scheduled exports drift by a few milliseconds, and a probe missed by that much
#: would delay recovery by a whole interval
PROBE_AFTER = 0.8
#: Each signal's export result (module, class): ``SUCCESS``, ``FAILURE``
RESULTS = {
    "spans": ("opentelemetry.sdk.trace.export", "SpanExportResult"),
    "metrics": ("opentelemetry.sdk.metrics.export", "MetricExportResult"),
    "logs": ("opentelemetry.sdk._logs.export", "LogRecordExportResult"),
}


class _HeldExporterLogs(logging.Filter):
    """Holds back what the SDK's exporters log while an accounted export runs in this
    thread (lines per failed batch and retry): :class:`ExporterHealth` logs once per
    outage, with their reason. Shown, never decided on (a logger drops a record below
    its level, which is the user's, before its filters run)."""

    #: this thread's held records, while an accounted export runs in it (one filter)
    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if (held := getattr(self.local, "held", None)) is None:
            return True
        held.append(record)
        return False

    def attach(self) -> None:
        # Filters apply to the logger a record is logged on, not its ancestors:
        # attach to every exporter module's logger (imported by now). First, ahead
        # of the SDK's DuplicateFilter, which drops a line repeated within 20 s:
        # the second refusal of a batch must still bring its reason.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("opentelemetry.exporter"):
                filters = logging.getLogger(name).filters
                if self not in filters:
                    filters.insert(0, self)


HELD_EXPORTER_LOGS = _HeldExporterLogs()


@dataclass(slots=True)
class _Export:
    """One export under way"""

    #: ``time.monotonic()`` when it started
    started: float = field(default_factory=time.monotonic)
    #: the exporter's log records so far
    held: list[logging.LogRecord] = field(default_factory=list)
    #: True once the exporter came to wait before a retry
    retrying: bool = False
    #: its last line then (the retry's announcement), if its logger let it through
    announced: str | None = None

    def reason(self) -> str:
        """What the user is shown of the exporter's failure: its retry announcement
        without the retry it announces, else its last line (shown, never decided on)"""
        if self.announced is not None:
            return re.sub(r"^Transient error |,? retrying in [0-9.]+s\.?", "",
                          self.announced).strip()
        return self.held[-1].getMessage() if self.held else "the exporter returned FAILURE"


@dataclass(slots=True)
class ExporterHealth:
    """What one exporter shipped and lost (:data:`COUNTS`, as ``status()`` and
    :class:`ExportInstruments` name them) and its outage, logged once (one line at
    recovery). Runs in the SDK's export thread; read from others."""

    #: ``spans``, ``metrics`` or ``logs``
    signal: str
    #: seconds between the SDK's scheduled exports, as the recipe that built the
    #: exporter configured its processor or reader: during an outage one export
    #: per interval is a probe
    interval: float
    #: ``otel.export.retry-during-outage``: the SDK's retries for every batch, no probes
    retry_during_outage: bool = False
    #: items the collector accepted: spans, metric points, log records
    items: int = 0
    #: bytes of the OTLP requests the collector accepted: the serialized request,
    #: before compression (0 for an exporter that is not OTLP's)
    size: int = 0
    #: items lost because an export failed, or was not tried during an outage
    dropped: int = 0
    #: failed export calls (requests, probes included)
    failures: int = 0
    #: batches dropped without a request during an outage
    skipped: int = 0
    #: failed export calls since the last success
    failing: int = 0
    #: True once the bridge shut the exporter down: what the SDK still hands it, or
    #: what the shutdown cut short (a metric reader's last collection), is lost and
    #: counted, and no outage logged
    closed: bool = False
    #: True while the bridge flushes before closing: an outage is not probed then
    closing: bool = False
    #: when the last request was sent (``time.monotonic()``)
    last_request: float = float("-inf")
    #: the export under way, if any
    under_way: _Export | None = None

    @property
    def stalled(self) -> bool:
        """True while the export under way waits for a retry, or has had no answer
        for :data:`STALLED_AFTER` seconds: a flush waiting for it waits on the
        collector. (A collector that refuses the signal for good answers at once:
        it does not keep the close from flushing the others.)"""
        export = self.under_way
        return export is not None and (
            export.retrying or time.monotonic() - export.started > STALLED_AFTER
        )

    def retry_wait(self) -> bool:
        """Asked in the export thread where the SDK's exporter is about to wait
        before a retry (:func:`dask_otel._compat.cut_retry_waits`): True ends the
        export there, failed (the policy), False lets the SDK retry"""
        export = self.under_way
        if export is None:  # not an export of ours
            return False
        if not export.retrying:
            export.retrying = True
            export.announced = export.held[-1].getMessage() if export.held else None
        return not self.retry_during_outage

    def export(self, send: Callable[[], bool], items: int) -> bool:
        """``send()`` the batch unless the outage policy drops it; True if the
        collector took it"""
        if self.closed:
            self.dropped += items
            return False
        now = time.monotonic()
        if self.failing and not self.retry_during_outage and (
            self.closing or now - self.last_request < PROBE_AFTER * self.interval
        ):
            # A known outage, and not yet time for the next probe: no request
            self.dropped += items
            self.skipped += 1
            return False
        self.last_request = now
        export = self.under_way = _Export()
        HELD_EXPORTER_LOGS.local.held = export.held
        error = None
        try:
            ok = bool(send())
        except Exception as e:
            error, ok = f"{type(e).__name__}: {e}", False
        finally:
            HELD_EXPORTER_LOGS.local.held = None
            self.under_way = None
        if ok:
            self.items += items
            if self.failing:
                logger.warning("dask_otel: %s export recovered after %d failed exports",
                               self.signal, self.failing)
                self.failing = 0
            return True
        self.dropped += items
        if self.closed:  # cut short by the bridge's own shutdown: no outage
            return False
        self.failures += 1
        reason = error or export.reason()
        logger.debug("dask_otel: %s export failed: %s", self.signal, reason)
        if not self.failing:
            # The settings that stop exporting the signal: a collector that does not
            # serve it (Jaeger and Phoenix take traces only) fails every export of it
            otlp = SIGNALS[self.signal][1]  # TRACES, METRICS, LOGS
            variable, key = f"OTEL_{otlp}_EXPORTER", f"otel.{otlp.lower()}.exporter"
            logger.warning(
                "dask_otel: cannot export %s (%s); %s until the collector answers again "
                "(counted in dask.otel.export.dropped, logged once per outage). A collector "
                "that does not accept %s refuses them for good: to stop sending them, set "
                "%s=none (or %s: none)", self.signal, reason,
                "retrying each batch, dropping those the SDK's retries do not deliver,"
                if self.retry_during_outage else "dropping them", self.signal, variable, key,
            )
        self.failing += 1
        return False


def metric_points(data: Any) -> int:
    """The data points of a metric export (``MetricsData``)"""
    return sum(len(metric.data.data_points) for resource in data.resource_metrics
               for scope in resource.scope_metrics for metric in scope.metrics)


class AccountedExporter:
    """An SDK exporter of any signal with :class:`ExporterHealth` accounting and the
    outage policy; what it does not define (a metric exporter's temporality) is the
    exporter's, as it was built."""

    def __init__(self, signal: str, exporter: Any, interval: float,
                 retry_during_outage: bool = False):
        self.exporter = exporter
        self.health = ExporterHealth(signal, interval, retry_during_outage)
        module, name = RESULTS[signal]
        #: the signal's export result: ``SUCCESS``, ``FAILURE``
        self.result = getattr(importlib.import_module(module), name)
        #: items in a batch: spans, log records, or a metric export's points
        self.items: Callable[[Any], int] = metric_points if signal == "metrics" else len
        cut_retry_waits(exporter, self.health.retry_wait)
        #: the OTLP request of a batch, encoded again to count its bytes (None: not OTLP)
        self.encode = otlp_encoder(signal, exporter)

    def export(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        def send() -> bool:
            ok = self.exporter.export(batch, *args, **kwargs) == self.result.SUCCESS
            if ok and self.encode is not None:
                with contextlib.suppress(Exception):  # sent, whatever its size
                    self.health.size += self.encode(batch).ByteSize()
            return ok

        ok = self.health.export(send, self.items(batch))
        return self.result.SUCCESS if ok else self.result.FAILURE

    def force_flush(self, timeout_millis: float = 30_000, **kwargs: Any) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        # Called by the bridge first (to interrupt a waiting export), then by the
        # SDK's processor or reader: once is enough (a second call warns)
        if not self.health.closed:
            self.health.closed = True
            self.exporter.shutdown()

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define (the SDK's metric reader reads a
        # metric exporter's preferences when it is built)
        if name == "exporter":  # not set yet
            raise AttributeError(name)
        return getattr(self.exporter, name)


#: Each exporter's counts, by these names in ``status()`` and :class:`ExportInstruments`
COUNTS = ("items", "size", "dropped", "failures")
#: ``dask.otel.export.dropped`` of the spans a scheduler's poll handed over past its
#: builder thread's queue (the SDK's own instruments name a full queue so too)
QUEUE_FULL = {OTEL_SIGNAL: "spans", ERROR_TYPE: "queue_full"}


@dataclass(eq=False)
class ExportHealth(Attached):
    """A process's export health, attached once by its Telemetry: its accounted
    exporters' counts"""

    #: the process's :class:`~dask_otel.export.telemetry.Telemetry`
    telemetry: Any = None
    #: the span builders of the process's schedulers (a closed one's drops stay
    #: counted: the counter never goes down while the process lives)
    builders: list = field(default_factory=list)


def _counted(count: str):
    """``count`` of each accounted exporter, by exporter and signal; ``dropped`` with
    the schedulers' queue-full drops, from 0 on (an alert's ``increase()`` needs the
    series before the first drop)"""
    def read(health: ExportHealth) -> Reading:
        out = [(getattr(e.health, count), {OTEL_EXPORTER: type(e.exporter).__name__,
                                           OTEL_SIGNAL: e.health.signal})
               for e in list(health.telemetry.accounted)]
        if count == "dropped" and health.builders:
            out.append((sum(b.dropped for b in list(health.builders)), QUEUE_FULL))
        return out

    return read


class ExportInstruments(ProcessInstruments):
    """The only place the ``dask.otel.export.*`` names are spelled"""

    table = (
        MetricSpec("dask.otel.export.items", COUNTER, "{item}",
                   "Spans, metric points and log records the collector accepted",
                   _counted("items")),
        MetricSpec("dask.otel.export.size", COUNTER, "By",
                   "Bytes of the OTLP requests the collector accepted, before compression",
                   _counted("size")),
        MetricSpec("dask.otel.export.dropped", COUNTER, "{item}",
                   "Items lost: their export failed, or was not tried during an outage, "
                   "or (spans) a scheduler's builder queue was full", _counted("dropped")),
        MetricSpec("dask.otel.export.failures", COUNTER, "{request}",
                   "Export requests that failed (an outage's probes included)",
                   _counted("failures")),
    )
