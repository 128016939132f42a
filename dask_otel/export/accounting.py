"""Export accounting and the outage policy: what each batched exporter shipped and
lost, one WARNING per outage instead of one per failed batch and retry, and no
export thread waiting on a collector that does not answer.

One engine for the three signals (:class:`AccountedExporter`, the cut of the SDK's
``BatchProcessor[T]``) wraps the SDK's exporter and runs in the SDK's export thread;
batching, queues and timeouts stay the SDK's. Invariants: every item handed to an
exporter is counted once, as exported or failed; an exporter that the bridge shut
down is never built again. Costs: nothing per item; a request whose retry the
policy ends builds the SDK's exporter again, once (``shutdown()``, which ends the
retry, is final).

What the policy does for users, and how to get the SDK's retries back:
docs/deploy.md, "When telemetry fails". The SDK offers no public way to end its
retry cycle early; the one adapter that does is :func:`dask_otel._compat.announces_retry`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dask_otel._compat import RETRY_ANNOUNCED_UP_TO, announces_retry, sdk_version

logger = logging.getLogger("dask_otel")

#: Seconds without an answer after which an export counts as an outage: a healthy
#: collector answers within milliseconds, and shutdown should not wait for one
#: that does not
STALLED_AFTER = 1.0

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
#: The setting that stops exporting a signal, named in the outage WARNING: a
#: collector that does not serve a signal (Jaeger and Phoenix take traces only)
#: fails every export of it, as an outage that never ends
SILENCED_BY = {
    "spans": ("OTEL_TRACES_EXPORTER", "otel.traces.exporter"),
    "metrics": ("OTEL_METRICS_EXPORTER", "otel.metrics.exporter"),
    "logs": ("OTEL_LOGS_EXPORTER", "otel.logs.exporter"),
}


def export_interval(signal: str) -> float:
    """Seconds between the SDK's scheduled exports of ``signal``, as it reads them"""
    variable, default = EXPORT_INTERVAL[signal]
    try:
        milliseconds = float(os.environ.get(variable, "").strip() or default)
    except ValueError:  # the SDK warns about it and uses its default
        milliseconds = default
    return max(milliseconds, 0.0) / 1000


