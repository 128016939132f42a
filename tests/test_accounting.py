"""Export accounting: a collector that refuses a signal for good (a traces-only
backend such as Phoenix or Jaeger) is reported once, as such, with the setting that
stops the export; not as an outage the collector may recover from. Real
exporters, a real receiver that does not serve one signal."""

from __future__ import annotations

import logging
import os
import time

import pytest
from distributed import span

import dask_otel
from tests.support.cluster import MEMORY_CONFIG, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, closed_port

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
                export = wait_until(
                    lambda: (e := dask_otel.status(client)["scheduler"]["export"])["spans"]["items"]
                    >= 2 and e[signal]["failures"] >= 3 and e
                )
                rejected = receiver.rejected
    assert export["spans"]["dropped"] == 0
    # the refused signal's failed requests are the scheduler's process's, in status()
    assert export[signal]["failures"] <= rejected and export[signal]["items"] == 0
    assert not (receiver.metric_points() if signal == "metrics" else receiver.logs())
    messages = dask_otel_messages(caplog)
    refused = [m for m in messages if f"does not accept {signal}" in m]
    assert len(refused) == 1, messages
    assert SETTING[signal] in refused[0]
    assert ("405" if protocol == "http/protobuf" else "UNIMPLEMENTED") in refused[0]
    # The close still flushes (the signal the collector serves): it does not give
    # up on the exports because one signal is refused
    assert not [m for m in messages if "exports are failing" in m]


def test_a_refused_signal_does_not_keep_the_close_from_flushing_the_others(monkeypatch):
    """Metrics refused for good are an outage of metrics only: the close still
    flushes the spans, which only its flush exports here (spans every 30 s)"""
    with OTLPReceiver("grpc") as receiver:
        receiver.refuse = {"metrics"}
        for key in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(), **FAST_EXPORT_ENV,
                           "OTEL_BSP_SCHEDULE_DELAY": "30000"}.items():
            monkeypatch.setenv(key, value)
        with otel_cluster({**OTLP_CONFIG, "otel.logs.exporter": "OTEL_LOGS_EXPORTER"}) as (client, mirrored):
            with span("flushed at close") as sid:
                client.submit(inc, 1, key="flushed-1").result()
            wait_until(lambda: receiver.rejected >= 1, what="metrics refused")
            wait_until(lambda: mirrored.plugin.mirror.mirrored >= 2, what="the span mirrored")
            assert not receiver.spans()
        received = {s.attributes.get("dask.span.id") for s in receiver.spans()}
    assert sid in received


# -- The outage policy: real SDK exporters, the harness receiver, no cluster ----------

#: Spans exported every 300 ms: probes at most every 240 ms (PROBE_AFTER)
PROBE_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "300", "OTEL_EXPORTER_OTLP_TIMEOUT": "10"}


def finished_spans(n: int) -> list:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for i in range(n):
        provider.get_tracer("test").start_span(f"span {i}").end()
    return list(memory.get_finished_spans())


def otel_config(**values):
    """The bridge's config at its defaults, with ``values``"""
    import dataclasses

    return dataclasses.replace(dask_otel.config.read_config(), **values)


#: The processors the recipe builds around each exporter below: shut down after each
#: test, so that no thread of theirs outlives it (test_lifecycle waits for the bridge's)
PROCESSORS: list = []


@pytest.fixture(autouse=True)
def _shut_down_processors():
    yield
    while PROCESSORS:
        PROCESSORS.pop().shutdown()


def accounted_otlp_exporter(env: dict, monkeypatch, retry_during_outage: bool = False):
    """The SDK's OTLP span exporter, as the bridge builds and wraps it"""
    from dask_otel.export.accounting import HELD_EXPORTER_LOGS, AccountedExporter
    from dask_otel.export.exporters import EnvRecipe, export_interval

    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in {**PROBE_ENV, **env}.items():  # the test's own values win
        monkeypatch.setenv(key, value)
    built = []

    def account(signal, exporter, interval):
        built.append(AccountedExporter(signal, exporter, interval, retry_during_outage))
        return built[-1]

    PROCESSORS.extend(EnvRecipe(otel_config(traces_exporters=("otlp",))).processors("spans", account))
    HELD_EXPORTER_LOGS.attach()
    (exporter,) = built
    assert exporter.health.interval == export_interval("spans")
    return exporter


def in_outage(outage) -> bool:
    """Exports are failing, or the one under way cannot complete"""
    return bool(outage.failing) or outage.stalled


