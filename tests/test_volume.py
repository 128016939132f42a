"""Volume: what ``status()`` and the self-metrics say each signal sent (items:
spans, metric points, log records; bytes: the OTLP requests before compression),
checked against what a real receiver got from the scheduler's process, over real
sockets (docs/deploy.md, "Volume")."""

from __future__ import annotations

import logging
import os

import pytest
from distributed import span

import dask_otel
from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.test_accounting import FAST_EXPORT_ENV, OTLP_CONFIG, inc

#: The receiver's name of each signal -> the bridge's, and the request's resource list
SIGNALS = {"traces": ("spans", "resource_spans"), "metrics": ("metrics", "resource_metrics"),
           "logs": ("logs", "resource_logs")}


def _items(resource_part) -> int:
    """Spans, metric points or log records of one resource of a request"""
    total = 0
    for scope in getattr(resource_part, "scope_spans", None) or getattr(
            resource_part, "scope_metrics", None) or resource_part.scope_logs:
        if hasattr(scope, "spans"):
            total += len(scope.spans)
        elif hasattr(scope, "log_records"):
            total += len(scope.log_records)
        else:
            for metric in scope.metrics:
                total += len(getattr(metric, metric.WhichOneof("data")).data_points)
    return total


def received_from(receiver: OTLPReceiver, pid: int) -> dict[str, dict[str, int]]:
    """status()'s ``export`` as the receiver saw it, of the requests of process ``pid``"""
    out: dict[str, dict[str, int]] = {}
    for signal, request in receiver.raw_requests:
        name, field = SIGNALS[signal]
        parts = getattr(request, field)
        pids = {a.value.int_value for part in parts for a in part.resource.attributes
                if a.key == "process.pid"}
        if pids != {pid}:
            continue
        row = out.setdefault(name, {"items": 0, "size": 0, "dropped": 0, "failures": 0})
        row["items"] += sum(_items(part) for part in parts)
        row["size"] += request.ByteSize()
    return out


def sent_by(server: dict) -> dict[str, dict[str, int]]:
    """A server's status()["export"], without the signals it has not sent yet"""
    return {signal: row for signal, row in server["export"].items() if row and any(row.values())}


def published_by(receiver: OTLPReceiver, pid: int) -> dict[str, dict[str, int]]:
    """The latest ``dask.otel.export.*`` points the receiver got from process ``pid``,
    by signal, keyed as status()["export"] is"""
    out: dict[str, dict[str, int]] = {}
    for p in receiver.metric_points():
        if p.name.startswith("dask.otel.export.") and p.resource.get("process.pid") == pid:
            out.setdefault(p.attributes["dask.otel.signal"], {})[p.name.rpartition(".")[2]] = p.value
    return out


def test_each_worker_process_publishes_its_export_health(monkeypatch):
    """A worker process's task spans and metrics pass the same export accounting as
    the scheduler's: each worker process exports ``dask.otel.export.*`` of its own
    exporters, under its own resource, and they are what its status() says"""
    with OTLPReceiver("grpc") as receiver:
        for key in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(), **FAST_EXPORT_ENV}.items():
            monkeypatch.setenv(key, value)
        config = {**OTLP_CONFIG, "otel.tasks.spans": True, "otel.logs.exporter": "none"}
        with otel_cluster(config, processes=True, n_workers=2) as (client, mirrored):
            with span("tasks"):
                assert client.gather(client.map(inc, range(4), key=[f"t-{i}" for i in range(4)]))
            pids = client.run(os.getpid)

            def published():
                workers = dask_otel.status(client)["workers"]
                both = [(published_by(receiver, pid), workers[w]["export"])
                        for w, pid in pids.items()]
                # the four task spans, each exported by the worker that ran it
                return sum(status["spans"]["items"] for _, status in both) == 4 and all(
                    got.get("metrics", {}).get("items", 0) > 0
                    and got.get("spans", {}).get("items") == status["spans"]["items"]
                    and got["spans"].get("dropped") == 0 and status["logs"] is None
                    for got, status in both)

            wait_until(published, what="each worker process's export health")


@pytest.mark.parametrize("protocol,compression", [("grpc", None), ("http/protobuf", "gzip")])
def test_status_and_self_metrics_tell_what_each_signal_sent(protocol, compression, monkeypatch):
    """Spans, metric points and log records, and their bytes before compression:
    status() agrees with the receiver to the byte for the scheduler's process and
    each worker process (gzip on the wire changes nothing), and the scheduler's
    self-metrics report the same"""
    with OTLPReceiver(protocol) as receiver:
        for key in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(), **FAST_EXPORT_ENV}.items():
            monkeypatch.setenv(key, value)
        if compression:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression)
        config = {**OTLP_CONFIG, "otel.tasks.spans": True}
        with otel_cluster(config, processes=True, n_workers=2) as (client, mirrored):
            with span("counted"):
                client.submit(inc, 1, key="counted-1").result()
            logging.getLogger("an.application").warning("counted")
            pids = client.run(os.getpid)

            def agreed():
                status = dask_otel.status(client)
                sent = sent_by(status["scheduler"])
                got = received_from(receiver, os.getpid())
                # each worker process: its task spans (one ran the task), its metrics
                workers = [sent_by(status["workers"][w]) == received_from(receiver, pid)
                           for w, pid in pids.items()]
                task_spans = sum(sent_by(status["workers"][w]).get("spans", {}).get("items", 0)
                                 for w in pids)
                return (sent == got and set(got) == {"spans", "metrics", "logs"}
                        and all(workers) and task_spans == 1 and sent)

            wait_until(agreed, timeout=60, what="status() and the receiver agree")
            # No more spans: the next metric export reports their final count
            wait_until(lambda: mirrored.plugin.mirror.mirrored >= 2, what="the span mirrored")

            def reported():
                sent = dask_otel.status(client)["scheduler"]["export"]["spans"]
                points = {p.name: p.value for p in receiver.metric_points()
                          if p.name in ("dask.otel.export.items", "dask.otel.export.size")
                          and p.attributes.get("dask.otel.signal") == "spans"}
                # both spans exported (mirrored is counted as they are handed over)
                return sent["items"] >= 2 and points == {
                    "dask.otel.export.items": sent["items"],
                    "dask.otel.export.size": sent["size"]} and sent

            spans = wait_until(reported, what="the self-metrics report the spans sent")
    assert spans["size"] > 100 * spans["items"]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_refused_signal_counts_its_items_as_dropped_and_no_bytes(protocol, monkeypatch):
    """A collector that refuses logs: their records are ``failed``, with no items and
    no bytes sent, while the spans' and metrics' counts still match the receiver"""
    with OTLPReceiver(protocol) as receiver:
        receiver.refuse = {"logs"}
        for key in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP")]:
            monkeypatch.delenv(key)
        for key, value in {**receiver.env(), **FAST_EXPORT_ENV}.items():
            monkeypatch.setenv(key, value)
        with otel_cluster(OTLP_CONFIG) as (client, mirrored):
            with span("counted"):
                client.submit(inc, 1, key="counted-1").result()
            logging.getLogger("an.application").warning("refused")
            wait_until(lambda: receiver.rejected >= 1, what="logs refused")

            def agreed():
                sent = dask_otel.status(client)["scheduler"]["export"]
                got = received_from(receiver, os.getpid())
                logs = sent.pop("logs")
                return (sent == got and set(got) == {"spans", "metrics"}
                        and logs["dropped"] and logs)

            logs = wait_until(agreed, what="status() and the receiver agree")
    assert logs["items"] == 0 and logs["size"] == 0 and logs["dropped"] >= 1

