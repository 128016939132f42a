"""Python log records of the scheduler and workers as OpenTelemetry logs.

Off unless asked for (``OTEL_LOGS_EXPORTER`` or ``otel.logs.exporter``). Then each
Dask server process puts one SDK ``LoggingHandler`` on the root logger, feeding a
``LoggerProvider`` whose batched exporters are wrapped in the bridge's export
accounting, so that a collector outage is logged once, not once per batch. The
handler takes each record's trace and span ids from the current OTel context: in
a task, its Dask span's. Records of the ``opentelemetry.*`` loggers are filtered
out: exporting an exporter's complaint about exporting would feed back. What is
exported, and at which levels: docs/traces.md, "Logs".
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from dask_otel.config import OtelConfig
from dask_otel.export.exporters import log_exporters


class _NotFromOpenTelemetry(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("opentelemetry")


class LogExport:
    """The LoggerProvider and root-logger handler of one process.

    ``exporters`` are kept so that tests can read an in-memory exporter;
    ``accounted_exporters`` hold the accounting of batched exporters.
    """

    #: the SDK's LoggerProvider that the handler feeds
    provider: Any
    #: the SDK's LoggingHandler on the root logger
    handler: logging.Handler
    exporters: list
    accounted_exporters: list

    def __init__(self, config: OtelConfig, resource: Any):
        from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
        from opentelemetry.sdk._logs.export import (
            BatchLogRecordProcessor,
            SimpleLogRecordProcessor,
        )

        from dask_otel.export.accounting import accounted_log_exporter

        self.exporters = log_exporters(config.logs_exporters)
        self.accounted_exporters = []
        # We own the lifecycle (flush bounded by otel.flush-timeout), as for spans
        self.provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        for exporter in self.exporters:
            # The in-memory exporter is for tests: no batching delay
            if type(exporter).__name__.startswith("InMemoryLog"):
                self.provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
            else:
                accounted = accounted_log_exporter(exporter)
                self.accounted_exporters.append(accounted)
                self.provider.add_log_record_processor(BatchLogRecordProcessor(accounted))
        with warnings.catch_warnings():
            # 1.39+ deprecates it for opentelemetry-instrumentation-logging's, which
            # is not a dependency; it is the same handler
            warnings.simplefilter("ignore", DeprecationWarning)
            self.handler = LoggingHandler(level=config.logs_level, logger_provider=self.provider)
        self.handler.addFilter(_NotFromOpenTelemetry())
        logging.getLogger().addHandler(self.handler)

    def force_flush(self, timeout_millis: int) -> None:
        self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.provider.shutdown()
