"""The scheduler's metrics (dask_otel.metrics): fine performance metrics and the
bridge's self-metrics; the metric table of docs/metrics.md against what is emitted;
OTLP over gRPC and HTTP from real scheduler and worker processes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dask.array as da
import prometheus_client
import pytest
from distributed import LocalCluster, span, wait

from dask_otel.export.instruments import (
    COUNTER,
    GAUGE,
    Attached,
    MetricSpec,
    ProcessInstruments,
)
from dask_otel.scheduler.metrics import SCHEDULER_METRICS, fine_metric_attributes
from dask_otel.spill import SPILL_METRICS
from tests.support import oracle
from tests.support.cluster import spilling_cluster, wait_until
from tests.support.metrics import collect, metric_reader, value
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.processes import dask_processes
from tests.support.tasks import die_once, double, inc, make_chunk, slow_inc, sum_chunks, total

pytestmark = pytest.mark.timeout(60)

DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"


def heartbeats_carried(cluster: LocalCluster, key: tuple) -> None:
    """Wait until the workers' fine performance metrics for ``key`` reached the
    scheduler (they travel with heartbeats)"""
    wait_until(lambda: cluster.scheduler.cumulative_worker_metrics.get(key), what=str(key))


def fine_metrics_by_unit(metrics: dict) -> dict[str, dict[tuple, float]]:
    """Dask's fine metrics as ``{dask unit: {sorted attribute items: value}}``"""
    out: dict[str, dict[tuple, float]] = {}
    for key, v in metrics.items():
        parsed = fine_metric_attributes(key)
        if parsed is not None:
            unit, attributes = parsed
            out.setdefault(unit, {})[tuple(sorted(attributes.items()))] = v
    return out


def exported_by_unit(points: dict) -> dict[str, dict[tuple, float]]:
    names = {"seconds": "dask.activity.time", "bytes": "dask.activity.size", "count": "dask.activity.count"}
    return {
        unit: {tuple(sorted(p.attributes.items())): p.value for p in points.get(name, [])}
        for unit, name in names.items()
    }


# --- fine performance metrics ---------------------------------------------------------


def test_fine_metric_keys_become_bounded_attributes():
    assert fine_metric_attributes(("execute", "inc", "thread-cpu", "seconds")) == (
        "seconds",
        {"dask.activity.context": "execute", "dask.task.prefix": "inc",
         "dask.activity.name": "thread-cpu"},
    )
    assert fine_metric_attributes(("gather-dep", "network", "seconds")) == (
        "seconds",
        {"dask.activity.context": "gather-dep", "dask.activity.name": "network"},
    )
    assert fine_metric_attributes(("p2p", "background-comms", "send", "bytes")) == (
        "bytes",
        {"dask.activity.context": "p2p", "dask.activity.where": "background-comms",
         "dask.activity.name": "send"},
    )
    # Digests that are not fine performance metrics
    assert fine_metric_attributes("tick-duration") is None
    assert fine_metric_attributes(("latency",)) is None


def test_fine_metrics_equal_the_schedulers_totals():
    with spilling_cluster(n_workers=2) as (cluster, client):
        parts = client.map(inc, range(20))
        assert client.submit(total, parts).result() == sum(range(1, 21))
        heartbeats_carried(cluster, ("execute", "total", "thread-cpu", "seconds"))
        expected = fine_metrics_by_unit(dict(cluster.scheduler.cumulative_worker_metrics))
        points = collect(metric_reader(cluster))

    assert exported_by_unit(points) == expected
    prefixes = {p.attributes.get("dask.task.prefix") for p in points["dask.activity.time"]}
    assert {"inc", "total"} <= prefixes
    activities = {
        p.attributes["dask.activity.name"]
        for p in points["dask.activity.time"]
        if p.attributes.get("dask.task.prefix") == "inc"
    }
    assert {"thread-cpu", "thread-noncpu", "executor", "other"} <= activities
    assert value(points, "dask.activity.count", dask_task_prefix="total",
                 dask_activity_name="memory-read") >= 1


def fine_snapshot(cluster: LocalCluster) -> dict:
    """The scheduler's fine metrics now (not ``latency`` and the like)"""
    return {k: v for k, v in dict(cluster.scheduler.cumulative_worker_metrics).items()
            if isinstance(k, tuple)}


