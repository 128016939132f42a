"""Export accounting: what each exporter shipped and lost, and one log line per
outage instead of one per failed batch and retry; and the outage policy.

The wrappers run in the SDK's export threads. Batching and timeouts stay the
SDK's. The outage policy (:class:`ExportOutage`): a refused connection, an
UNAVAILABLE answer or a timeout ends the export under way at once (the SDK's
exporters would retry it with backoff for up to their timeout) and makes the
outage known; while it is, one export per export interval is sent as a probe and
the other batches are dropped and counted without a request; the first probe that
succeeds ends the outage. ``otel.export.retry-during-outage: true`` restores the
SDK's own retries for every batch.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger("dask_otel")

#: Seconds without an answer after which an export counts as an outage: a healthy
#: collector answers within milliseconds, and shutdown should not wait for one
#: that does not
STALLED_AFTER = 1.0

#: How the SDK's OTLP exporters (gRPC and HTTP, opentelemetry 1.41 to 1.45)
#: announce a retry: "Transient error StatusCode.UNAVAILABLE encountered while
#: exporting traces to 127.0.0.1:4317, retrying in 1.04s." It is logged in the
#: export thread just before the backoff wait, for a refused connection, an
#: UNAVAILABLE (503) answer or another retryable error: the one place where the
#: retry loop can be ended the same way in every version (the loop, its
#: ``_MAX_RETRYS`` and its deadline are private and differ between versions).
RETRYING = re.compile(r"^Transient error .* retrying in ")

#: The export interval of each signal (the SDK's variable, its default in
#: milliseconds): during an outage one export per interval is a probe
EXPORT_INTERVAL = {
    "spans": ("OTEL_BSP_SCHEDULE_DELAY", 5000),
    "metrics": ("OTEL_METRIC_EXPORT_INTERVAL", 60000),
    "logs": ("OTEL_BLRP_SCHEDULE_DELAY", 1000),
}
#: Share of the export interval after which the next export is a probe: the SDK's
#: scheduled exports drift by a few milliseconds, and a probe missed by that much
#: would delay recovery by a whole interval
PROBE_AFTER = 0.8


class RetryCut(Exception):
    """Raised, by :class:`_HeldExporterLogs`, into an SDK exporter that announces a
    retry during a dask_otel export under the outage policy: the export ends
    there, failed, and the batch is dropped and counted"""


def export_interval(signal: str) -> float:
    """Seconds between the SDK's scheduled exports of ``signal``, as it reads them"""
    variable, default = EXPORT_INTERVAL[signal]
    try:
        milliseconds = float(os.environ.get(variable, "").strip() or default)
    except ValueError:  # the SDK warns about it and uses its default
        milliseconds = default
    return max(milliseconds, 0.0) / 1000


