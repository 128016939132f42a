"""Dask's own metric families over OpenTelemetry (``otel.metrics.dask``,
:mod:`dask_otel.scheduler.dask_families`, :mod:`dask_otel.worker.dask_families`):
on a live cluster, what Dask serves on its /metrics and what the bridge exports,
through the Prometheus exporter and over OTLP, have the same names and labels.
The expected set is read from the live /metrics, not listed here: a family that
the installed distributed lacks is expected nowhere."""

from __future__ import annotations

import inspect
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from distributed import Semaphore
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dask_otel.export.instruments import prometheus_name
from dask_otel.scheduler.dask_families import SCHEDULER_FAMILIES, SchedulerFamilies
from dask_otel.worker.dask_families import WORKER_FAMILIES, WorkerFamilies
from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import make_chunk

pytestmark = pytest.mark.timeout(120)

DASK_PREFIXES = ("dask_scheduler_", "dask_semaphore_", "dask_stealing_", "dask_worker_")
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


def dask_scrape(port: int, prefixes: tuple[str, ...]) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode(), prefixes)


def served(port: int, prefixes: tuple[str, ...]) -> set[str]:
    """Sample names of every family Dask serves, also those with no series now
    (``dask_worker_tasks`` while the worker holds no task)"""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {
            f.name + "_total" if f.type == "counter" else f.name
            for f in families if f.name.startswith(prefixes)
        }


def shape(samples: Samples) -> dict[str, set[frozenset]]:
    """``{name: {label names of each series}}``"""
    out: dict[str, set[frozenset]] = {}
    for name, labels in samples:
        out.setdefault(name, set()).add(frozenset(k for k, _ in labels))
    return out


def assert_same(dask: Samples, ours: Samples) -> None:
    assert shape(ours) == shape(dask)
    assert set(ours) == set(dask)  # the same series (label values too)
    for key, value in dask.items():
        if not MOVING.search(key[0]):
            assert ours[key] == pytest.approx(value), key


def test_prometheus_names_and_labels_equal_dasks_own():
    """The bridge's instruments, on a MeterProvider of the project's Prometheus
    exporter (its own registry: Dask's default one serves Dask's families)"""
    registry = CollectorRegistry()
    accepted = inspect.signature(PrometheusMetricReader).parameters
    if "registry" not in accepted:  # it would register in Dask's registry
        pytest.skip("this opentelemetry-exporter-prometheus has no registry argument")
    options = {"disable_target_info": True, "scope_info_enabled": False, "registry": registry}
    reader = PrometheusMetricReader(**{k: v for k, v in options.items() if k in accepted})
    provider = MeterProvider(metric_readers=[reader])
    own = SimpleNamespace(metric_attributes={}, telemetry=SimpleNamespace(meter_provider=provider))
    try:
        with otel_cluster(processes=False, n_workers=1) as (client, mirrored):
            cluster = mirrored.cluster
            sem = Semaphore(max_leases=2, name="families")
            with sem:
                futures = client.map(make_chunk, range(4))
                client.gather(futures)
                worker = next(iter(cluster.workers.values()))
                attached = [SchedulerFamilies(cluster.scheduler, own), WorkerFamilies(worker, own)]
                scheduler_prefixes = DASK_PREFIXES[:3]
                # Idle cluster: nothing but clocks moves between the two reads
                dask_s = dask_scrape(cluster.scheduler.http_server.port, scheduler_prefixes)
                dask_w = dask_scrape(worker.http_server.port, ("dask_worker_",))
                ours_all = parse(generate_latest(registry).decode(), DASK_PREFIXES)
                for a in attached:
                    a.close()
    finally:
        provider.shutdown()
    ours_s = {k: v for k, v in ours_all.items() if k[0].startswith(scheduler_prefixes)}
    ours_w = {
        (name, frozenset(kv for kv in labels if kv != ("dask_worker_address", worker.address))): v
        for (name, labels), v in ours_all.items() if name.startswith("dask_worker_")
    }
    assert "dask_semaphore_active_leases" in shape(dask_s)
    assert "dask_stealing_request_count_total" in shape(dask_s)
    assert_same(dask_s, ours_s)
    assert_same(dask_w, ours_w)


