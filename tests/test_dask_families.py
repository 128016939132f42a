"""Dask's own metric families over OpenTelemetry (``otel.metrics.dask``,
:mod:`dask_otel.export.dask_families`): on a live cluster, what Dask serves on
its /metrics and what the bridge exports, through the Prometheus exporter and
over OTLP, have the same names, labels and values. The expected set is read from
the live /metrics, not listed here nor in the bridge: a family that the installed
distributed lacks is expected nowhere, one it adds is expected everywhere."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dask
import pytest
from distributed import Semaphore, wait
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import dask_otel
from dask_otel.export.dask_families import DaskFamilies
from dask_otel.scheduler.outcomes import WORKERS_REMOVED
from tests.support.cluster import otel_cluster, wait_until
from tests.support.deploy_checks import collector_prometheus_name
from tests.support.metrics import collect
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import inc, make_chunk

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(dask_otel.__file__).parent
DASK_PREFIXES = ("dask_scheduler_", "dask_semaphore_", "dask_stealing_", "dask_worker_")
OTEL_PREFIXES = tuple(p.replace("_", ".") for p in DASK_PREFIXES)
SCHEDULER_PREFIXES = DASK_PREFIXES[:3]
#: Dask's SpillBuffer families: the bridge's dask.spill.* instruments carry them
SPILL_FAMILIES = re.compile(r"dask_worker_spill_(bytes|count|time_seconds)_total")
#: Series whose value moves between two reads (clocks, process memory, GC)
MOVING = re.compile(r"tick|last_time|gc_collection|gil|latency|memory_bytes|median")

#: ``{(sample name, frozenset(labels.items())): value}``
Samples = dict[tuple[str, frozenset], float]


def parse(text: str, prefixes: tuple[str, ...]) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefixes) and not s.name.endswith("_created")
    }


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def dask_scrape(port: int, prefixes: tuple[str, ...]) -> Samples:
    return parse(scrape_text(port), prefixes)


def family_names(text: str, prefixes: tuple[str, ...]) -> set[str]:
    """Sample names of every family in an exposition, also those with no series
    now (``dask_worker_tasks`` while the worker holds no task)"""
    return {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text) if f.name.startswith(prefixes)
    }


def shape(samples: Samples) -> dict[str, set[frozenset]]:
    """``{name: {label names of each series}}``"""
    out: dict[str, set[frozenset]] = {}
    for name, labels in samples:
        out.setdefault(name, set()).add(frozenset(k for k, _ in labels))
    return out


def without_spill(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if not SPILL_FAMILIES.fullmatch(k[0])}


def assert_same(dask: Samples, ours: Samples) -> None:
    assert shape(ours) == shape(dask)
    assert set(ours) == set(dask)  # the same series (label values too)
    for key, value in dask.items():
        if not MOVING.search(key[0]):
            assert ours[key] == pytest.approx(value), key


def own_of(provider: MeterProvider) -> Any:
    return SimpleNamespace(metric_attributes={}, telemetry=SimpleNamespace(meter_provider=provider))


@dataclass
class Live:
    """One in-process cluster, scraped by Dask and collected by the bridge"""

    dask_s: Samples
    dask_w: Samples
    #: the sample names of every family Dask served, scheduler and worker
    served: set[str]
    #: what the bridge's instruments gave the Prometheus exporter
    ours: Samples
    #: the bridge's OpenTelemetry instruments (an in-memory reader's view):
    #: ``{name: (kind, unit)}``
    otel: dict[str, tuple[str, str]]
    worker_address: str


def translated(data: Any) -> Samples:
    """An in-memory reader's points as a Prometheus exporter names them (the
    collector's translation): for an exporter without a registry of its own"""
    out: Samples = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                monotonic = getattr(m.data, "is_monotonic", None)
                kind = "sum" if monotonic is not None else "gauge"
                name = collector_prometheus_name(m.name, m.unit, kind, monotonic)
                for p in m.data.data_points:
                    labels = frozenset(
                        (k.replace(".", "_"), str(v)) for k, v in p.attributes.items())
                    out[(name, labels)] = p.value
    return {k: v for k, v in out.items() if k[0].startswith(DASK_PREFIXES)}