def test_an_unchanged_collection_reuses_its_observations_and_a_change_shows_at_the_next():
    """docs/metrics.md "What a collection costs": across collections in which no fine
    metric changed, though heartbeats changed Dask's ``latency`` in between, the bridge
    hands the SDK the very same observations; tasks that ran since show at the next
    collection, those of a task prefix new since the last (a read looks only at the
    keys Dask added since) as well"""
    name = "dask.activity.time"
    with spilling_cluster(n_workers=2) as (cluster, client):
        assert client.submit(total, client.map(inc, range(20))).result() == sum(range(1, 21))
        heartbeats_carried(cluster, ("execute", "total", "thread-cpu", "seconds"))
        reader = metric_reader(cluster)
        server = cluster.scheduler.plugins["dask-otel"].metrics

        def reused_across_a_heartbeat() -> bool:
            before = fine_snapshot(cluster)
            for _ in range(3):  # a reading is given observations to keep when seen again
                collect(reader)
            observations = server.observed[name][1]
            assert observations
            latency = cluster.scheduler.cumulative_worker_metrics["latency"]
            wait_until(lambda: cluster.scheduler.cumulative_worker_metrics["latency"] != latency,
                       what="a heartbeat")
            collect(reader)
            if fine_snapshot(cluster) != before:  # a late heartbeat of the tasks: again
                return False
            assert server.observed[name][1] is observations
            return True

        wait_until(reused_across_a_heartbeat, what="two collections with no fine metric changed")
        grown = ("execute", "inc", "thread-cpu", "seconds")
        ran = cluster.scheduler.cumulative_worker_metrics[grown]
        assert client.submit(total, client.map(inc, range(100, 140))).result() > 0
        fresh = ("execute", "fresh", "thread-cpu", "seconds")
        client.gather(client.map(inc, range(5), key=[f"fresh-{i}" for i in range(5)]))
        wait_until(lambda: cluster.scheduler.cumulative_worker_metrics[grown] > ran
                   and fresh in cluster.scheduler.cumulative_worker_metrics, what="inc grew")

        def exported_as_dask_has_them() -> bool:
            expected = fine_snapshot(cluster)
            points = collect(reader)
            if fine_snapshot(cluster) != expected:  # a heartbeat in between: again
                return False
            assert exported_by_unit(points) == fine_metrics_by_unit(expected)
            return True

        wait_until(exported_as_dask_has_them, what="a collection between two heartbeats")
        points = collect(reader)
        assert value(points, name, dask_task_prefix="inc", dask_activity_name="thread-cpu") > ran
        assert value(points, name, dask_task_prefix="fresh", dask_activity_name="thread-cpu") > 0


#: docs/metrics.md, "Attributes": past 2000 series per instrument the rest is one
#: overflow series (the number written there, not the code's constant)
MAX_SERIES = 2000


def kept_series(points: list) -> dict[tuple, float]:
    return {tuple(sorted(p.attributes.items())): p.value
            for p in points if p.attributes != {"otel.metric.overflow": True}}


def test_past_the_cardinality_limit_the_rest_is_one_overflow_series():
    """800 task prefixes make over 3,000 time-series of seconds (thread-cpu,
    thread-noncpu, executor, other...): the first 2,000 are exported as they are,
    the rest summed into one ``otel.metric.overflow`` series, so that nothing is
    lost from the total and a collection stays bounded. The first 2,000 stay the
    same when more prefixes come (each keeps a monotonic counter)."""
    with spilling_cluster() as (cluster, client):
        futures = [client.submit(inc, i, key=f"p{i}-0") for i in range(800)]
        wait(futures)
        heartbeats_carried(cluster, ("execute", "p799", "thread-cpu", "seconds"))
        expected = fine_metrics_by_unit(dict(cluster.scheduler.cumulative_worker_metrics))
        reader = metric_reader(cluster)
        points = collect(reader)
        # More prefixes, all past the limit: the kept series do not change, and the
        # overflow series sums the new ones too (a read looks only at the keys Dask
        # added since the last, each once)
        wait([client.submit(inc, i, key=f"later{i}-0") for i in range(50)])
        heartbeats_carried(cluster, ("execute", "later49", "thread-cpu", "seconds"))
        later_expected = fine_metrics_by_unit(dict(cluster.scheduler.cumulative_worker_metrics))
        later = collect(reader)

    seconds = expected["seconds"]
    assert len(seconds) > MAX_SERIES + 100
    exported = points["dask.activity.time"]
    assert len(exported) == MAX_SERIES + 1
    overflow = [p for p in exported if p.attributes == {"otel.metric.overflow": True}]
    assert len(overflow) == 1
    kept = kept_series(exported)
    assert all(seconds[attributes] == v for attributes, v in kept.items())
    assert sum(p.value for p in exported) == pytest.approx(sum(seconds.values()))
    assert kept_series(later["dask.activity.time"]).keys() == kept.keys()
    assert sum(p.value for p in later["dask.activity.time"]) == pytest.approx(
        sum(later_expected["seconds"].values()))


def test_no_span_attribute_by_default():
    with spilling_cluster(n_workers=2) as (cluster, client):
        with span("etl"):
            client.gather(client.map(inc, range(5)))
        heartbeats_carried(cluster, ("execute", "inc", "thread-cpu", "seconds"))
        points = collect(metric_reader(cluster))
    for name in ("dask.activity.time", "dask.activity.size", "dask.activity.count"):
        assert all("dask.span.name" not in p.attributes for p in points[name])


