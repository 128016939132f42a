"""A capture of everything the bridge emits with every signal and feature on: a
``LocalCluster(processes=True)`` (workers under nannies, as users run it) exporting
traces, metrics and logs over OTLP to :class:`~tests.support.otlp_receiver.OTLPReceiver`,
with task spans, span code, the span label, Dask's families, Dask's events and a
user topic, workers that spill, a worker whose event loop a task blocks and a worker
killed by its task. What arrived, as names: :class:`Emitted` (tests/test_registry.py
checks it against the registry in model/)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dask
from distributed import Client, LocalCluster
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

import dask_otel
from tests.support.cluster import MEMORY_LIMIT, cluster_kwargs, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import (CHUNK_BYTES, exit_once, fail, hold_gil, inc, make_chunk,
                                 print_in_task, sum_chunks, warn_in_task)

#: Every signal and feature on; workers spill past 10% of :data:`MEMORY_LIMIT`
CONFIG: dict[str, Any] = {
    "distributed.scheduler.preload": ["dask_otel"],
    "distributed.scheduler.allowed-failures": 3,
    "distributed.worker.memory.target": 0.1,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    "otel.traces.exporter": "otlp",
    "otel.metrics.exporter": "otlp",
    "otel.logs.exporter": "otlp",
    "otel.spans.export-delay": "200ms",
    "otel.spans.poll-interval": "100ms",
    "otel.spans.metrics-timeout": "3s",
    "otel.spans.code": True,
    "otel.metrics.span-label": True,
    "otel.metrics.dask": True,
    "otel.tasks.spans": True,
    "otel.events.topics": "dask, inventory",
    "otel.flush-timeout": "5s",
}
#: Fast batches; worker processes (spawned by their nannies, which read the
#: environment) stall past a 1 s tick limit
ENV = {
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "OTEL_BLRP_SCHEDULE_DELAY": "200",
    "OTEL_METRIC_EXPORT_INTERVAL": "500",
    "DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": "1s",
}
#: How long a task holds its worker's GIL: past the tick limit
BLOCK = 2.5


@dataclass
class Emitted:
    """The names a capture holds, each with where it was seen"""

    #: instrumentation scope name -> its schema_url, per signal
    scopes: set[tuple[str, str, str]] = field(default_factory=set)
    #: span name -> attribute keys (span attributes, of all spans of that name)
    spans: dict[str, set[str]] = field(default_factory=dict)
    #: span event name -> attribute keys
    span_events: dict[str, set[str]] = field(default_factory=dict)
    #: (metric name, unit, kind, monotonic) -> attribute keys
    metrics: dict[tuple[str, str, str, bool | None], set[str]] = field(default_factory=dict)
    #: log record event_name ("" for plain log records) -> attribute keys
    logs: dict[str, set[str]] = field(default_factory=dict)
    #: attribute key -> the Python types of its values
    types: dict[str, set[str]] = field(default_factory=dict)
    #: resource attribute keys
    resource: set[str] = field(default_factory=set)
    #: attribute key -> its string values (the first 50)
    values: dict[str, set[str]] = field(default_factory=dict)


def _value_type(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = {_value_type(v) for v in value} or {"string"}
        return (inner.pop() if len(inner) == 1 else "mixed") + "[]"
    return {bool: "boolean", int: "int", float: "double", str: "string"}.get(type(value), "any")


def _attributes(emitted: Emitted, into: set[str], key_values: Any) -> None:
    from tests.support.otlp_receiver import decode_attributes

    for key, value in decode_attributes(key_values).items():
        into.add(key)
        emitted.types.setdefault(key, set()).add(_value_type(value))
        values = emitted.values.setdefault(key, set())
        if isinstance(value, str) and len(values) < 50:
            values.add(value)


def emitted(receiver: OTLPReceiver) -> Emitted:
    """The names in what ``receiver`` got, from its raw requests"""
    out = Emitted()
    for signal, request in receiver.raw_requests:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            for rs in request.resource_spans:
                _attributes(out, out.resource, rs.resource.attributes)
                for ss in rs.scope_spans:
                    out.scopes.add(("spans", ss.scope.name, ss.schema_url))
                    for span in ss.spans:
                        _attributes(out, out.spans.setdefault(span.name, set()), span.attributes)
                        for event in span.events:
                            _attributes(out, out.span_events.setdefault(event.name, set()),
                                        event.attributes)
        elif isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            for rm in request.resource_metrics:
                _attributes(out, out.resource, rm.resource.attributes)
                for sm in rm.scope_metrics:
                    out.scopes.add(("metrics", sm.scope.name, sm.schema_url))
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        data = getattr(metric, kind)
                        monotonic = data.is_monotonic if kind == "sum" else None
                        keys = out.metrics.setdefault((metric.name, metric.unit, kind, monotonic),
                                                      set())
                        for point in data.data_points:
                            _attributes(out, keys, point.attributes)
        elif isinstance(request, logs_service_pb2.ExportLogsServiceRequest):
            for rl in request.resource_logs:
                _attributes(out, out.resource, rl.resource.attributes)
                for sl in rl.scope_logs:
                    out.scopes.add(("logs", sl.scope.name, sl.schema_url))
                    for record in sl.log_records:
                        _attributes(out, out.logs.setdefault(record.event_name, set()),
                                    record.attributes)
    return out


def workload(client: Client, marker: str) -> None:
    """Tasks that run, err, print, warn, spill, block a worker's loop and kill a
    worker, in a named workflow; a user topic's event"""
    a, b = sorted(client.scheduler_info()["workers"])
    with dask_otel.span("registry", workflow=True), dask_otel.span("steps"):
        assert client.submit(inc, 1).result() == 2
        with contextlib.suppress(ValueError):
            client.submit(fail, 1).result()
        client.submit(print_in_task, 1).result()
        client.submit(warn_in_task, 2).result()
        chunks = client.map(make_chunk, range(4), workers=[a])
        assert client.submit(sum_chunks, chunks, workers=[a]).result() > 0
        assert client.submit(hold_gil, BLOCK, workers=[b]).result() == BLOCK
        held = client.submit(inc, 10, workers=[b])
        held.result()
        assert client.submit(exit_once, marker, 7, workers=[b],
                             allow_other_workers=True).result() == 7
        del chunks, held
    client.log_event("inventory", {"sku": "a1", "count": 3, "Stock-Level": 2})
    assert CHUNK_BYTES * 4 > 0.1 * MEMORY_LIMIT  # they spill


@contextlib.contextmanager
def captured(monkeypatch: Any, tmp_path: Any) -> Iterator[OTLPReceiver]:
    """The receiver, once the cluster ran :func:`workload` and closed (its flush
    sent the rest)"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with dask.config.set(CONFIG):
            kwargs = cluster_kwargs(processes=True, n_workers=2, memory_limit=MEMORY_LIMIT)
            with LocalCluster(**kwargs) as cluster, Client(cluster) as client:
                workload(client, os.fspath(tmp_path / "died"))
                wait_until(lambda: receiver.spans("registry"), timeout=120, what="the root")
                wait_until(lambda: [p for p in receiver.metric_points(
                    "dask.event_loop.blocked.duration")], timeout=60, what="a stall")
        yield receiver
