"""Tripwires for dask_otel/_compat.py: each private name of Dask or of the
OpenTelemetry SDK the bridge relies on still exists, and behaves as relied on, in
the installed release (a release that changes one fails here, not on a user's
cluster), and each version switch says what the installed version does. Real
in-process clusters (``gen_cluster``) and real OTLP exporters against a receiver
on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from distributed import span
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster, inc

from dask_otel import _compat
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env


# --- distributed -------------------------------------------------------------------


def dask_span(s, span_id):
    return s.extensions["spans"].spans[span_id]


@gen_cluster(client=True)
async def test_dask_span_keeps_its_own_fine_metrics_in_cumulative_worker_metrics(c, s, a, b):
    with span("metered") as span_id:
        await c.submit(inc, 1, key="metered-1")
    await asyncio.sleep(0)
    metered = dask_span(s, span_id)
    assert isinstance(metered._cumulative_worker_metrics, dict)
    assert _compat.span_own_metrics(metered) is metered._cumulative_worker_metrics


@gen_cluster(client=True)
async def test_dask_span_keeps_the_thread_count_history_active_cpu_seconds_reads(c, s, a, b):
    with span("threads") as span_id:
        await c.submit(inc, 1, key="threads-1")
    threads = dask_span(s, span_id)
    history, offset = _compat.span_nthreads_history(threads)
    assert history is threads._total_nthreads_history
    assert offset == threads._total_nthreads_offset and 0 <= offset < len(history)


@gen_cluster(client=True)
async def test_dask_update_graph_plugins_see_the_span_annotation_the_client_sent(c, s, a, b):
    """The span mirror's ``_sent_in``: in ``update_graph``, the tasks of block B that
    join A's TaskGroup say A (the spans extension rewrote them), the graph's
    computation keeps what the client sent: B"""
    seen = []

    class Sent(SchedulerPlugin):
        def update_graph(self, scheduler, *, tasks=(), **kwargs):
            computation, sent = _compat.sent_annotations(scheduler)
            ts = scheduler.tasks[tasks[0]]
            seen.append((computation, sent.get("span"), ts.annotations["span"]["ids"][-1]))

    s.add_plugin(Sent(), name="sent")
    with span("A") as a_id:
        first = c.submit(inc, 1, key="sent-1")
        await first
    with span("B") as b_id:
        await c.submit(inc, 2, key="sent-2")
    (_, sent_a, task_a), (computation, sent_b, task_b) = seen
    assert sent_a["ids"][-1] == task_a == a_id
    assert sent_b["ids"][-1] == b_id and task_b == a_id and b_id not in s.extensions["spans"].spans
    assert computation is s.computations[-1]


@gen_cluster(client=True)
async def test_dask_span_made_detached_keeps_its_parent_and_reads_as_dasks(c, s, a, b):
    """``_compat.detached_span``: Dask's Span, built as the extension builds one, held
    by no extension; a detached parent lives as long as its child"""
    import gc

    root = _compat.detached_span(("made",), "11111111-1111-1111-1111-111111111111", None, s)
    child = _compat.detached_span(("made", "step"), "22222222-2222-2222-2222-222222222222",
                                  root, s)
    del root
    gc.collect()
    assert child.parent.name == ("made",) and child.parent.parent is None
    assert child.annotation == {"name": ("made", "step"), "ids": (
        "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222")}
    assert not child.groups and _compat.span_nthreads_history(child) is not None
    assert child.id not in s.extensions["spans"].spans


@gen_cluster(client=True)
async def test_dask_remove_worker_lists_lost_keys_as_compat_says(c, s, a, b):
    events = []

    class Events(SchedulerPlugin):
        def log_event(self, topic, msg):
            events.append(msg)

    s.add_plugin(Events(), name="events")
    kept = c.submit(inc, 1, key="kept-1", workers=[a.address])
    await kept
    await s.remove_worker(a.address, stimulus_id="test", close=False)
    removed = next(e for e in events if isinstance(e, dict) and e.get("action") == "remove-worker")
    assert ("lost-computed-tasks" in removed) is _compat.REMOVE_WORKER_LISTS_LOST_KEYS


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_dask_task_function_finds_the_function_a_worker_runs(c, s, a):
    future = c.submit(inc, 1, key="inc-1")
    seen = []
    while not seen:
        ts = a.state.tasks.get("inc-1")
        if ts is not None:
            seen.append(_compat.task_function(ts.run_spec))
        await asyncio.sleep(0.001)
    await future
    assert seen[0] is inc


@gen_cluster(client=True)
async def test_dask_client_sends_every_graph_where_on_graph_sent_sees_it(c, s, a, b):
    """submit, map, compute and persist go through ``Client._graph_to_futures``,
    under the block's annotations: the block learns the client its graphs went to"""
    import dask

    import dask_otel
    from dask_otel import client as block_clients

    with dask_otel.span("sent") as sid:
        seen = block_clients._sent[sid]
        for send in (lambda: c.submit(inc, 1, key="sent-1"), lambda: c.map(inc, [2]),
                     lambda: c.compute(dask.delayed(inc)(3)), lambda: c.persist(dask.delayed(inc)(4))):
            seen.clear()
            await c.gather(send())
            assert seen == {s.address: c}
    assert sid not in block_clients._sent


