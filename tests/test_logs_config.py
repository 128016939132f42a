"""The log handler the bridge uses in each environment (``dask_otel/export/logs.py``,
docs/logs.md, "The handler"): opentelemetry-instrumentation-logging's, else the
SDK's own, both adding where a line was logged; with neither, log export is a bad
``otel.logs.exporter`` value: a :class:`~dask_otel.ConfigError` naming the key and
the value, as the README's configuration section promises of every bad setting."""

from __future__ import annotations

import sys

import opentelemetry.sdk._logs
import pytest

import dask_otel
from tests.support.cluster import otel_cluster, wait_until
from tests.support.tasks import inc, log_in_task

#: As if opentelemetry-instrumentation-logging were not installed
WITHOUT_INSTRUMENTATION = "opentelemetry.instrumentation.logging.handler"


def test_log_export_without_any_logging_handler_is_a_config_error_naming_the_key(monkeypatch):
    """Neither opentelemetry-instrumentation-logging nor an SDK that still has its
    own ``LoggingHandler`` (it is deprecated): the scheduler says why the bridge is
    off, naming the key, the value and the fix, and the cluster computes"""
    monkeypatch.setitem(sys.modules, WITHOUT_INSTRUMENTATION, None)
    monkeypatch.delattr(opentelemetry.sdk._logs, "LoggingHandler")
    with otel_cluster({"otel.logs.exporter": "memory"}, n_workers=1) as (client, _):
        assert client.submit(inc, 1).result() == 2
        status = dask_otel.status(client)
    error = status["scheduler"]["error"]
    assert error.startswith("ConfigError: otel.logs.exporter: expected "), error
    assert "pip install 'dask-otel[logs]'" in error and error.endswith("got ['memory']")


@pytest.mark.parametrize("handler", ["instrumentation-logging", "sdk"])
def test_each_handler_adds_where_the_line_was_logged(monkeypatch, handler):
    """docs/logs.md: both handlers add the record's ``code.file.path``,
    ``code.function.name`` and ``code.line.number``"""
    if handler == "sdk":
        monkeypatch.setitem(sys.modules, WITHOUT_INSTRUMENTATION, None)
    with otel_cluster({"otel.logs.exporter": "memory"}, n_workers=1) as (client, mirrored):
        (exporter,) = mirrored.plugin.telemetry.exporters["logs"]
        client.submit(log_in_task, 7).result()
        (record,) = wait_until(lambda: [
            d.log_record for d in exporter.get_finished_logs()
            if d.log_record.body == "scored partition 7"
        ], what="the task's log record")
    attributes = record.attributes
    assert attributes["code.function.name"].endswith("log_in_task")
    assert attributes["code.file.path"].endswith("tasks.py")
    assert isinstance(attributes["code.line.number"], int)
