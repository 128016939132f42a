"""Prometheus pull mode (``otel.metrics.exporter: prometheus``): the bridge's
metrics on the ``/metrics`` endpoint Dask already serves on every scheduler and
worker, scraped by a real Prometheus (Debian's ``prometheus``) on 127.0.0.1."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any

import prometheus_client
import pytest
from distributed import Client, LocalCluster, wait
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from packaging.version import Version
from prometheus_client.parser import text_string_to_metric_families

from tests.support.backends import PrometheusServer, free_port
from tests.support.cluster import SPILL_CONFIG, otel_cluster, wait_until
from tests.support.tasks import make_chunk, sum_chunks

pytestmark = pytest.mark.timeout(90)

#: Worker processes under a nanny: 1 GB each, spilling past 20 MB. The nanny's
#: terminate threshold is far above what a worker uses here.
PULL_CONFIG = {
    **SPILL_CONFIG,
    "otel.metrics.exporter": "prometheus",
    "distributed.worker.memory.target": 0.02,
    "distributed.worker.memory.terminate": 0.95,
}
MEMORY_LIMIT = 1_000_000_000


@contextmanager
def pull_cluster(processes: bool = True, **kwargs: Any) -> Iterator[tuple[LocalCluster, Client]]:
    """Two workers (processes unless said) with PULL_CONFIG; yields the cluster and a client"""
    with otel_cluster(PULL_CONFIG, processes=processes, memory_limit=MEMORY_LIMIT,
                      **kwargs) as (client, mirrored):
        yield mirrored.cluster, client


def chunks_on_each_worker(client: Client, n: int, first_seed: int = 0) -> list[Any]:
    """``n`` chunks of 4 MB on every worker (futures, waited for)"""
    futures = []
    for i, address in enumerate(sorted(client.scheduler_info()["workers"])):
        seeds = range(first_seed + i * n, first_seed + (i + 1) * n)
        futures += client.map(make_chunk, seeds, workers=[address])
    wait(futures)
    return futures


def worker_ports(client: Client) -> dict[str, int]:
    """``{worker address: port of its /metrics}``: the worker's HTTP server"""
    return client.run(lambda dask_worker: dask_worker.http_server.port)


#: Prefixes of the bridge's Prometheus names (docs/metrics.md)
OURS = ("dask_spill_", "dask_memory_", "dask_activity_", "dask_otel_")


def scrape(port: int) -> dict[str, Any]:
    """``GET /metrics``, parsed: ``{family name: Metric}``"""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    families = list(text_string_to_metric_families(text))
    # Dask's own gauge dask_worker_transfer_incoming_count and counter
    # dask_worker_transfer_incoming_count_total share a family name; ours do not
    ours = [f.name for f in families if f.name.startswith(OURS)]
    assert len(ours) == len(set(ours)), "a metric family of the bridge appears twice"
    return {f.name: f for f in families}


def samples(families: dict[str, Any], family: str, **labels: str) -> list[Any]:
    return [
        s
        for s in families[family].samples
        if all(s.labels.get(k) == v for k, v in labels.items())
    ] if family in families else []


def served_in_this_process() -> set[str]:
    """The bridge's metric families that prometheus_client's default registry,
    which Dask's /metrics serves, holds in this process"""
    text = prometheus_client.generate_latest().decode()
    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith(OURS)}


def test_worker_metrics_are_served_on_each_workers_own_endpoint():
    with pull_cluster() as (cluster, client):
        chunks = chunks_on_each_worker(client, 6)  # 24 MB per worker, 20 MB target
        for address, port in worker_ports(client).items():
            families = scrape(port)
            # Dask's own metrics are still there
            assert "dask_worker_tasks" in families
            disk = samples(families, "dask_spill_disk_size_bytes")
            assert [s.labels["dask_worker_address"] for s in disk] == [address]
            assert disk[0].value > 0
            thresholds = {
                s.labels["dask_threshold"]: s.value
                for s in samples(families, "dask_memory_threshold_bytes")
            }
            assert thresholds == {
                "limit": MEMORY_LIMIT,
                "target": MEMORY_LIMIT * 0.02,
                "terminate": MEMORY_LIMIT * 0.95,  # a nanny enforces it
            }
            assert samples(families, "dask_spill_count", dask_activity_name="disk-write")


def test_scheduler_metrics_are_served_on_the_schedulers_endpoint():
    with pull_cluster() as (cluster, client):
        chunks = client.map(make_chunk, range(4))
        wait(chunks)
        port = cluster.scheduler.http_server.port
        families = wait_until(
            lambda: (f := scrape(port))
            and samples(f, "dask_activity_time_seconds", dask_task_prefix="make_chunk")
            and f,
            what="fine performance metrics on the scheduler's /metrics",
        )
        assert "dask_scheduler_workers" in families
        # Workers are other processes: their spill metrics are on their endpoints
        assert "dask_spill_memory_keys" not in families


def test_collector_is_unregistered_when_the_cluster_closes():
    assert served_in_this_process() == set()
    for _ in range(2):  # a second cluster in the same process works the same
        with pull_cluster(processes=False, n_workers=1) as (cluster, client):
            (reader,) = cluster.scheduler.plugins["dask-otel"].telemetry.metric_readers
            assert isinstance(reader, PrometheusMetricReader)
            chunks = client.map(make_chunk, range(2))
            wait(chunks)
            families = scrape(cluster.scheduler.http_server.port)
            assert len(samples(families, "dask_spill_memory_keys")) == 1
            assert "dask_spill_memory_keys" in served_in_this_process()
        assert served_in_this_process() == set()