def test_span_label_breaks_task_metrics_down_by_span():
    with spilling_cluster({"otel.metrics.span-label": True}, n_workers=2) as (cluster, client):
        with span("etl"):
            client.gather(client.map(inc, range(10)))
        with span("report"):
            client.submit(total, list(range(5))).result()
        heartbeats_carried(cluster, ("execute", "total", "thread-cpu", "seconds"))
        expected = fine_metrics_by_unit(dict(cluster.scheduler.cumulative_worker_metrics))
        points = collect(metric_reader(cluster))

    time_points = points["dask.activity.time"]
    spans_of = lambda prefix: {
        p.attributes.get("dask.span.name")
        for p in time_points
        if p.attributes.get("dask.task.prefix") == prefix
    }
    assert spans_of("inc") == {("etl",)}
    assert spans_of("total") == {("report",)}
    # Contexts without a span carry no span attribute
    assert all(
        "dask.span.name" not in p.attributes
        for p in time_points
        if p.attributes["dask.activity.context"] not in ("execute", "p2p")
    )
    # Summed over spans, the totals are the scheduler's
    for unit, by_attributes in exported_by_unit(points).items():
        summed: dict[tuple, float] = {}
        for attributes, v in by_attributes.items():
            key = tuple(kv for kv in attributes if kv[0] != "dask.span.name")
            summed[key] = summed.get(key, 0) + v
        assert summed == pytest.approx(expected.get(unit, {})), unit


# --- self-metrics -----------------------------------------------------------------


def test_self_metrics_count_spans_exported_and_lost(monkeypatch):
    oracle.waive("every-task", "the receiver refuses batches on purpose, counted as dropped")
    oracle.waive("every-span", "the receiver refuses spans on purpose, counted as dropped")
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, receiver.env())
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        config = {
            "otel.traces.exporter": "otlp",
            "otel.spans.export-delay": "100ms",
            "otel.spans.poll-interval": "50ms",
        }
        with spilling_cluster(config) as (cluster, client):
            reader = metric_reader(cluster)
            with span("accepted"):
                client.gather(client.map(inc, range(3)))
            receiver.wait_for(lambda r: r.spans("accepted"), timeout=20)
            delivered = len(receiver.spans())
            points = wait_until(
                lambda: (p := collect(reader))
                and value(p, "dask.otel.export.items", dask_otel_signal="spans") == delivered
                and p,
                what="the exported count to match what the receiver got",
            )
            assert value(points, "dask.otel.span.mirrored") >= delivered
            assert value(points, "dask.otel.export.dropped", dask_otel_signal="spans") == 0
            assert value(points, "dask.otel.export.failures") == 0
            (exported,) = points["dask.otel.export.items"]
            assert exported.attributes == {"dask.otel.exporter": "OTLPSpanExporter",
                                           "dask.otel.signal": "spans"}

            receiver.mode = "reject"  # not retried: the batch is lost at once
            with span("rejected"):
                client.gather(client.map(inc, range(3, 6)))
            points = wait_until(
                lambda: (p := collect(reader)) and value(p, "dask.otel.export.failures") and p,
                what="an export failure to be counted",
            )
            assert value(points, "dask.otel.export.dropped", dask_otel_signal="spans") >= 1
            assert value(points, "dask.otel.export.items", dask_otel_signal="spans") == delivered


def test_export_dropped_counts_the_spans_of_a_refused_request_not_the_request(monkeypatch):
    """A collector that refuses every request (not retried): a Dask span of ten
    TaskGroups, eleven spans, handed to the SDK by one poll, in one request or two
    (the second then dropped without a request: an outage). dask.otel.export.dropped
    says 11, the spans; dask.otel.export.failures counts the requests."""
    with OTLPReceiver("grpc", mode="reject") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "500"})
        config = {"otel.traces.exporter": "otlp", "otel.spans.export-delay": "100ms",
                  "otel.spans.poll-interval": "50ms"}
        with spilling_cluster(config) as (cluster, client):
            reader = metric_reader(cluster)
            plugin = cluster.scheduler.plugins["dask-otel"]
            with span("refused"):
                client.gather([client.submit(inc, i, key=f"refused{i}-0") for i in range(10)])
            (accounted,) = plugin.telemetry.accounted_of("spans")
            wait_until(lambda: accounted.health.dropped == 11, what="the 11 spans refused")
            points = collect(reader)
            assert receiver.rejected < 11
    assert value(points, "dask.otel.export.dropped", dask_otel_signal="spans") == 11
    assert value(points, "dask.otel.export.failures") == receiver.rejected


