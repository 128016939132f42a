"""Log records as OpenTelemetry logs (dask_otel.logs), correlated with the task
they were written in, over a real OTLP receiver from real worker processes."""

from __future__ import annotations

import logging
import time

import pytest
from distributed import span

from tests.support.cluster import dask_span_ids, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import log_in_task, log_info_in_task


@pytest.mark.parametrize("source", ["env", "config"])
def test_log_line_in_task_arrives_with_the_tasks_trace_and_span_id(monkeypatch, source):
    config = {"otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100"})
        if source == "env":
            monkeypatch.setenv("OTEL_LOGS_EXPORTER", "otlp")
        else:
            config["otel.logs.exporter"] = "otlp"
        with otel_cluster(config, processes=True) as (client, _):
            with span("scoring") as sid:
                client.submit(log_in_task, 42).result()
            receiver.wait_for(lambda r: [g for g in r.logs() if g.body == "scored partition 42"])
    (record,) = [g for g in receiver.logs() if g.body == "scored partition 42"]
    trace_id, span_id = dask_span_ids(sid)
    assert record.trace_id == f"{trace_id:032x}"
    assert record.span_id == f"{span_id:016x}"
    assert record.severity_text == "WARN"
    assert record.resource["service.name"] == "dask"
    assert "dask.scheduler.address" in record.resource


def test_log_level_threshold_and_task_spans_context(monkeypatch):
    config = {
        "otel.logs.exporter": "otlp",
        "otel.logs.level": "WARNING",
        "otel.tasks.spans": True,
        "otel.traces.exporter": "otlp",
        "otel.flush-timeout": "2s",
    }
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100",
                                   "OTEL_BSP_SCHEDULE_DELAY": "100"})
        with otel_cluster(config, processes=True) as (client, _):
            with span("levels"):
                future = client.submit(log_in_task, 7)
                future.result()
                client.submit(log_info_in_task, 8).result()
            record = receiver.wait_for(
                lambda r: next((g for g in r.logs() if g.body == "scored partition 7"), None)
            )
            (task_span,) = receiver.wait_for(
                lambda r: [s for s in r.spans("log_in_task") if "dask.task.key" in s.attributes]
            )
            time.sleep(0.5)
    # a chosen task's span is its context: its log line carries the task span's id
    assert (record.trace_id, record.span_id) == (task_span.trace_id, task_span.span_id)
    assert not [g for g in receiver.logs() if g.body == "quiet detail 8"]
    assert all(g.severity_number >= 13 for g in receiver.logs())  # WARN and above


def test_log_export_is_off_by_default():
    from dask_otel.config import read_config

    assert read_config().logs_exporters == ()


def test_log_export_outage_is_logged_once(monkeypatch, caplog):
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "1s"}
    with OTLPReceiver("grpc", mode="unavailable") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100",
                                   "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
        with caplog.at_level(logging.INFO):
            with otel_cluster(config) as (client, _):
                for i in range(4):
                    client.submit(log_in_task, i).result()
                    wait_until(lambda i=i: receiver.rejected > i, timeout=10)
                receiver.mode = "ok"
                client.submit(log_in_task, 100).result()
                receiver.wait_for(lambda r: [g for g in r.logs() if g.body == "scored partition 100"])
    told = [r.getMessage() for r in caplog.records if "cannot export logs" in r.getMessage()]
    assert len(told) == 1, told
    assert any("logs export recovered" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
