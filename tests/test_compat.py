"""Tripwires for what dask_otel/_compat.py relies on: each fails when an installed
release changes it, before a user's cluster notices."""

from __future__ import annotations

import logging
import time

import pytest

from dask_otel import _compat
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env


def test_sdk_retry_adapter_was_checked_against_the_installed_sdk():
    """Above RETRY_ANNOUNCED_UP_TO the outage policy falls back to the SDK's retries
    (an outage known when an export returns FAILURE): check the next test on the new
    release, then raise the bound"""
    assert _compat.sdk_version() <= _compat.RETRY_ANNOUNCED_UP_TO, _compat.sdk_version()


class _CutAtTheAnnouncement(logging.Filter):
    """What the adapter does, on its own: at the record announces_retry() reads,
    the exporter's public shutdown()"""

    def __init__(self, exporter):
        super().__init__()
        self.exporter = exporter
        self.records: list[logging.LogRecord] = []

    def filter(self, record):
        self.records.append(record)
        if _compat.announces_retry(record) and len(self.records) == 1:
            self.exporter.shutdown()
        return False


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sdk_otlp_exporter_announces_a_retry_that_its_shutdown_ends(protocol, monkeypatch):
    """The SDK's OTLP span exporter, against a collector answering UNAVAILABLE (503)
    with a 10 s timeout: its first record is the announcement of a retry, logged on
    the export thread before its backoff wait, and its shutdown() then ends the
    export at once, failed"""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from dask_otel.export.exporters import span_exporters

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("test").start_span("one").end()
    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
        (exporter,) = span_exporters(["otlp"])
        cut = _CutAtTheAnnouncement(exporter)
        loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                   if name.startswith("opentelemetry.exporter")]
        for sdk_logger in loggers:
            sdk_logger.filters.insert(0, cut)
        try:
            start = time.monotonic()
            result = exporter.export(memory.get_finished_spans())
            seconds = time.monotonic() - start
        finally:
            for sdk_logger in loggers:
                sdk_logger.removeFilter(cut)
    assert result is SpanExportResult.FAILURE
    assert cut.records and _compat.announces_retry(cut.records[0]), [
        (r.levelname, r.getMessage()) for r in cut.records]
    assert receiver.requests == 1
    assert seconds < 0.5, seconds  # its backoff alone is about 1 s