def test_spans_past_the_builders_queue_count_as_dropped(monkeypatch):
    """A poll's spans that do not fit the builder thread's queue are lost before any
    exporter sees them: ``dask.otel.export.dropped`` counts them with
    ``error.type=queue_full``, so that the alert on it (docs/metrics.md) sees every
    span lost. A queue of one here, and a Dask span of ten TaskGroups that finish
    together: a poll hands several over at once."""
    oracle.waive("every-task", "a queue of 2 drops batches on purpose, counted")
    oracle.waive("every-span", "a queue of 2 drops spans on purpose, counted")
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, receiver.env())
        config = {"otel.traces.exporter": "otlp", "otel.spans.export-delay": "100ms",
                  "otel.spans.poll-interval": "50ms"}
        with spilling_cluster(config) as (cluster, client):
            reader = metric_reader(cluster)
            builder = cluster.scheduler.plugins["dask-otel"].mirror.builder
            builder.capacity = 1
            with span("full"):
                client.gather([client.submit(inc, i, key=f"full{i}-0") for i in range(10)])
            wait_until(lambda: builder.dropped, what="a poll's spans past the queue")
            points = wait_until(
                lambda: (p := collect(reader))
                and value(p, "dask.otel.export.dropped", error_type="queue_full") == builder.dropped
                and p,
                what="the queue-full drops to be counted",
            )
            assert value(points, "dask.otel.export.dropped", dask_otel_signal="spans") == builder.dropped  # nothing else lost


def test_self_metrics_add_up_under_a_sampler(monkeypatch):
    """mirrored + sampled_out is every span and TaskGroup that finished"""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    config = {"otel.traces.exporter": "memory", "otel.spans.export-delay": "100ms"}
    with spilling_cluster(config) as (cluster, client):
        reader = metric_reader(cluster)
        with span("dropped"):
            with span("child"):
                client.submit(inc, 1, key="dropped-1").result()
        points = wait_until(
            lambda: (p := collect(reader)) and value(p, "dask.otel.span.sampled_out") == 3 and p,
            what="root, child and its group counted as sampled out",
        )
        assert value(points, "dask.otel.span.mirrored") == 0


def test_metric_export_failures_are_counted(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, receiver.env())
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        receiver.mode = "reject"  # not retried: each export fails at once
        config = {"otel.metrics.exporter": ["memory", "otlp"]}
        with spilling_cluster(config) as (cluster, client):
            reader = metric_reader(cluster)
            client.submit(inc, 1).result()
            points = wait_until(
                lambda: (p := collect(reader))
                and any(
                    pt.value and pt.attributes.get("dask.otel.signal") == "metrics"
                    for pt in p.get("dask.otel.export.failures", ())
                )
                and p,
                what="a failed metric export to be counted",
            )
            (failed,) = [
                pt for pt in points["dask.otel.export.failures"]
                if pt.attributes["dask.otel.signal"] == "metrics"
            ]
            assert failed.attributes["dask.otel.exporter"] == "OTLPMetricExporter"



class _ManySeries(Attached):
    """A server whose every instrument observes 2,500 attribute sets"""


class _ManySeriesInstruments(ProcessInstruments):
    table = tuple(
        MetricSpec(f"many.{kind}", kind, "", "", lambda _: [(1, {"n": n}) for n in range(2500)])
        for kind in (GAUGE, COUNTER)
    )


def test_the_bridges_instruments_have_no_sdk_series_limit():
    """docs/metrics.md, "Series limits": opentelemetry-sdk 1.45.2 keeps 2,000
    attribute sets per stream by default; the views of the bridge's
    MeterProvider lift that for every kind of instrument the bridge creates
    (spill, memory and self-metrics included), so all 2,500 series arrive on
    every SDK, and no overflow point"""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from dask_otel.export.instruments import EXEMPLAR_VIEWS

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=EXEMPLAR_VIEWS)
    try:
        _ManySeriesInstruments.of(provider).attach(_ManySeries({}))
        points = collect(reader)
    finally:
        provider.shutdown()
    assert {name: len(series) for name, series in points.items()} == {
        "many.gauge": 2500, "many.counter": 2500}
    assert not [p for series in points.values() for p in series
                if "otel.metric.overflow" in p.attributes]

# --- the documented table ------------------------------------------------------------


def documented_metrics() -> dict[str, dict[str, str]]:
    """The instrument table of docs/metrics.md: ``{name: {column: cell}}``"""
    rows: dict[str, dict[str, str]] = {}
    header: list[str] | None = None
    for line in DOCS.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: "):
            continue
        if header[:2] != ["name", "type"]:
            continue  # another table
        row = dict(zip(header, cells))
        rows[row["name"].strip("`")] = {k: v.strip("`") for k, v in row.items()}
    return rows