def timed_export(exporter, spans) -> tuple[bool, float]:
    from opentelemetry.sdk.trace.export import SpanExportResult

    start = time.monotonic()
    ok = exporter.export(spans) is SpanExportResult.SUCCESS
    return ok, time.monotonic() - start


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unavailable_collector_is_an_outage_at_once_probed_once_per_interval(
    protocol, monkeypatch, caplog
):
    """UNAVAILABLE (503) on the first export: FAILURE at once instead of the SDK's
    retries for up to OTEL_EXPORTER_OTLP_TIMEOUT (10 s here); then no request until
    the probe interval has passed; the first probe that succeeds ends the outage"""
    spans = finished_spans(3)
    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        exporter = accounted_otlp_exporter(receiver.env(), monkeypatch)
        with caplog.at_level(logging.DEBUG):
            try:
                ok, seconds = timed_export(exporter, spans)
                assert not ok
                assert seconds < 0.5  # the SDK alone: retries after ~1 s, ~2 s, ~4 s
                assert receiver.requests == 1
                assert in_outage(exporter.health)
                # Between probes: dropped and counted without a request
                for _ in range(5):
                    ok, seconds = timed_export(exporter, spans)
                    assert not ok and seconds < 0.05
                assert receiver.requests == 1
                assert exporter.health.dropped == 6 * 3
                assert exporter.health.failures == 1
                # A probe once the interval has passed, still failing
                time.sleep(0.3)
                assert timed_export(exporter, spans)[0] is False
                assert receiver.requests == 2
                # The collector is back: the next probe succeeds and export resumes
                receiver.mode = "ok"
                assert timed_export(exporter, spans)[0] is False  # too early: no request
                time.sleep(0.3)
                assert timed_export(exporter, spans)[0] is True
                assert timed_export(exporter, spans)[0] is True  # no wait after recovery
                assert not in_outage(exporter.health)
            finally:
                exporter.shutdown()
    assert receiver.requests == 4
    assert len(receiver.spans()) == 2 * 3
    assert exporter.health.items == 2 * 3
    messages = dask_otel_messages(caplog)
    (warning,) = [m for m in messages if "cannot export spans" in m]
    assert "unavailable" in warning.lower(), warning  # gRPC's code, HTTP's reason
    assert "retrying" not in warning  # the reason, not the SDK's announcement
    assert [m for m in messages if "export recovered" in m]
    # the SDK's retry announcements were held back
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_refused_connection_is_an_outage_at_once(protocol, monkeypatch):
    spans = finished_spans(2)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    exporter = accounted_otlp_exporter(env, monkeypatch)
    try:
        ok, seconds = timed_export(exporter, spans)
        assert not ok and seconds < 0.5, seconds
        assert in_outage(exporter.health)
        assert exporter.health.dropped == 2
    finally:
        exporter.shutdown()


def test_retry_during_outage_gives_the_sdk_its_retries_back(monkeypatch, caplog):
    """otel.export.retry-during-outage: true: the SDK retries the batch until its
    timeout (1 s here) has no room for the next backoff (0.4 s, set by the
    collector), and every batch is sent; the outage WARNING says so"""
    spans = finished_spans(1)
    with OTLPReceiver("grpc", mode="unavailable") as receiver:
        receiver.retry_after = 0.4  # the SDK's backoff, set by the collector
        exporter = accounted_otlp_exporter(
            {**receiver.env(), "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}, monkeypatch,
            retry_during_outage=True,
        )
        try:
            ok, seconds = timed_export(exporter, spans)
            assert ok is False
            # Requests at 0, 0.4 and 0.8 s: retried, and within its 1 s (the SDK's
            # six attempts would take 2 s)
            assert receiver.requests == 3, receiver.requests
            assert 0.8 <= seconds < 1.5, seconds
            before = receiver.requests
            assert timed_export(exporter, spans)[0] is False  # sent again, no probe wait
            assert receiver.requests > before
        finally:
            exporter.shutdown()
    (warning,) = [m for m in dask_otel_messages(caplog) if "cannot export spans" in m]
    assert "retrying each batch" in warning and "dropping them until" not in warning


def test_a_wrapped_metric_exporter_keeps_the_exporters_temporality(monkeypatch):
    """The SDK's metric reader reads its exporter's preferred temporality: through
    the accounting wrapper it is still the OTLP exporter's (delta here, as
    OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE says)"""
    from opentelemetry.sdk.metrics import MeterProvider

    from dask_otel.export.accounting import AccountedExporter
    from dask_otel.export.exporters import EnvRecipe

    with OTLPReceiver("grpc") as receiver:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(),
                           "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "delta"}.items():
            monkeypatch.setenv(key, value)
        accounted: list = []

        def account(signal, exporter, interval):
            accounted.append(AccountedExporter(signal, exporter, interval))
            return accounted[-1]

        readers = EnvRecipe(otel_config(metrics_exporters=("otlp",))).metric_readers(account)
        provider = MeterProvider(metric_readers=readers, shutdown_on_exit=False)
        try:
            provider.get_meter("test").create_counter("wrapped.count").add(3)
            provider.force_flush()
            (point,) = receiver.wait_for(lambda r: r.metric_points("wrapped.count"))
        finally:
            provider.shutdown()
    assert point.temporality == "delta"
    assert accounted and accounted[0].health.items >= 1  # 1.41: one more at shutdown


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_retry_cut_holds_with_opentelemetrys_loggers_at_error(protocol, monkeypatch):
    """A user who quiets OpenTelemetry's loggers (``setLevel(ERROR)``, or
    ``logging: {opentelemetry: error}`` in dask config) keeps the outage policy: the
    first export to a collector answering UNAVAILABLE ends at once (the SDK alone
    waits ~1 s for its first retry, within its 10 s timeout), and the exporter is
    the one built, still open"""
    spans = finished_spans(1)
    quiet = logging.getLogger("opentelemetry")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # setLevel: the loggers' cached levels are cleared
    try:
        with OTLPReceiver(protocol, mode="unavailable") as receiver:
            exporter = accounted_otlp_exporter(receiver.env(), monkeypatch)
            built = exporter.exporter
            try:
                ok, seconds = timed_export(exporter, spans)
                assert not ok and seconds < 0.5, seconds
                assert receiver.requests == 1
                assert in_outage(exporter.health)
                receiver.mode = "ok"
                time.sleep(0.3)  # the probe interval (240 ms)
                assert timed_export(exporter, spans)[0] is True
            finally:
                exporter.shutdown()
    finally:
        quiet.setLevel(level)
    # no exporter (nor its gRPC channel, its HTTP session) built again for the cut
    assert exporter.exporter is built
    assert len(receiver.spans()) == 1