class _HeldExporterLogs(logging.Filter):
    """Holds back the log records that the SDK's exporters emit while a dask_otel
    export runs in the current thread (one WARNING and one ERROR per failed batch,
    per retry), so that :class:`ExportOutage` can log once per outage instead."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        held = getattr(self.local, "held", None)
        if held is None:
            return True
        held.append(record)
        if getattr(self.local, "cut_retries", False) and RETRYING.match(str(record.msg)):
            # Propagates out of the exporter's logger call, ending its retry loop
            # before the backoff wait: the outage is known at once
            raise RetryCut(record.getMessage())
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

#: How the SDK's OTLP exporters report a collector that does not serve a signal at
#: all (HTTP 404, 405, 501; gRPC UNIMPLEMENTED), not retried: "Failed to export
#: metrics batch code: 405, reason: Method Not Allowed", "... error code:
#: StatusCode.UNIMPLEMENTED". Phoenix and Jaeger, for instance, take traces only.
REFUSED = re.compile(r"\bcode: (?:40[45]|501)\b|\bStatusCode\.UNIMPLEMENTED\b")
#: The setting that stops exporting a signal, by ExportOutage.signal
SILENCED_BY = {
    "spans": ("OTEL_TRACES_EXPORTER", "otel.traces.exporter"),
    "metrics": ("OTEL_METRICS_EXPORTER", "otel.metrics.exporter"),
    "logs": ("OTEL_LOGS_EXPORTER", "otel.logs.exporter"),
}


class ExportOutage:
    """Counts what one exporter shipped and lost, and logs an outage once: a WARNING
    with the exporter's reason when exports start failing, one when they recover.
    A collector that does not serve the signal at all (:data:`REFUSED`) is no
    outage: one WARNING says so and names the setting that stops the export
    (:data:`SILENCED_BY`), and it does not count as failing (shutdown still
    flushes). Runs in the SDK's export thread."""

    def __init__(self, signal: str, retry_during_outage: bool = False):
        self.signal = signal
        #: ``otel.export.retry-during-outage``: the SDK's retries for every batch,
        #: no probes
        self.retry_during_outage = retry_during_outage
        #: seconds between probes during an outage
        self.probe_interval = PROBE_AFTER * export_interval(signal)
        #: batches dropped without a request during an outage
        self.skipped = 0
        #: when the last request was sent (``time.monotonic()``)
        self._last_request = float("-inf")
        #: items the collector accepted
        self.exported = 0
        #: items lost because an export failed, or was not tried during an outage
        self.failed = 0
        #: failed export calls
        self.export_failures = 0
        #: failed export calls since the last success
        self.failing = 0
        #: export calls the collector refused for good (:data:`REFUSED`) since
        #: the last success
        self.refused = 0
        #: True once the bridge shut the exporter down: what the SDK still hands
        #: it, or what the shutdown cut short (a metric reader's last collection,
        #: on opentelemetry-sdk 1.41), is lost and counted, and no outage logged
        self.closed = False
        #: the export under way: when it started (``time.monotonic()``), and the
        #: exporter's log records held so far (a retry logs one)
        self._started: float | None = None
        self._held: list[logging.LogRecord] = []

    @property
    def in_outage(self) -> bool:
        """True while the collector is not answering, as far as can be told now:
        the last export failed, or the one under way is retrying (only with
        ``otel.export.retry-during-outage``) or has had no answer for
        :data:`STALLED_AFTER` seconds. Read from other threads (on
        shutdown, to not wait for what would not arrive)."""
        started = self._started
        return bool(
            self.failing
            or (started is not None and (
                time.monotonic() - started > STALLED_AFTER
                or any(RETRYING.match(str(r.msg)) for r in self._held)
            ))
        )

    def export(self, export: Callable[[], Any], items: int) -> bool:
        if self.closed:
            self.failed += items
            return False
        now = time.monotonic()
        if (
            self.failing
            and not self.retry_during_outage
            and now - self._last_request < self.probe_interval
        ):
            # A known outage, and not yet time for the next probe: no request
            self.failed += items
            self.skipped += 1
            return False
        self._last_request = now
        local = HELD_EXPORTER_LOGS.local
        local.held = held = self._held = []
        local.cut_retries = not self.retry_during_outage
        self._started = now
        try:
            ok = bool(export())
        except RetryCut as e:
            # The SDK's announcement of the retry is the reason (it names the
            # error); it was held like the exporter's other lines
            held[-1] = logging.makeLogRecord({"msg": _retry_reason(str(e))})
            ok = False
        except Exception as e:
            held.append(logging.makeLogRecord({"msg": f"{type(e).__name__}: {e}"}))
            ok = False
        finally:
            local.held = None
            local.cut_retries = False
            self._started = None
        if ok:
            self.exported += items
            if self.failing or self.refused:
                logger.warning(
                    "dask_otel: %s export recovered after %d failed exports",
                    self.signal, self.failing + self.refused,
                )
                self.failing = self.refused = 0
            return True
        self.failed += items
        if self.closed:  # cut short by the bridge's own shutdown: no outage
            return False
        self.export_failures += 1
        reason = held[-1].getMessage() if held else "the exporter returned FAILURE"
        logger.debug("dask_otel: %s export failed: %s", self.signal, reason)
        if any(REFUSED.search(r.getMessage()) for r in held):
            if not self.refused:
                variable, key = SILENCED_BY.get(self.signal, ("", ""))
                logger.warning(
                    "dask_otel: the collector does not accept %s (%s): it refuses them "
                    "for good, so they are dropped; to stop sending them, set %s=none "
                    "(or %s: none)",
                    self.signal, reason, variable, key,
                )
            self.refused += 1
            return False
        if not self.failing:
            logger.warning(
                "dask_otel: cannot export %s (%s); dropping them until the collector "
                "answers again (counted in the self-metrics, logged once per outage)",
                self.signal, reason,
            )
        self.failing += 1
        return False