def test_every_emitted_metric_is_documented_and_every_documented_one_emitted(monkeypatch):
    documented = documented_metrics()
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, receiver.env())
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        config = {
            "otel.metrics.exporter": ["memory", "prometheus"],
            "otel.traces.exporter": "otlp",
            "otel.spans.export-delay": "100ms",
        }
        with spilling_cluster(config, n_workers=2) as (cluster, client):
            chunks = client.map(make_chunk, range(6), workers=[next(iter(cluster.workers.values())).address])  # spills
            client.submit(sum_chunks, chunks).result()  # unspills
            # a P2P rechunk, for dask.activity.where
            da.ones((100, 100), chunks=(10, 100)).rechunk((100, 10), method="p2p").sum().compute()
            receiver.wait_for(lambda r: r.spans(), timeout=20)
            heartbeats_carried(cluster, ("execute", "sum_chunks", "disk-read", "count"))
            wait_until(
                lambda: any(k[0] == "p2p" for k in cluster.scheduler.cumulative_worker_metrics),
                what="P2P metrics",
            )
            client.retire_workers([list(cluster.workers.values())[-1].address])
            reader = metric_reader(cluster)
            points = wait_until(
                lambda: (p := collect(reader)) and "dask.otel.export.items" in p
                and "dask.worker.removed" in p and p,
                what="the self-metrics",
            )
            data = reader.get_metrics_data()
            exposition = prometheus_client.generate_latest().decode()

    emitted = {
        m.name: m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        if sm.scope.name == "dask_otel"
        for m in sm.metrics
    }
    assert set(points) == set(emitted)
    # Recorded only when an event loop was blocked past Dask's tick limit, which
    # Dask reads once at import: test_stalls.py blocks one, on processes, and reads it
    only_on_a_stall = {"dask.event_loop.blocked.duration"}
    # Observed once a collection saw a run open (here, maybe: test_outcomes.py holds one)
    once_a_run_was_seen_open = {"dask.workflow.active", "dask.workflow.tasks"}
    assert sorted(set(emitted) - once_a_run_was_seen_open) == sorted(
        set(documented) - only_on_a_stall - once_a_run_was_seen_open), (
        "docs/metrics.md and the emitted metrics differ")

    kinds = {"Gauge": GAUGE, "Sum": COUNTER, "Histogram": "histogram"}
    # The names of the samples Prometheus stores
    samples = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", exposition, flags=re.M))
    for name, metric in emitted.items():
        row = documented[name]
        assert row["type"] == kinds[type(metric.data).__name__], name
        assert row["unit"] == metric.unit, name
        assert row["prometheus name"] in samples, name
        for attribute in row["attributes"].replace("`", "").split(","):
            attribute = attribute.strip().split(" ")[0]
            if attribute and attribute != "dask.span.name":  # opt-in
                assert any(attribute in p.attributes for p in points[name]), (name, attribute)


def test_final_values_are_flushed_when_the_cluster_closes():
    with spilling_cluster() as (cluster, client):
        reader = metric_reader(cluster)
        (worker,) = cluster.workers.values()
        chunks = client.map(make_chunk, range(6))
        client.submit(sum_chunks, chunks).result()
        heartbeats_carried(cluster, ("execute", "sum_chunks", "thread-cpu", "seconds"))
        final = dict(worker.data.cumulative_metrics)
        # nothing collected so far: the first export is at the flush on close
    points = {}
    data = reader._metrics_data  # what the flush on close collected
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = [  # a histogram's points (workflow runs) have none
                    (dict(p.attributes), getattr(p, "value", None))
                    for p in metric.data.data_points
                ]
    assert {spec.name for spec in SPILL_METRICS + SCHEDULER_METRICS[:3]} <= set(points)
    written = [v for a, v in points["dask.spill.count"] if a["dask.activity.name"] == "disk-write"]
    assert written == [final["disk-write", "count"]]


CONSOLE_SCRIPT = """
import dask
from distributed import Client, LocalCluster
with dask.config.set({"distributed.scheduler.preload": ["dask_otel"],
                      "otel.metrics.exporter": "console", "otel.traces.exporter": "none"}):
    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            client.submit(sum, [1, 2]).result()
"""


def test_console_exporter_prints_the_metrics():
    # A subprocess: the SDK's console exporter writes to the sys.stdout of when it
    # was imported, which pytest's capture replaced
    out = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT], capture_output=True, text=True, timeout=60
    ).stdout
    for spec in SPILL_METRICS[:3]:
        assert f'"name": "{spec.name}"' in out, spec.name


# --- OTLP over the wire -----------------------------------------------------------------


def latest(receiver: OTLPReceiver, name: str, **attributes: Any) -> dict[str, float]:
    """The latest received value of ``name`` per worker address, summed over the
    series whose attributes include ``attributes``"""
    wanted = {k.replace("_", "."): v for k, v in attributes.items()}
    last: dict[tuple, tuple[float, float]] = {}
    for p in receiver.metric_points(name):
        if all(p.attributes.get(k) == v for k, v in wanted.items()):
            key = tuple(sorted(p.attributes.items()))
            if key not in last or p.time >= last[key][0]:
                last[key] = (p.time, p.value)
    out: dict[str, float] = {}
    for key, (_, v) in last.items():
        address = dict(key).get("dask.worker.address", "")
        out[address] = out.get(address, 0) + v
    return out