class _HeldExporterLogs(logging.Filter):
    """Holds back the log records that the SDK's exporters emit while an accounted
    export runs in the current thread (one WARNING and one ERROR per failed batch,
    per retry), so that :class:`ExportOutage` logs once per outage instead, with
    their reason. Never raises; the only thing it does besides holding is telling
    the export under way that the SDK announced a retry
    (:func:`~dask_otel._compat.announces_retry`)."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        export: _Export | None = getattr(self.local, "export", None)
        if export is None:
            return True
        export.held.append(record)
        if export.retrying is None and ADAPTER and announces_retry(record):
            export.retrying = record
            try:
                export.on_retry()
            except Exception:  # a filter must never raise into the SDK's logging call
                logger.debug("dask_otel: ending an export's retry failed", exc_info=True)
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

#: The SDK's exporters announce a retry as :func:`~dask_otel._compat.announces_retry` reads it
#: (the versions tested); above them the SDK retries within its timeout, and an
#: outage is known when the export returns FAILURE or has stalled
ADAPTER = sdk_version() <= RETRY_ANNOUNCED_UP_TO

#: exporter -> how to build another like it (filled by
#: :mod:`dask_otel.export.exporters`): a retry the policy ends shuts an exporter down
BUILDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _Export:
    """One export under way"""

    #: called in the export thread when the SDK announces a retry
    on_retry: Callable[[], None]
    #: ``time.monotonic()`` when it started
    started: float = field(default_factory=time.monotonic)
    #: the exporter's log records so far
    held: list[logging.LogRecord] = field(default_factory=list)
    #: the record that announced a retry, if one did
    retrying: logging.LogRecord | None = None


class ExportOutage:
    """Counts what one exporter shipped and lost, and logs an outage once: a WARNING
    with the exporter's reason and the setting that stops the signal when exports
    start failing, one when they recover. Runs in the SDK's export thread; read
    from others."""

    #: ``spans``, ``metrics`` or ``logs``, as :data:`EXPORT_INTERVAL` names them
    signal: str
    #: ``otel.export.retry-during-outage``: the SDK's retries for every batch, no probes
    retry_during_outage: bool
    #: seconds between probes during an outage
    probe_interval: float
    #: items the collector accepted
    exported: int
    #: items lost because an export failed, or was not tried during an outage
    failed: int
    #: failed export calls (requests, probes included)
    export_failures: int
    #: batches dropped without a request during an outage
    skipped: int
    #: failed export calls since the last success
    failing: int
    #: True once the bridge shut the exporter down: what the SDK still hands it, or
    #: what the shutdown cut short (a metric reader's last collection), is lost and
    #: counted, and no outage logged
    closed: bool
    #: True while the bridge flushes before closing: an outage is not probed then
    closing: bool
    #: when the last request was sent (``time.monotonic()``)
    _last_request: float
    #: the export under way, if any
    _export: _Export | None

    def __init__(self, signal: str, retry_during_outage: bool = False):
        self.signal = signal
        self.retry_during_outage = retry_during_outage
        self.probe_interval = PROBE_AFTER * export_interval(signal)
        self.exported = self.failed = self.export_failures = 0
        self.skipped = self.failing = 0
        self.closed = self.closing = False
        self._last_request = float("-inf")
        self._export = None

    @property
    def in_outage(self) -> bool:
        """True while exports are failing, or the one under way cannot complete
        (:attr:`stalled`). Read from other threads (on shutdown, to not wait for
        what would not arrive)."""
        return bool(self.failing) or self.stalled

    @property
    def stalled(self) -> bool:
        """True while the export under way has announced a retry, or has had no
        answer for :data:`STALLED_AFTER` seconds: a flush waiting for it waits on
        the collector. (A probe of a collector that refuses the signal for good
        comes back at once: it does not keep the close from flushing the others.)"""
        export = self._export
        return export is not None and (
            export.retrying is not None or time.monotonic() - export.started > STALLED_AFTER
        )

    def export(self, send: Callable[[], bool], items: int, on_retry: Callable[[], None]) -> bool:
        """``send()`` the batch unless the outage policy drops it; True if the
        collector took it. ``on_retry`` is called (in this thread) if the SDK
        announces a retry."""
        if self.closed:
            self.failed += items
            return False
        now = time.monotonic()
        if self.failing and not self.retry_during_outage and (
            self.closing or now - self._last_request < self.probe_interval
        ):
            # A known outage, and not yet time for the next probe: no request
            self.failed += items
            self.skipped += 1
            return False
        self._last_request = now
        export = self._export = _Export(on_retry)
        HELD_EXPORTER_LOGS.local.export = export
        error = None
        try:
            ok = bool(send())
        except Exception as e:
            error, ok = f"{type(e).__name__}: {e}", False
        finally:
            HELD_EXPORTER_LOGS.local.export = None
            self._export = None
        if ok:
            self.exported += items
            if self.failing:
                logger.warning(
                    "dask_otel: %s export recovered after %d failed exports",
                    self.signal, self.failing,
                )
                self.failing = 0
            return True
        self.failed += items
        if self.closed:  # cut short by the bridge's own shutdown: no outage
            return False
        self.export_failures += 1
        reason = error or _reason(export)
        logger.debug("dask_otel: %s export failed: %s", self.signal, reason)
        if not self.failing:
            variable, key = SILENCED_BY[self.signal]
            logger.warning(
                "dask_otel: cannot export %s (%s); dropping them until the collector "
                "answers again (counted in the self-metrics, logged once per outage). "
                "A collector that does not accept %s refuses them for good: to stop "
                "sending them, set %s=none (or %s: none)",
                self.signal, reason, self.signal, variable, key,
            )
        self.failing += 1
        return False


def _reason(export: _Export) -> str:
    """What the user is shown of the exporter's failure: its retry announcement
    without the retry it announces, else its last line (shown, never decided on)"""
    if export.retrying is not None:
        return re.sub(
            r"^Transient error |,? retrying in [0-9.]+s\.?", "", export.retrying.getMessage()
        ).strip()
    if export.held:
        return export.held[-1].getMessage()
    return "the exporter returned FAILURE"


E = TypeVar("E")


class AccountedExporter(Generic[E]):
    """An SDK exporter of any signal with :class:`ExportOutage` accounting and the
    outage policy: what the SDK's batch processor or metric reader calls
    (``export``, ``force_flush``, ``shutdown``) goes through it; anything else it
    reads of an exporter (a metric exporter's preferred temporality and
    aggregation) is the wrapped exporter's.

    Under the policy, a request whose retry the SDK announces ends there: the
    exporter is shut down (its public way to end a retry wait) and the next request
    goes to a new one from ``build``.
    """

    #: the SDK exporter requests go to now
    exporter: E
    #: makes a new exporter like the first, after a retry was cut
    build: Callable[[], E]
    outage: ExportOutage
    #: the signal's export result: ``SUCCESS``, ``FAILURE``
    result: Any

    #: items in a batch: a metric export is one
    items: Callable[[Any], int]
    #: True when the exporter was shut down to end a retry: the next request
    #: builds a new one
    _cut: bool

    def __init__(
        self, signal: str, exporter: E, result: Any, retry_during_outage: bool = False
    ):
        self.exporter = exporter
        self.build = BUILDS.get(exporter, type(exporter))
        self.result = result
        self.outage = ExportOutage(signal, retry_during_outage)
        self.items = (lambda batch: 1) if signal == "metrics" else len
        self._lock = threading.Lock()
        self._cut = False

    def export(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        def send() -> bool:
            # Built here, when a request is sent: a failure to build counts as the export's
            with self._lock:
                if self._cut and not self.outage.closed:
                    self.exporter = self.build()
                    self._cut = False
                exporter = self.exporter
            return exporter.export(batch, *args, **kwargs) == self.result.SUCCESS

        ok = self.outage.export(send, self.items(batch), self._on_retry)
        return self.result.SUCCESS if ok else self.result.FAILURE

    def _on_retry(self) -> None:
        if self.outage.retry_during_outage:
            return  # the SDK's retries, within its timeout
        with self._lock:
            self._cut = True
            exporter = self.exporter
        exporter.shutdown()  # type: ignore[attr-defined]

    def force_flush(self, timeout_millis: float = 30_000, **kwargs: Any) -> bool:
        return self.exporter.force_flush(timeout_millis)  # type: ignore[attr-defined]

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        # Called by the bridge first (to interrupt a waiting export), then by the
        # SDK's processor or reader: once is enough (a second call warns)
        with self._lock:
            if self.outage.closed:
                return
            self.outage.closed = True
            cut = self._cut
        if not cut:
            self.exporter.shutdown()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define (the SDK's metric reader reads a
        # metric exporter's preferences when it is built)
        if name == "exporter":  # not set yet
            raise AttributeError(name)
        return getattr(self.exporter, name)

    # The self-metrics read these
    spans_exported = property(lambda self: self.outage.exported)
    spans_failed = property(lambda self: self.outage.failed)
    export_failures = property(lambda self: self.outage.export_failures)


class AccountedSpanExporter(AccountedExporter):
    """A span exporter with :class:`ExportOutage` accounting and policy"""

    def __init__(self, exporter: Any, retry_during_outage: bool = False):
        from opentelemetry.sdk.trace.export import SpanExportResult

        super().__init__("spans", exporter, SpanExportResult, retry_during_outage)


def accounted_metric_exporter(exporter: Any, retry_during_outage: bool = False) -> AccountedExporter:
    """The metric exporter wrapped with :class:`ExportOutage` accounting and policy"""
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return AccountedExporter("metrics", exporter, MetricExportResult, retry_during_outage)


def accounted_log_exporter(exporter: Any, retry_during_outage: bool = False) -> AccountedExporter:
    """The log record exporter wrapped with :class:`ExportOutage` accounting and
    policy"""
    from opentelemetry.sdk._logs.export import LogRecordExportResult

    return AccountedExporter("logs", exporter, LogRecordExportResult, retry_during_outage)
