"""Log export that this environment cannot do is a bad ``otel.logs.exporter`` value:
a :class:`~dask_otel.ConfigError` naming the key and the value, as the README's
configuration section promises of every bad setting (``dask_otel/export/logs.py``)."""

from __future__ import annotations

import sys

import opentelemetry.sdk._logs

import dask_otel
from tests.support.cluster import otel_cluster
from tests.support.tasks import inc


def test_log_export_without_any_logging_handler_is_a_config_error_naming_the_key(monkeypatch):
    """Neither opentelemetry-instrumentation-logging nor an SDK that still has its
    own ``LoggingHandler`` (it is deprecated): the scheduler says why the bridge is
    off, naming the key, the value and the fix, and the cluster computes"""
    monkeypatch.setitem(sys.modules, "opentelemetry.instrumentation.logging.handler", None)
    monkeypatch.delattr(opentelemetry.sdk._logs, "LoggingHandler")
    with otel_cluster({"otel.logs.exporter": "memory"}, n_workers=1) as (client, _):
        assert client.submit(inc, 1).result() == 2
        status = dask_otel.status(client)
    error = status["scheduler"]["error"]
    assert error.startswith("ConfigError: otel.logs.exporter: expected "), error
    assert "pip install 'dask-otel[logs]'" in error and error.endswith("got ['memory']")