#: Workers of 100 MB that spill past 10 MB, configured as a user would
SPILL_ENV = {
    "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.1",
    "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE": "False",
}


# Three processes to start: slow on a busy machine. "signal" ends the test inside
# its with-blocks, so that the dask processes are stopped.
@pytest.mark.timeout(120, method="signal")
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spill_and_fine_metrics_arrive_over_otlp(protocol):
    with OTLPReceiver(protocol) as receiver:
        env = {**receiver.env(), **SPILL_ENV, "OTEL_TRACES_EXPORTER": "none"}
        with dask_processes(env, worker_args=("--memory-limit", "100MB")) as procs, procs.client() as client:
            workers = set(client.scheduler_info()["workers"])
            chunks = [client.map(make_chunk, range(i * 10, i * 10 + 5), workers=[w])
                      for i, w in enumerate(sorted(workers))]
            wait(sum(chunks, []))

            disk = receiver.wait_for(
                lambda r: (d := latest(r, "dask.spill.disk.size"))
                and set(d) == workers and all(d.values()) and d,
                timeout=20,
            )
            written = latest(receiver, "dask.spill.count", dask_activity_name="disk-write")
            more = client.map(make_chunk, range(100, 104))
            wait(more)
            receiver.wait_for(
                lambda r: sum(latest(r, "dask.spill.count", dask_activity_name="disk-write").values())
                > sum(written.values()),
                timeout=20,
            )
            client.submit(sum_chunks, sum(chunks, [])).result()
            receiver.wait_for(
                lambda r: sum(latest(r, "dask.spill.size", dask_activity_name="disk-read").values()) > 0,
                timeout=20,
            )
            receiver.wait_for(
                lambda r: latest(r, "dask.activity.time", dask_task_prefix="make_chunk"),
                timeout=20,
            )
            scheduler_address = procs.address
            # Close the cluster from the scheduler rather than by SIGINT: a
            # ``dask worker --no-nanny`` interrupted while it closes (and flushes
            # its metrics) can hang in asyncio's task cancellation
            client.shutdown()
            wait_until(lambda: all(p.poll() is not None for p in procs.procs.values()),
                       timeout=30, what="the dask processes to exit")

    assert all(v > 1_000_000 for v in disk.values())
    (counter,) = {(p.kind, p.monotonic, p.temporality, p.unit) for p in receiver.metric_points("dask.spill.count")}
    assert counter == ("sum", True, "cumulative", "{key}")
    (threshold,) = {p.value for p in receiver.metric_points("dask.memory.threshold")
                    if p.attributes["dask.threshold"] == "target"}
    assert threshold == 10_000_000
    fine = receiver.metric_points("dask.activity.time")
    assert {p.resource["dask.scheduler.address"] for p in fine} == {scheduler_address}
    assert {p.resource["service.name"] for p in fine} == {"dask"}
    spill = receiver.metric_points("dask.spill.memory.size")
    assert {p.attributes["dask.worker.name"] for p in spill} == {"worker-0", "worker-1"}


# --- exemplars ----------------------------------------------------------------------

#: Metrics collected every 300 ms and spans sent every 100 ms, over OTLP
EXEMPLARS_ENV = {"OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_BSP_SCHEDULE_DELAY": "100"}
#: Spans and metrics to the OTLP receiver, spans exported 100 ms after they finish
EXEMPLARS_CONFIG = {
    "otel.traces.exporter": "otlp",
    "otel.metrics.exporter": "otlp",
    "otel.spans.export-delay": "100ms",
    "otel.spans.poll-interval": "50ms",
}


def run_twice(cluster: LocalCluster, client, receiver: OTLPReceiver, name: str, *tasks) -> None:
    """Map each of ``tasks`` over range(10) in Dask span ``f"{name} first"``, and
    again in ``f"{name} second"`` once the first run's TaskGroup spans arrived: the
    second run grows series whose prefix has an exported span, which an exemplar
    needs (a span exported after its metrics last grew gives none). Each run waits
    until the scheduler forgot its tasks: a TaskGroup still known takes the next
    block's tasks of its prefix into this block's span (ARCHITECTURE.md)."""
    prefixes = {task.__name__ for task in tasks}
    for run in ("first", "second"):
        with span(f"{name} {run}"):
            client.gather([f for task in tasks for f in client.map(task, range(10))])
        wait_until(lambda: not cluster.scheduler.tasks, what=f"the tasks of {name!r} forgotten")
        receiver.wait_for(lambda r: {f"taskgroup/{p}" for p in prefixes} <= {s.name for s in r.spans()},
                          timeout=30)