def test_real_prometheus_stores_spill_metrics_per_worker():
    with pull_cluster() as (cluster, client):
        ports = worker_ports(client)
        targets = [(f"127.0.0.1:{port}", {"job": "dask-worker"}) for port in ports.values()]
        targets.append((f"127.0.0.1:{cluster.scheduler.http_server.port}", {"job": "dask-scheduler"}))
        with PrometheusServer(targets, scrape_interval="1s") as prom:
            prom.wait_for_targets_up()
            first = chunks_on_each_worker(client, 6)

            disk = prom.wait_for_query(
                "dask_spill_disk_size_bytes > 0", lambda r: len(r) == len(ports)
            )
            assert {r["metric"]["dask_worker_address"] for r in disk} == set(ports)
            # the series of a worker come from that worker's endpoint
            for r in disk:
                port = ports[r["metric"]["dask_worker_address"]]
                assert r["metric"]["instance"] == f"127.0.0.1:{port}"

            query = 'sum(dask_spill_count_total{dask_activity_name="disk-write"})'
            written = prom.values(prom.wait_for_query(query, lambda r: r and prom.values(r)[0] > 0))[0]
            second = chunks_on_each_worker(client, 3, first_seed=100)
            prom.wait_for_query(query, lambda r: prom.values(r)[0] > written)

            client.submit(sum_chunks, first).result()  # unspills
            prom.wait_for_query(
                'sum(dask_spill_size_bytes_total{dask_activity_name="disk-read"}) > 0'
            )
            prom.wait_for_query(
                'rate(dask_spill_size_bytes_total{dask_activity_name="disk-write"}[10s]) > 0'
            )
            thresholds = prom.query('dask_memory_threshold_bytes{dask_threshold="target"}')
            assert sorted(prom.values(thresholds)) == [MEMORY_LIMIT * 0.02] * len(ports)
            hit_ratio = prom.wait_for_query(
                'sum by (dask_worker_address) (dask_spill_count_total{dask_activity_name="memory-read"})'
                ' / sum by (dask_worker_address) '
                '(dask_spill_count_total{dask_activity_name=~"memory-read|disk-read"})'
            )
            # NaN for a worker that read nothing yet (0 / 0)
            ratios = [v for v in prom.values(hit_ratio) if not math.isnan(v)]
            assert ratios and all(0 <= v <= 1 for v in ratios)
            prom.wait_for_query(
                'dask_activity_time_seconds_total{job="dask-scheduler",'
                'dask_task_prefix="make_chunk",dask_activity_name="thread-cpu"} > 0'
            )


def test_worker_restart_reads_as_a_counter_reset():
    # Fixed ports: the restarted worker serves the same series at the same target
    worker_port, dashboard_port = free_port(), free_port()
    with pull_cluster(
        n_workers=1,
        worker_port=worker_port,
        worker_dashboard_address=f"127.0.0.1:{dashboard_port}",
    ) as (cluster, client):
        with PrometheusServer([f"127.0.0.1:{dashboard_port}"], scrape_interval="1s") as prom:
            chunks = chunks_on_each_worker(client, 6)
            written = 'dask_spill_count_total{dask_activity_name="disk-write"}'
            prom.wait_for_query(f"{written} > 0")
            del chunks
            client.restart()
            # The same series drops to 0: Prometheus counts a reset, and rate()
            # and increase() stay positive
            prom.wait_for_query(f"resets({written}[1m]) >= 1", timeout=30)
            (series,) = prom.query(written)
            assert series["metric"]["dask_worker_address"] == f"tcp://127.0.0.1:{worker_port}"
            assert float(series["value"][1]) == 0
            assert all(v >= 0 for v in prom.values(prom.query(f"increase({written}[1m])")))


def ours_only(text: str) -> str:
    """The families of an exposition that the bridge's reader serves (their samples
    carry ``otel_scope_name="dask_otel"``), and ``target_info``"""
    families: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("# HELP") or not families:
            families.append([])
        families[-1].append(line)
    return "".join(
        "\n".join(lines) + "\n" for lines in families
        if any('otel_scope_name="dask_otel"' in line for line in lines)
        or any(line.startswith("target_info") for line in lines)
    )


@pytest.mark.skipif(
    Version(version("opentelemetry-exporter-prometheus")) < Version("0.64b0"),
    reason="opentelemetry-exporter-prometheus < 0.64b0 adds no otel_scope_name label: the "
           "bridge's families cannot be told from Dask's own in a scrape")
def test_promtool_check_metrics_is_clean_on_the_bridges_pull_output():
    """``promtool check metrics`` (Prometheus' linter: no `_count`, `_sum` or `_bucket`
    suffix but on histograms, `_total` on counters only, base units, help text) finds
    nothing in what the bridge serves on a worker's and the scheduler's /metrics after
    a workflow that spilled"""
    import subprocess

    import dask_otel
    from tests.support.backends import require_binary

    promtool = require_binary("promtool")
    with pull_cluster() as (cluster, client):
        with dask_otel.span("lint", workflow=True):
            chunks = chunks_on_each_worker(client, 6)
            client.submit(sum_chunks, chunks).result()
        ports = [*worker_ports(client).values(), cluster.scheduler.http_server.port]
        wait_until(lambda: "dask_workflow_runs" in scrape(ports[-1]), timeout=60,
                   what="the workflow's run on the scheduler's /metrics")
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = ours_only(r.read().decode())
            assert "dask_spill_" in text or "dask_workflow_runs_total" in text
            proc = subprocess.run([promtool, "check", "metrics"], input=text,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stdout + proc.stderr