def _retry_reason(announcement: str) -> str:
    """The error in the SDK's retry announcement, without the retry it announces"""
    return re.sub(r"^Transient error |, retrying in [0-9.]+s\.?", "", announcement).strip()


class AccountedSpanExporter(SpanExporter):
    """A SpanExporter with :class:`ExportOutage` accounting and outage policy"""

    def __init__(self, exporter: SpanExporter, retry_during_outage: bool = False):
        self.exporter = exporter
        self.outage = ExportOutage("spans", retry_during_outage)

    def export(self, spans):
        ok = self.outage.export(
            lambda: self.exporter.export(spans) is SpanExportResult.SUCCESS, len(spans)
        )
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        # Called by the bridge first (to interrupt a waiting export), then by the
        # span processor: the exporter's own shutdown warns when called twice
        if not self.outage.closed:
            self.outage.closed = True
            self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    # The self-metrics read these
    spans_exported = property(lambda self: self.outage.exported)
    spans_failed = property(lambda self: self.outage.failed)
    export_failures = property(lambda self: self.outage.export_failures)


def accounted_metric_exporter(exporter: Any, retry_during_outage: bool = False) -> Any:
    """The metric exporter wrapped with :class:`ExportOutage` accounting and policy"""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class AccountedMetricExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=exporter._preferred_temporality,
                preferred_aggregation=exporter._preferred_aggregation,
            )
            self.exporter = exporter
            self.outage = ExportOutage("metrics", retry_during_outage)

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            ok = self.outage.export(
                lambda: self.exporter.export(metrics_data, timeout_millis=timeout_millis)
                is MetricExportResult.SUCCESS,
                1,
            )
            return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return self.exporter.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            # Called by the bridge first, then by the reader: once is enough
            if not self.outage.closed:
                self.outage.closed = True
                self.exporter.shutdown(timeout_millis=timeout_millis)

    return AccountedMetricExporter()


def accounted_log_exporter(exporter: Any, retry_during_outage: bool = False) -> Any:
    """The log record exporter wrapped with :class:`ExportOutage` accounting and
    policy"""
    from opentelemetry.sdk._logs import export as sdk

    # Renamed in SDK 1.39 (LogExporter -> LogRecordExporter); older names still work
    base = getattr(sdk, "LogRecordExporter", None) or sdk.LogExporter
    Result = getattr(sdk, "LogRecordExportResult", None) or sdk.LogExportResult

    class AccountedLogExporter(base):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            self.exporter = exporter
            self.outage = ExportOutage("logs", retry_during_outage)

        def export(self, batch):
            ok = self.outage.export(
                lambda: self.exporter.export(batch) is Result.SUCCESS, len(batch)
            )
            return Result.SUCCESS if ok else Result.FAILURE

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return self.exporter.force_flush(timeout_millis)

        def shutdown(self) -> None:
            # Called by the bridge first, then by the log processor: once is enough
            if not self.outage.closed:
                self.outage.closed = True
                self.exporter.shutdown()

    return AccountedLogExporter()