def test_activity_metrics_carry_exemplars_of_exported_traces(monkeypatch):
    """A dask.activity.* series that grew carries an exemplar of the latest
    sampled TaskGroup span of its task prefix (SDK's default exemplar filter,
    trace_based); its trace is one the receiver got"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **EXEMPLARS_ENV})
        config = EXEMPLARS_CONFIG
        with spilling_cluster(config) as (cluster, client):
            run_twice(cluster, client, receiver, "inc", inc)

            def exemplars(r: OTLPReceiver) -> set[str]:
                return {
                    trace
                    for p in r.metric_points("dask.activity.time")
                    if p.attributes.get("dask.task.prefix") == "inc"
                    for trace, _ in p.exemplars
                }

            traces = receiver.wait_for(
                lambda r: (e := exemplars(r)) and e <= {s.trace_id for s in r.spans()} and e,
                timeout=30,
            )
    # Exemplars point at the TaskGroup spans of the prefix
    inc_spans = {(s.trace_id, s.span_id) for s in receiver.spans() if s.name == "taskgroup/inc"}
    pairs = {pair for p in receiver.metric_points("dask.activity.time") for pair in p.exemplars}
    assert traces and pairs and pairs <= inc_spans
    # A series without a task prefix (no TaskGroup span contributed) has none
    assert not any(p.exemplars for p in receiver.metric_points("dask.activity.time")
                   if "dask.task.prefix" not in p.attributes)


def test_a_series_that_did_not_grow_carries_no_exemplar(monkeypatch):
    """The exemplar rule at the value that shows it: an `inc` series still exported
    (its cumulative value unchanged) while and after `double` ran carries no
    exemplar, where `double`'s, which grew, got one. While `double` grows, Dask's
    mappings change, so each collection reads them again and looks at `inc`'s
    series too (an unchanged reading is reused, exemplars and all, and could not
    tell the rule from its mutation); the collections while a prefix's own work runs
    cannot tell 'grew' from 'always', later ones can."""
    oracle.waive("every-task", "the test clears the receiver between its phases")
    oracle.waive("every-span", "the test clears the receiver between its phases")
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **EXEMPLARS_ENV})
        config = EXEMPLARS_CONFIG

        def with_exemplar(r: OTLPReceiver, prefix: str) -> list:
            return [p for p in r.metric_points("dask.activity.time")
                    if p.attributes.get("dask.task.prefix") == prefix and p.exemplars]

        with spilling_cluster(config) as (cluster, client):
            run_twice(cluster, client, receiver, "inc", inc)
            receiver.wait_for(lambda r: with_exemplar(r, "inc"), timeout=30)
            time.sleep(0.5)  # inc's last heartbeat metrics are in
            receiver.clear()
            run_twice(cluster, client, receiver, "double", double)
            receiver.wait_for(lambda r: with_exemplar(r, "double"), timeout=30)
            receiver.wait_for(lambda r: len({p.time for p in r.metric_points("dask.activity.time")
                                             if p.attributes.get("dask.task.prefix") == "inc"}) >= 3,
                              timeout=30)
    later = [p for p in receiver.metric_points("dask.activity.time")
             if p.attributes.get("dask.task.prefix") == "inc"]
    # The premise: inc's series did not grow over these collections
    values: dict[tuple, set] = {}
    for p in later:
        values.setdefault(tuple(sorted(p.attributes.items())), set()).add(p.value)
    assert all(len(v) == 1 for v in values.values()), values
    # (the first collection since the clear may still see inc's last heartbeat:
    # grown since the read before it, which the clear hid)
    first = min(p.time for p in later)
    assert [p.exemplars for p in later if p.exemplars and p.time > first] == []
    # double's series grew, and carried an exemplar once: at a later collection
    # at the same value (nothing changed since), none
    by_series: dict[tuple, list] = {}
    for p in receiver.metric_points("dask.activity.time"):
        if p.attributes.get("dask.task.prefix") == "double":
            by_series.setdefault(tuple(sorted(p.attributes.items())), []).append(p)
    again = [(earlier.value, p.exemplars) for points in by_series.values()
             for earlier, p in zip(points, points[1:]) if p.value == earlier.value]
    assert again and [exemplars for _, exemplars in again if exemplars] == [], again


def test_each_prefix_series_carries_an_exemplar_of_its_own_taskgroup_span(monkeypatch):
    """Two task prefixes growing in the same collections, in the same Dask span (one
    trace): each series' exemplar is a TaskGroup span of its own prefix, never the
    other's (one OTel Context is built per prefix and collection, and shared only by
    that prefix's series)"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **EXEMPLARS_ENV})
        with spilling_cluster(EXEMPLARS_CONFIG) as (cluster, client):
            run_twice(cluster, client, receiver, "both", inc, double)

            def by_prefix(r: OTLPReceiver) -> dict[str, set]:
                out: dict[str, set] = {}
                for p in r.metric_points("dask.activity.time"):
                    prefix = p.attributes.get("dask.task.prefix")
                    if prefix in ("inc", "double") and p.exemplars:
                        out.setdefault(prefix, set()).update(p.exemplars)
                return out

            receiver.wait_for(lambda r: len(by_prefix(r)) == 2, timeout=30)
            exemplars = by_prefix(receiver)
            receiver.wait_for(
                lambda r: all(pair in {(s.trace_id, s.span_id) for s in r.spans()}
                              for pairs in exemplars.values() for pair in pairs),
                timeout=30,
            )
            spans = {(s.trace_id, s.span_id): s.name for s in receiver.spans()}
    for prefix, pairs in exemplars.items():
        assert {spans[pair] for pair in pairs} == {f"taskgroup/{prefix}"}, (prefix, pairs)