@pytest.fixture(scope="module")
def live() -> Live:
    """The bridge's instruments, on a MeterProvider of the project's Prometheus
    exporter (its own registry: Dask's default one serves Dask's families), and
    of an in-memory reader"""
    registry = CollectorRegistry()
    accepted = inspect.signature(PrometheusMetricReader).parameters
    readers: list[Any] = [memory := InMemoryMetricReader()]
    if "registry" in accepted:  # else it would register in Dask's registry
        options = {"disable_target_info": True, "scope_info_enabled": False, "registry": registry}
        options = {k: v for k, v in options.items() if k in accepted}
        readers.append(PrometheusMetricReader(**options))
    provider = MeterProvider(metric_readers=readers)
    try:
        with otel_cluster(processes=False, n_workers=1) as (client, mirrored):
            cluster = mirrored.cluster
            sem = Semaphore(max_leases=2, name="families")
            with sem:
                futures = client.map(make_chunk, range(4))
                client.gather(futures)
                worker = next(iter(cluster.workers.values()))
                attached = [
                    DaskFamilies(cluster.scheduler, own_of(provider)),
                    DaskFamilies(worker, own_of(provider)),
                ]
                # Idle cluster: nothing but clocks moves between the two reads
                s_text = scrape_text(cluster.scheduler.http_server.port)
                w_text = scrape_text(worker.http_server.port)
                data = memory.get_metrics_data()
                if len(readers) > 1:
                    ours = parse(generate_latest(registry).decode(), DASK_PREFIXES)
                else:
                    ours = translated(data)
                otel = {
                    m.name: ("counter" if type(m.data).__name__ == "Sum" else "gauge", m.unit)
                    for rm in data.resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics if m.name.startswith(OTEL_PREFIXES)
                }
                for a in attached:
                    a.close()
    finally:
        provider.shutdown()
    return Live(
        dask_s=parse(s_text, SCHEDULER_PREFIXES),
        dask_w=parse(w_text, ("dask_worker_",)),
        served=family_names(s_text, SCHEDULER_PREFIXES) | family_names(w_text, ("dask_worker_",)),
        ours=ours,
        otel=otel,
        worker_address=worker.address,
    )


def test_prometheus_names_labels_and_values_equal_dasks_own(live):
    ours_s = {k: v for k, v in live.ours.items() if k[0].startswith(SCHEDULER_PREFIXES)}
    address = ("dask_worker_address", live.worker_address)
    ours_w = {
        (name, frozenset(kv for kv in labels if kv != address)): v
        for (name, labels), v in live.ours.items() if name.startswith("dask_worker_")
    }
    assert "dask_semaphore_active_leases" in shape(live.dask_s)
    assert "dask_stealing_request_count_total" in shape(live.dask_s)
    assert_same(live.dask_s, ours_s)
    assert_same(without_spill(live.dask_w), ours_w)


