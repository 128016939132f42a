"""Python log records of the scheduler and workers as OpenTelemetry logs.

Off unless asked for: set ``OTEL_LOGS_EXPORTER=otlp`` (the SDK's variable) or the
dask config key ``otel.logs.exporter: otlp`` (also ``console``, ``memory``). Then
each Dask server process puts one SDK ``LoggingHandler`` on the root logger,
feeding a ``LoggerProvider`` with a ``BatchLogRecordProcessor`` (bounded queue,
batching, retries: ``OTEL_BLRP_*``) and the OTLP log exporter (``OTEL_EXPORTER_OTLP_*``),
wrapped in the bridge's export accounting, so that a collector outage is logged
once, not once per batch.

Correlation
    The handler takes the trace and span id of each record from the current
    OpenTelemetry context. Inside a task that is the task's Dask span (or task
    span, see :mod:`dask_otel.worker.execute_hook`), so a log line written by task code
    carries the ids of the span it belongs to.

Level
    ``otel.logs.level`` (default ``INFO``) is the handler's threshold. Python's
    own logger levels still apply first: the root logger's default is WARNING,
    so an application's ``logger.info`` reaches the exporter only if that logger
    (or an ancestor) is set to INFO or lower. The bridge never changes logger
    levels.

Not exported
    Records of the OpenTelemetry SDK and exporters themselves (``opentelemetry.*``
    loggers): exporting an exporter's complaint about exporting would feed back.
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