def activity_series(r: OTLPReceiver, prefixes: set[str]) -> dict[tuple, list]:
    """The points of each ``dask.activity.*`` series of ``prefixes``, in time order"""
    out: dict[tuple, list] = {}
    for p in sorted(r.metric_points(), key=lambda p: p.time):
        if p.name.startswith("dask.activity.") and p.attributes.get("dask.task.prefix") in prefixes:
            out.setdefault((p.name, *sorted(p.attributes.items())), []).append(p)
    return out


def grew_without_exemplar(series: dict[tuple, list]) -> dict[tuple, list]:
    """The series with a point above the one before (its first: above 0) that
    carries no exemplar, with their (value, exemplars)"""
    return {key: [(p.value, p.exemplars) for p in points] for key, points in series.items()
            if any(p.value > (before.value if before else 0) and not p.exemplars
                   for before, p in zip([None, *points], points))}


def exemplar_pairs(series: dict[tuple, list]) -> set[tuple[str, str]]:
    return {pair for points in series.values() for p in points for pair in p.exemplars}


def test_every_series_that_grew_carries_an_exemplar_from_its_first_point(tmp_path):
    """In the shape users run (``dask scheduler``/``dask worker`` processes, OTLP to
    a receiver): a short workflow under one Dask span, a worker lost mid-task and
    the task retried on the other. Dask's heartbeats bring a TaskGroup's metrics
    while it runs, before its span is exported: every ``dask.activity.*`` series of
    a task prefix carries an exemplar on its first non-zero point and on each point
    where it grew, and every exemplar is of a span the receiver got"""
    prefixes = {"slow_inc", "total", "die_once"}
    with OTLPReceiver("grpc") as receiver, dask_processes(receiver.env()) as procs:
        with procs.client() as client:
            with span("nightly"):
                # 2.5-5 s of tasks: collections every 0.5 s while they run
                parts = client.map(slow_inc, range(10), delay=0.5)
                survivor = client.submit(die_once, str(tmp_path / "died"))
                assert client.submit(total, parts).result() == 55
                assert survivor.result()
            receiver.wait_for(lambda r: r.spans("nightly") and {
                f"taskgroup/{p}" for p in prefixes} <= {s.name for s in r.spans()}, timeout=30)
            # the workers' last heartbeats are in: two more collections after the spans
            exports = len({p.time for p in receiver.metric_points("dask.activity.time")})
            receiver.wait_for(lambda r: len({p.time for p in r.metric_points(
                "dask.activity.time")}) >= exports + 2, timeout=30)
            series = activity_series(receiver, prefixes)
            pairs = exemplar_pairs(series)
            # each names a span exported, or to be
            receiver.wait_for(lambda r: pairs <= {(s.trace_id, s.span_id) for s in r.spans()},
                              timeout=30)
    assert {dict(key[1:])["dask.task.prefix"] for key in series} == prefixes
    assert grew_without_exemplar(series) == {}


def test_a_batch_that_runs_nothing_names_no_exemplar(monkeypatch):
    """A graph that starts a new TaskGroup of prefix `lap` and requests a finished
    one of it again (as a dependency): the finished group's new batch runs nothing
    and is never exported, so it is no exemplar; each point where a `lap` series
    grows while the new group runs carries the new group's span"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **EXEMPLARS_ENV})
        with spilling_cluster(EXEMPLARS_CONFIG, n_workers=2) as (cluster, client):
            with span("first"):
                (done,) = client.map(slow_inc, [1], delay=0, key=[("lap-aaaaaaaa", 0)])
                done.result()
            receiver.wait_for(lambda r: r.spans("taskgroup/lap"), timeout=30)
            time.sleep(1)  # its last heartbeat is in, and collected
            started = time.time()
            with span("second") as second:
                wait(client.map(slow_inc, [done] * 4, delay=0.5,
                                key=[("lap-bbbbbbbb", i) for i in range(4)]))
            (new,) = receiver.wait_for(lambda r: [s for s in r.spans("taskgroup/lap")
                                                  if s.trace_id == second.replace("-", "")],
                                       timeout=30)
            time.sleep(1)
            series = activity_series(receiver, {"lap"})
    assert grew_without_exemplar(series) == {}
    assert exemplar_pairs({k: [p for p in v if p.time > started] for k, v in series.items()}
                          ) == {(new.trace_id, new.span_id)}
