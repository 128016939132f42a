"""The process's Telemetry and the Dask servers that share it: two clusters in one
process (a notebook, a test suite) each get their own identity and settings where
the providers allow it, and are told where they do not."""

from __future__ import annotations

import logging
import time

from distributed import span

import dask_otel
from tests.support.cluster import otel_cluster, wait_until
from tests.support.metrics import collect, metric_reader

ADDRESS = "dask.scheduler.address"


def inc(x):
    return x + 1


def exported_after(client, mirrored, name: str) -> tuple[float, object]:
    """Seconds from a one-task Dask span's result to its export, and its OTel span"""
    with span(name) as sid:
        client.submit(inc, 1, key=f"{name}-0").result()
    finished = time.monotonic()
    s = mirrored.by_dask_id(sid)
    return time.monotonic() - finished, s


def test_two_clusters_in_one_process_keep_their_own_address_and_export_delay(caplog):
    config = {"otel.metrics.exporter": "memory"}
    with caplog.at_level(logging.WARNING, logger="dask_otel"):
        with otel_cluster({**config, "otel.spans.export-delay": "200ms"}, n_workers=1) as (
            client_a, mirrored_a,
        ), otel_cluster({**config, "otel.spans.export-delay": "3s"}, n_workers=1) as (
            client_b, mirrored_b,
        ):
            a = mirrored_a.cluster.scheduler.address
            b = mirrored_b.cluster.scheduler.address
            (worker_b,) = (w.address for w in mirrored_b.cluster.workers.values())
            waited_a, span_a = exported_after(client_a, mirrored_a, "in a")
            waited_b, span_b = exported_after(client_b, mirrored_b, "in b")
            status_a, status_b = dask_otel.status(client_a), dask_otel.status(client_b)

            # A second scheduler's metrics carry its address: the MeterProvider's
            # resource names the first one
            reader = metric_reader(mirrored_a.cluster)
            points = wait_until(
                lambda: (p := collect(reader)) and len(p.get("dask.otel.span.mirrored", [])) == 2
                and p,
            )
    assert span_a.resource.attributes[ADDRESS] == a
    assert span_b.resource.attributes[ADDRESS] == b
    assert waited_a < 2, waited_a
    assert waited_b >= 3 - 0.2, waited_b

    mirrored = {p.attributes.get(ADDRESS): p.value for p in points["dask.otel.span.mirrored"]}
    assert set(mirrored) == {None, b} and all(v >= 1 for v in mirrored.values())
    spill_b = [p for p in points["dask.spill.memory.keys"]
               if p.attributes["dask.worker.address"] == worker_b]
    assert spill_b and all(p.attributes[ADDRESS] == b for p in spill_b)

    # What cannot be its own is said, once per scheduler, and in status()
    assert status_a["scheduler"]["shared_with"] is None
    assert status_b["scheduler"]["shared_with"] == a
    assert [w["shared_with"] for w in status_b["workers"].values()] == [a]
    warnings = [r.getMessage() for r in caplog.records if "shares this process" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert b in warnings[0] and a in warnings[0]


def test_a_second_cluster_is_told_which_of_its_settings_cannot_hold(caplog):
    with caplog.at_level(logging.WARNING, logger="dask_otel"):
        with otel_cluster(n_workers=1), otel_cluster(
            {"otel.flush-timeout": "1s", "otel.metrics.exporter": "memory"}, n_workers=1
        ) as (client, mirrored):
            waited, s = exported_after(client, mirrored, "second")
    (warning,) = [r.getMessage() for r in caplog.records if "shares this process" in r.getMessage()]
    assert "otel.flush-timeout" in warning and "otel.metrics.exporter" in warning
    assert "otel.spans.export-delay" not in warning  # its own: it holds