# --- OpenTelemetry SDK --------------------------------------------------------------


def test_sdk_retry_adapter_was_checked_against_the_installed_sdk():
    """Above RETRY_WAIT_UP_TO the outage policy falls back to the SDK's retries
    (an outage known when an export returns FAILURE): check the next test on the new
    release, then raise the bound"""
    assert _compat.sdk_version() <= _compat.RETRY_WAIT_UP_TO, _compat.sdk_version()


def _finished(signal: str) -> list:
    """What an exporter of ``signal`` is handed: a finished span, or log record"""
    if signal == "spans":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        provider.get_tracer("test").start_span("one").end()
        return list(memory.get_finished_spans())
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor

    memory = InMemoryLogRecordExporter()
    provider = LoggerProvider(shutdown_on_exit=False)
    provider.add_log_record_processor(SimpleLogRecordProcessor(memory))
    logger = logging.getLogger("test_compat.finished")
    handler = LoggingHandler(logger_provider=provider)
    logger.addHandler(handler)
    try:
        logger.warning("one")
    finally:
        logger.removeHandler(handler)
    return list(memory.get_finished_logs())


@pytest.mark.parametrize("signal", ["spans", "logs"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sdk_otlp_exporter_waits_for_its_retry_where_cut_retry_waits_asks(
    protocol, signal, monkeypatch
):
    """The SDK's OTLP exporter, against a collector answering UNAVAILABLE (503) with
    a 10 s timeout: cut_retry_waits() finds the wait of its retry backoff, which
    asks the cut once and then ends the export at once, failed"""
    from dask_otel.export.exporters import _exporter

    with OTLPReceiver(protocol, mode="unavailable") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
        exporter = _exporter(signal, "otlp")
        asked = []
        assert _compat.cut_retry_waits(exporter, lambda: asked.append(1) or True)
        try:
            start = time.monotonic()
            result = exporter.export(_finished(signal))
            seconds = time.monotonic() - start
        finally:
            exporter.shutdown()
    assert result.name == "FAILURE"
    assert asked == [1]
    assert receiver.requests == 1
    assert seconds < 0.5, seconds  # its backoff alone is about 1 s


def _metrics_data():
    """What a metric exporter is handed: one collection of a counter"""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("test").create_counter("one").add(1, {"n": 1})
    try:
        return reader.get_metrics_data()
    finally:
        provider.shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sdk_otlp_exporters_send_what_otlp_encoder_encodes(protocol, monkeypatch):
    """Each of the SDK's OTLP exporters (three signals) sends, to the byte, the
    request ``_compat.otlp_encoder`` makes of its batch (the logs' encoder is under a
    private module name); another exporter has no encoder"""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from dask_otel.export.exporters import _exporter

    with OTLPReceiver(protocol) as receiver:
        set_otel_env(monkeypatch, receiver.env())
        for signal, batch in (("spans", _finished("spans")), ("metrics", _metrics_data()),
                              ("logs", _finished("logs"))):
            exporter = _exporter(signal, "otlp")
            try:
                assert exporter.export(batch).name == "SUCCESS"
            finally:
                exporter.shutdown()
            (_, request), = receiver.raw_requests[-1:]
            encode = _compat.otlp_encoder(signal, exporter)
            assert encode(batch).ByteSize() == request.ByteSize() > 0, signal
    assert _compat.otlp_encoder("spans", ConsoleSpanExporter()) is None


# -- declarative --


def test_declarative_factories_build_what_the_bridge_wraps():
    """opentelemetry-configuration's private factories that
    dask_otel._compat.declared_* call: one exporter per signal, the span limits, a
    view and an exemplar filter, from the package's own models"""
    pytest.importorskip("opentelemetry.configuration")
    from opentelemetry.configuration import models
    from opentelemetry.sdk._logs.export import LogRecordExporter
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.metrics.view import View
    from opentelemetry.sdk.trace import SpanLimits
    from opentelemetry.sdk.trace.export import SpanExporter

    from dask_otel import _compat

    assert isinstance(_compat.declared_span_exporter(models.SpanExporter(console={})), SpanExporter)
    assert isinstance(
        _compat.declared_metric_exporter(models.PushMetricExporter(console=models.ConsoleMetricExporter())), MetricExporter
    )
    assert isinstance(
        _compat.declared_log_exporter(models.LogRecordExporter(console={})), LogRecordExporter
    )
    limits = _compat.declared_span_limits(
        models.SpanLimits(attribute_value_length_limit=8), None
    )
    assert isinstance(limits, SpanLimits) and limits.max_span_attribute_length == 8
    view = models.View(
        selector=models.ViewSelector(instrument_name="x"), stream=models.ViewStream(name="y")
    )
    assert isinstance(_compat.declared_view(view), View)
    assert "TraceBased" in type(
        _compat.declared_exemplar_filter(models.ExemplarFilter.trace_based)
    ).__name__


# -- outcomes --


def test_outcomes_update_graph_is_given_the_annotations_by_name_then_key():
    """dask_otel.scheduler.outcomes reads a graph's first ``otel`` annotation from
    ``SchedulerPlugin.update_graph``'s ``annotations`` (2024.1.0 to 2026.8.0)"""
    import inspect

    from distributed.diagnostics.plugin import SchedulerPlugin

    parameter = inspect.signature(SchedulerPlugin.update_graph).parameters["annotations"]
    assert "dict[str, dict[Key, Any]]" in str(parameter.annotation)


def test_outcomes_retire_workers_logs_the_status_change_before_removing():
    """dask.worker.removed's ``retired``: retire_workers sets the worker's status to
    closing_gracefully through handle_worker_status_change, which logs a
    ``worker-status-change`` event under the worker's address (2024.1.0 to 2026.8.0)"""
    import inspect

    from distributed import Scheduler

    retire = inspect.getsource(Scheduler.retire_workers)
    assert "Status.closing_gracefully" in retire and "handle_worker_status_change" in retire
    change = inspect.getsource(Scheduler.handle_worker_status_change)
    assert '"worker-status-change"' in change and '"status": ws.status.name' in change
# -- limits --


def _points_of(observed: int, views: list) -> list:
    """The points of one collection of an observable counter that observes
    ``observed`` attribute sets, on a MeterProvider with ``views``"""
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=views)
    provider.get_meter("dask_otel").create_observable_counter(
        "series", callbacks=[lambda _: [Observation(1, {"n": n}) for n in range(observed)]])
    try:
        (metric,) = [m for rm in reader.get_metrics_data().resource_metrics
                     for sm in rm.scope_metrics if sm.scope.name == "dask_otel"
                     for m in sm.metrics]
        return list(metric.data.data_points)
    finally:
        provider.shutdown()


def test_limits_the_sdk_caps_series_and_a_view_sets_the_cap_from_1_45_2_only():
    """The switch of ``_compat.series_limit_view_options``: from 1.45.2 a stream
    keeps 2,000 attribute sets plus one overflow point unless a View's
    ``aggregation_cardinality_limit`` says otherwise; before, no cap, and a View
    refuses that argument (so the bridge passes none)"""
    from opentelemetry.sdk.metrics.view import View

    overflow = {"otel.metric.overflow": True}
    options = _compat.series_limit_view_options(3)
    if options:
        points = _points_of(2500, [])
        assert len(points) == 2001 and [p for p in points if p.attributes == overflow]
        limited = _points_of(10, [View(meter_name="dask_otel", **options)])
        assert len(limited) == 4 and limited[-1].attributes == overflow
    else:
        assert len(_points_of(2500, [])) == 2500
        with pytest.raises(TypeError):
            View(meter_name="dask_otel", aggregation_cardinality_limit=3)


# ---- controls


@gen_cluster(nthreads=[("127.0.0.1", 1)])
async def test_dask_worker_execute_has_the_shape_the_task_context_hook_wraps(s, a):
    """The in-task context's hook wraps ``Worker.execute(key, ...)`` on the
    instance, finding the task's annotations in ``state.tasks``"""
    assert _compat.execute_hookable(a) is None
