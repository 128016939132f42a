"""Export accounting: a collector that refuses a signal for good (a traces-only
backend such as Phoenix or Jaeger) is reported once, as such, with the setting that
stops the export; not as an outage the collector may recover from. Real
exporters, a real receiver that does not serve one signal."""

from __future__ import annotations

import logging
import os

import pytest
from distributed import span

import dask_otel
from tests.support.cluster import MEMORY_CONFIG, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver

#: Spans, metrics and logs over OTLP, metrics every 200 ms
OTLP_CONFIG = {
    **MEMORY_CONFIG,
    "otel.traces.exporter": "otlp",
    "otel.metrics.exporter": "otlp",
    "otel.logs.exporter": "otlp",
    "otel.flush-timeout": "2s",
}
FAST_EXPORT_ENV = {
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_BLRP_SCHEDULE_DELAY": "100",
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
}
#: What the WARNING names to stop sending a signal
SETTING = {"metrics": "OTEL_METRICS_EXPORTER=none", "logs": "OTEL_LOGS_EXPORTER=none"}


def inc(x):
    return x + 1


def dask_otel_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dask_otel"]


@pytest.mark.parametrize("signal", ["metrics", "logs"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_signal_the_collector_does_not_serve_is_reported_once_with_the_setting_to_stop_it(
    protocol, signal, monkeypatch, caplog
):
    with OTLPReceiver(protocol) as receiver:
        receiver.refuse = {signal}
        for key in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(), **FAST_EXPORT_ENV}.items():
            monkeypatch.setenv(key, value)
        with caplog.at_level(logging.INFO, logger="dask_otel"):
            with otel_cluster(OTLP_CONFIG) as (client, mirrored):
                with span("traced") as sid:
                    client.submit(inc, 1, key="traced-1").result()
                receiver.wait_for(
                    lambda r: any(s.attributes.get("dask.span.id") == sid for s in r.spans())
                )
                for i in range(3):  # three batches of logs, three refusals
                    logging.getLogger("an.application").warning("line %d", i)
                    wait_until(lambda: receiver.rejected > i, what=f"{signal} refused")
                status = wait_until(
                    lambda: (s := dask_otel.status(client)["scheduler"])["spans_delivered"] >= 2
                    and s
                )
    assert status["spans_failed"] == 0
    assert not (receiver.metric_points() if signal == "metrics" else receiver.logs())
    messages = dask_otel_messages(caplog)
    refused = [m for m in messages if f"does not accept {signal}" in m]
    assert len(refused) == 1, messages
    assert SETTING[signal] in refused[0]
    assert ("405" if protocol == "http/protobuf" else "UNIMPLEMENTED") in refused[0]
    # Not an outage: nothing waits for the collector to answer again, and the
    # close still flushes
    assert not [m for m in messages if "cannot export" in m or "exports are failing" in m]
