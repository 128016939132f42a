"""Real in-process clusters with the bridge switched on by the preload key, the
Dask configs the tests run them with, and reading back what they mirrored."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
from distributed import Client, LocalCluster

from tests.support import oracle

#: Dask config that switches the bridge on with spans kept in memory on the scheduler
#: and a short export delay, so that tests do not wait seconds per span
MEMORY_CONFIG = {
    "distributed.scheduler.preload": ["dask_otel"],
    "otel.traces.exporter": "memory",
    "otel.metrics.exporter": "none",
    "otel.spans.export-delay": "200ms",
    "otel.spans.poll-interval": "100ms",
}
#: The same cluster without the bridge, for ``dask_otel.instrument`` to switch it on
UNINSTRUMENTED_CONFIG = {**MEMORY_CONFIG, "distributed.scheduler.preload": []}
#: An in-process cluster with the bridge and an in-memory metric reader, whose
#: workers spill as soon as their data passes 10% of their memory limit. The
#: memory monitor's thresholds are off: with processes=False it would measure the
#: whole test process.
SPILL_CONFIG: dict[str, Any] = {
    "distributed.scheduler.preload": ["dask_otel"],
    "otel.metrics.exporter": "memory",
    "otel.traces.exporter": "none",
    "distributed.worker.memory.target": 0.1,
    "distributed.worker.memory.spill": False,
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}
#: memory_limit that goes with SPILL_CONFIG: workers keep 10 MB in memory
MEMORY_LIMIT = 100_000_000
#: What every test cluster is, unless the test says otherwise
CLUSTER_DEFAULTS: dict[str, Any] = {
    "n_workers": 2,
    "threads_per_worker": 1,
    "processes": False,
    "dashboard_address": "127.0.0.1:0",
}


def wait_until(predicate: Callable[[], Any], timeout: float = 20, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``"""
    deadline = time.monotonic() + timeout
    while True:
        if result := predicate():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.05)


def dask_span_ids(dask_id: str) -> tuple[int, int]:
    """(trace id, span id) of the OTel span mirroring the Dask span ``dask_id``
    (a UUID): the whole UUID as trace id of a root, its low 64 bits as span id"""
    n = int(dask_id.replace("-", ""), 16)
    return n, n & ((1 << 64) - 1)


class Mirrored:
    """What the bridge exported from one LocalCluster, read from its in-memory
    exporter on the scheduler (LocalCluster runs the scheduler in this process)"""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster

    @property
    def plugin(self) -> Any:
        """The bridge's scheduler plugin (KeyError before ``dask_otel.instrument``
        on a cluster started without the preload key)"""
        return self.cluster.scheduler.plugins["dask-otel"]

    @property
    def in_memory(self) -> bool:
        """Whether spans went to the in-memory exporter (and so can be read)"""
        plugin = self.cluster.scheduler.plugins.get("dask-otel")
        telemetry = getattr(plugin, "telemetry", None)
        return telemetry is not None and [
            type(e).__name__ for e in telemetry.span_exporters
        ] == ["InMemorySpanExporter"]

    def spans(self) -> list:
        (exporter,) = self.plugin.telemetry.span_exporters
        return list(exporter.get_finished_spans())

    def by_dask_id(self, dask_id: str, timeout: float = 20):
        """The OTel span mirroring the Dask span ``dask_id``, waiting for its export"""
        _, span_id = dask_span_ids(dask_id)

        def find():
            return next((s for s in self.spans() if s.context.span_id == span_id), None)

        return wait_until(find, timeout, f"the span of Dask span {dask_id}")

    def children(self, parent) -> list:
        return sorted(
            (s for s in self.spans() if s.parent and s.parent.span_id == parent.context.span_id),
            key=lambda s: (s.start_time, s.name),
        )


def cluster_kwargs(**overrides: Any) -> dict[str, Any]:
    """LocalCluster's arguments: :data:`CLUSTER_DEFAULTS` and ``overrides``; worker
    processes listen on 127.0.0.1"""
    kwargs = {**CLUSTER_DEFAULTS, **overrides}
    if kwargs["processes"]:
        kwargs.setdefault("host", "127.0.0.1")
    return kwargs


@contextlib.contextmanager
def otel_cluster(config: dict | None = None, **overrides: Any) -> Iterator[tuple[Client, Mirrored]]:
    """A LocalCluster with the bridge on (:data:`MEMORY_CONFIG` updated with
    ``config``); yields a client and what was mirrored. Once the cluster is
    closed (the open spans exported by the scheduler's close), Dask's own record
    is the oracle of everything it exported (:mod:`tests.support.oracle`)."""
    with dask.config.set({**MEMORY_CONFIG, **(config or {})}):
        with LocalCluster(**cluster_kwargs(**overrides)) as cluster, Client(cluster) as client:
            mirrored = Mirrored(cluster)
            yield client, mirrored
            before_close = oracle.metrics_before_close(cluster)
    oracle.in_process(cluster, before_close)


@contextlib.contextmanager
def spilling_cluster(
    config: dict | None = None, **overrides: Any
) -> Iterator[tuple[LocalCluster, Client]]:
    """An in-process cluster of one worker with :data:`SPILL_CONFIG` (updated with
    ``config``) and :data:`MEMORY_LIMIT`; yields the cluster and a client"""
    overrides = {"n_workers": 1, "memory_limit": MEMORY_LIMIT, **overrides}
    with otel_cluster({**SPILL_CONFIG, **(config or {})}, **overrides) as (client, mirrored):
        yield mirrored.cluster, client


def seconds_to_close(
    config: dict, workload: Callable[[Client], Any], settle: float, **overrides: Any
) -> float:
    """Start a LocalCluster under ``config`` (as it is: no :data:`MEMORY_CONFIG`),
    run ``workload``, wait ``settle`` seconds (exports under way), then return the
    seconds that closing the client and the cluster takes"""
    with dask.config.set(config):
        cluster = LocalCluster(**cluster_kwargs(**overrides))
        client = Client(cluster)
        try:
            workload(client)
            time.sleep(settle)
        finally:
            start = time.monotonic()
            client.close()
            cluster.close()
    return time.monotonic() - start