def test_every_family_dask_serves_is_exported_though_the_bridge_names_none(live):
    """The bridge follows Dask's collectors: each family Dask serves arrives (but
    the SpillBuffer's, see the next test), and no module of the bridge spells its
    name, as Dask or as OpenTelemetry names it: a family a new distributed adds
    arrives the same way"""
    served = {n for n in live.served if not SPILL_FAMILIES.fullmatch(n)}
    exported = {name for name, _ in live.ours}
    assert served == exported
    assert len(live.otel) == len(served) > 30
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    names = {n.removesuffix("_total") for n in served} | served | set(live.otel)
    spelled = {n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", source)}
    assert spelled == set()


def test_spill_counters_are_exported_once(live):
    """Dask serves its SpillBuffer counters as families of its own; with the
    families on, the bridge exports them once, as its dask.spill.* instruments"""
    spill = {n for n in live.served if SPILL_FAMILIES.fullmatch(n)}
    assert len(spill) == 3  # the exclusion below is not vacuous
    assert not spill & {name for name, _ in live.ours}
    assert not {n for n in live.otel if "spill" in n}


@contextlib.contextmanager
def families_of_one_worker(**config: Any) -> Iterator[tuple[Any, Any, InMemoryMetricReader, list]]:
    """An in-process cluster of one worker, whose scheduler's and worker's
    families are attached to an in-memory reader: (cluster, worker, reader,
    the attached handles)"""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        with dask.config.set(config), otel_cluster(processes=False, n_workers=1) as (_, mirrored):
            cluster = mirrored.cluster
            worker = next(iter(cluster.workers.values()))
            attached = [DaskFamilies(cluster.scheduler, own_of(provider)),
                        DaskFamilies(worker, own_of(provider))]
            yield cluster, worker, reader, attached
            for a in attached:
                a.close()
    finally:
        provider.shutdown()


def tick_maximum(samples: Samples, prefix: str) -> float:
    (value,) = [v for (name, _), v in samples.items()
                if name == f"{prefix}_tick_duration_maximum_seconds"]
    return value


def test_dask_scrapes_see_the_tick_maximum_a_bridge_collection_leaves():
    """Dask's collectors reset what they read of ``digests_max`` (the scheduler's
    clears it, the worker's pops the tick maximum): a collection of the bridge in
    between must leave Dask's next scrape what it would have seen without it"""
    with families_of_one_worker() as (cluster, worker, reader, _):
        for prefix, server in (("dask_scheduler", cluster.scheduler), ("dask_worker", worker)):
            port = server.http_server.port
            scrape_text(port)  # Dask's scrape starts a new maximum
            # Where Dask's collectors read the maximum (the servers record
            # their ticks under "tick-duration": distributed's own mismatch)
            server.digests_max["tick_duration"] = 3600.0
            kept = dict(server.digests_max)
            ours = collect(reader)[f"{prefix.replace('_', '.')}.tick_duration_maximum"]
            assert [p.value for p in ours] == [3600.0]
            # nothing cleared (a tick may raise a maximum meanwhile)
            assert set(kept) <= set(server.digests_max)
            assert server.digests_max["tick_duration"] == 3600.0
            assert tick_maximum(dask_scrape(port, (prefix,)), prefix) == 3600.0
            # Dask's own scrape did reset it (so the check above could fail)
            assert tick_maximum(dask_scrape(port, (prefix,)), prefix) < 3600.0


def test_a_bridge_collection_does_not_sample_the_system_monitor():
    """Dask's collectors call ``SystemMonitor.update()`` (from distributed
    2024.8), which adds a sample to the history the dashboard plots: the bridge's
    collections must not"""
    config = {"distributed.admin.system-monitor.interval": "1h"}
    with families_of_one_worker(**config) as (cluster, worker, reader, _):
        before = cluster.scheduler.monitor.count, worker.monitor.count
        for _ in range(3):
            assert "dask.worker.threads" in collect(reader)
        assert (cluster.scheduler.monitor.count, worker.monitor.count) == before


def test_a_closed_server_is_reported_once_more_then_forgotten():
    """As every instrument of the bridge: the collection after close() (usually
    the flush when the process's last server closes) still has its values"""
    with families_of_one_worker() as (_, _, reader, attached):
        assert {"dask.scheduler.workers", "dask.worker.threads"} <= set(collect(reader))
        for a in attached:
            a.close()
        assert {"dask.scheduler.workers", "dask.worker.threads"} <= set(collect(reader))
        assert not {n for n in collect(reader) if n.startswith(OTEL_PREFIXES)}


def received_shape(receiver: OTLPReceiver) -> dict[str, set[frozenset]]:
    """The Prometheus names (the collector's translation) and label names of the
    Dask families that arrived over OTLP (the bridge's own dask.worker.removed,
    counted by the scheduler, shares their prefix and is none of them)"""
    out: dict[str, set[frozenset]] = {}
    for p in receiver.metric_points():
        if p.name.startswith(OTEL_PREFIXES) and p.name != WORKERS_REMOVED:
            labels = frozenset(k.replace(".", "_") for k in p.attributes
                               if k != "dask.worker.address")
            name = collector_prometheus_name(p.name, p.unit, p.kind, p.monotonic)
            out.setdefault(name, set()).add(labels)
    return out


@pytest.mark.timeout(120, method="signal")
def test_families_arrive_over_otlp_with_dasks_names(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_METRIC_EXPORT_INTERVAL": "500"})
        config = {"otel.metrics.exporter": "otlp", "otel.metrics.dask": True}
        with otel_cluster(config, processes=True, n_workers=2) as (client, mirrored):
            cluster = mirrored.cluster
            client.gather(client.map(make_chunk, range(4)))
            dask_shape = shape(dask_scrape(cluster.scheduler.http_server.port, SCHEDULER_PREFIXES))
            ports = client.run(lambda dask_worker: dask_worker.http_server.port)
            names = family_names(scrape_text(cluster.scheduler.http_server.port),
                                 SCHEDULER_PREFIXES)
            for port in ports.values():
                names |= family_names(scrape_text(port), ("dask_worker_",))
                worker_shape = shape(without_spill(dask_scrape(port, ("dask_worker_",))))
                for name, labels in worker_shape.items():
                    dask_shape.setdefault(name, set()).update(labels)
            # Over OTLP the workers share their scheduler's resource: the
            # attribute tells them apart, where Prometheus has its instance label
            wait_until(
                lambda: set(received_shape(receiver)) >= set(dask_shape)
                and {p.attributes["dask.worker.address"]
                     for p in receiver.metric_points("dask.worker.threads")} == set(ports),
                timeout=30, what="every Dask family over OTLP, from each worker",
            )
    # Every name exported is one Dask serves; a family with no series at Dask's
    # scrape (no task held then) may have some later. Label names are Dask's.
    ours = received_shape(receiver)
    assert set(ours) <= names
    assert {n: labels for n, labels in ours.items() if n in dask_shape} == dask_shape
    # The SpillBuffer's counters arrive once: as the bridge's, not as Dask's
    assert {n for n in names if SPILL_FAMILIES.fullmatch(n)}
    assert not {n for n in ours if SPILL_FAMILIES.fullmatch(n)}
    assert receiver.metric_points("dask.spill.count")


#: Task prefixes of the next test: Dask serves four series of
#: dask_scheduler_prefix_state_totals_total for each (one per state), 3,200 in
#: all, past the 2,000 attribute sets opentelemetry-sdk 1.45.2 keeps per metric
#: stream unless told otherwise
MANY_PREFIXES = 800


def received_samples(points: list) -> Samples:
    """Points received over OTLP as the collector's Prometheus translation names
    them, as :func:`parse` keys Dask's exposition"""
    return {
        (collector_prometheus_name(p.name, p.unit, p.kind, p.monotonic),
         frozenset((k.replace(".", "_"), str(v)) for k, v in p.attributes.items())): p.value
        for p in points
    }


@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_every_series_dask_serves_arrives_over_otlp_past_the_sdks_default_limit(monkeypatch):
    """docs/metrics.md, "Series limits": Dask's /metrics has no limit, so neither
    have its families over OTLP. The scheduler's series of one export, collected
    between two identical scrapes of Dask's /metrics (an idle cluster), are the
    series of those scrapes: every one of the 3,200 prefix-state series, and no
    ``otel.metric.overflow`` point."""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_METRIC_EXPORT_INTERVAL": "1000"})
        config = {"otel.metrics.exporter": "otlp", "otel.metrics.dask": True}
        with otel_cluster(config, processes=True, n_workers=1) as (client, mirrored):
            wait([client.submit(inc, i, key=f"p{i}-0") for i in range(MANY_PREFIXES)])
            port = mirrored.cluster.scheduler.http_server.port

            def scheduler_collection_after(moment: float) -> list:
                """The points of the scheduler's first collection after ``moment``"""
                times = sorted({p.time for p in receiver.metric_points()
                                if p.name.startswith(OTEL_PREFIXES[:3]) and p.time > moment})
                return times and [p for p in receiver.metric_points()
                                  if p.time == times[0] and p.name.startswith(OTEL_PREFIXES[:3])]

            for _ in range(5):  # until nothing moved between the two scrapes
                before, moment = dask_scrape(port, SCHEDULER_PREFIXES), time.time()
                points = wait_until(lambda: scheduler_collection_after(moment), timeout=30,
                                    what="an export of the scheduler's families")
                after = dask_scrape(port, SCHEDULER_PREFIXES)
                if set(before) == set(after):
                    break
    assert set(before) == set(after)
    served_states = [k for k in before if k[0] == "dask_scheduler_prefix_state_totals_total"]
    assert len(served_states) >= 4 * MANY_PREFIXES
    assert not [p for p in points if "otel.metric.overflow" in p.attributes]
    ours = received_samples(points)
    assert set(ours) == set(before)
    for key, value in before.items():
        if not MOVING.search(key[0]) and after[key] == value:
            assert ours[key] == pytest.approx(value), key


def test_families_are_off_by_default():
    """The shipped default (otel.yaml, as a user's process reads it: no dask
    config of its own, no DASK_OTEL__* variable) does not export the families"""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DASK_", "OTEL_"))}
    env["DASK_CONFIG"] = str(Path(__file__).parent / "no-such-dask-config")
    code = (
        "from types import SimpleNamespace\n"
        "from dask_otel.config import read_config\n"
        "from dask_otel.export.dask_families import families_wanted\n"
        "config = read_config()\n"
        "print(config.dask_families, config.metrics_exporters,"
        " families_wanted(SimpleNamespace(config=config)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    # metrics are exported by default, so only the key keeps the families off
    assert out == ["False", "('otlp',)", "False"]


def test_families_are_on_when_asked_and_off_with_the_prometheus_exporter():
    from dask_otel.export.dask_families import families_wanted

    def own(**config: Any) -> Any:
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert families_wanted(own(dask_families=True, metrics_exporters=("otlp",)))
    assert not families_wanted(own(dask_families=False, metrics_exporters=("otlp",)))
    assert not families_wanted(own(dask_families=True, metrics_exporters=("otlp", "prometheus")))


def test_docs_table_matches_what_arrives(live):
    """docs/metrics.md's table of Dask's families gives each family's OTel name,
    kind, unit and Prometheus name; a row without a condition (its last column)
    is exported by every supported distributed"""
    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    section = doc.split("## Dask's own families", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    for name, (_, kind, unit, prometheus, when) in rows.items():
        monotonic = kind == "counter"
        assert prometheus == collector_prometheus_name(
            name, unit, "sum" if monotonic else "gauge", monotonic), name
        if name in live.otel:
            assert live.otel[name] == (kind, unit), name
        elif not when:
            raise AssertionError(f"{name} is documented unconditionally; not exported")
    assert set(live.otel) <= set(rows)