def received_shape(receiver: OTLPReceiver, table: tuple) -> dict[str, set[frozenset]]:
    """The Prometheus names and label names of what arrived over OTLP, by the
    table's naming rule, checked against each point's kind and unit"""
    specs = {spec.name: spec for spec in table}
    out: dict[str, set[frozenset]] = {}
    for name, spec in specs.items():
        for p in receiver.metric_points(name):
            assert (p.kind, p.unit) == ("sum" if spec.kind == "counter" else "gauge", spec.unit)
            labels = frozenset(k.replace(".", "_") for k in p.attributes
                               if k != "dask.worker.address")
            out.setdefault(prometheus_name(spec), set()).add(labels)
    return out


@pytest.mark.timeout(120, method="signal")
def test_families_arrive_over_otlp_with_dasks_names(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_METRIC_EXPORT_INTERVAL": "500"})
        config = {"otel.metrics.exporter": "otlp", "otel.metrics.dask": True}
        with otel_cluster(config, processes=True, n_workers=2) as (client, mirrored):
            cluster = mirrored.cluster
            client.gather(client.map(make_chunk, range(4)))
            dask_s = shape(dask_scrape(cluster.scheduler.http_server.port, DASK_PREFIXES[:3]))
            ports = client.run(lambda dask_worker: dask_worker.http_server.port)
            dask_w: dict[str, set[frozenset]] = {}
            names = served(cluster.scheduler.http_server.port, DASK_PREFIXES[:3])
            for port in ports.values():
                names |= served(port, ("dask_worker_",))
                for name, labels in shape(dask_scrape(port, ("dask_worker_",))).items():
                    dask_w.setdefault(name, set()).update(labels)
            # Over OTLP the workers share their scheduler's resource: the
            # attribute tells them apart, where Prometheus has its instance label
            wait_until(
                lambda: set(received_shape(receiver, SCHEDULER_FAMILIES)) >= set(dask_s)
                and set(received_shape(receiver, WORKER_FAMILIES)) >= set(dask_w)
                and {p.attributes["dask.worker.address"]
                     for p in receiver.metric_points("dask.worker.threads")} == set(ports),
                timeout=30, what="every Dask family over OTLP, from each worker",
            )
    # Every name exported is one Dask serves; a family with no series at Dask's
    # scrape (no task held then) may have some later. Label names are Dask's.
    for ours, dasks in ((received_shape(receiver, SCHEDULER_FAMILIES), dask_s),
                        (received_shape(receiver, WORKER_FAMILIES), dask_w)):
        assert set(ours) <= names
        assert {n: labels for n, labels in ours.items() if n in dasks} == dasks


def test_families_are_off_by_default_and_with_the_prometheus_exporter():
    from dask_otel.export.instruments import families_wanted

    def own(**config: Any) -> Any:
        defaults = {"dask_families": False, "metrics_exporters": ("otlp",)}
        return SimpleNamespace(config=SimpleNamespace(**{**defaults, **config}))

    assert not families_wanted(own())
    assert families_wanted(own(dask_families=True))
    assert not families_wanted(own(dask_families=True, metrics_exporters=("otlp", "prometheus")))


def test_docs_table_matches_the_code():
    """docs/metrics.md's table of Dask's families lists each row's OTel name,
    kind, unit and Prometheus name, in the table's order"""
    doc = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    section = doc.split("## Dask's own families", 1)[1].split("\n## ", 1)[0]
    rows = [
        tuple(cell.strip().strip("`") for cell in line.strip("|").split("|"))[:4]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    expected = [
        (spec.name, spec.kind, spec.unit, prometheus_name(spec))
        for spec in SCHEDULER_FAMILIES + WORKER_FAMILIES
    ]
    assert rows == expected
