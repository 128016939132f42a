"""Each worker's SpillBuffer as OpenTelemetry metrics (dask_otel.spill), read
through the bridge's InMemoryMetricReader on real in-process clusters."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
from dask.sizeof import sizeof
from distributed import wait
from distributed.spill import SpillBuffer

from dask_otel.spill import SpillInstruments
from tests.support.cluster import MEMORY_LIMIT, spilling_cluster
from tests.support.metrics import by_worker, collect, metric_reader, value
from tests.support.tasks import make_chunk, sum_chunks

pytestmark = pytest.mark.timeout(60)

LEVELS = (
    "dask.spill.memory.keys",
    "dask.spill.memory.size",
    "dask.spill.disk.keys",
    "dask.spill.disk.size",
    "dask.spill.disk.memory_size",
)


# --- distributed's SpillBuffer -------------------------------------------------------


def test_spilled_bytes_are_exported():
    with spilling_cluster() as (cluster, client):
        (worker,) = cluster.workers.values()
        assert isinstance(worker.data, SpillBuffer)
        chunks = client.map(make_chunk, range(6))  # 24 MB, target 10 MB
        wait(chunks)
        points = collect(metric_reader(cluster))

        spilled = worker.data.spilled_total
        assert spilled.disk > 0
        assert value(points, "dask.spill.disk.size") == spilled.disk
        assert value(points, "dask.spill.disk.memory_size") == spilled.memory
        assert value(points, "dask.spill.disk.keys") == len(worker.data.slow) > 0
        assert value(points, "dask.spill.memory.keys") == len(worker.data.fast)
        assert value(points, "dask.spill.memory.size") == worker.data.fast.total_weight
        assert value(points, "dask.spill.memory.size") <= MEMORY_LIMIT * 0.1


def test_disk_writes_increase_between_collections():
    with spilling_cluster() as (cluster, client):
        reader = metric_reader(cluster)
        first = client.map(make_chunk, range(6))
        wait(first)
        before = collect(reader)
        second = client.map(make_chunk, range(6, 12))
        wait(second)
        after = collect(reader)

        for name in ("dask.spill.count", "dask.spill.size", "dask.spill.time"):
            written = value(before, name, dask_activity_name="disk-write")
            assert written > 0, name
            assert value(after, name, dask_activity_name="disk-write") > written, name
        assert value(after, "dask.spill.time", dask_activity_name="serialize") > 0
        assert value(after, "dask.spill.disk.size") > value(before, "dask.spill.disk.size")


def test_unspilling_raises_disk_read():
    with spilling_cluster() as (cluster, client):
        reader = metric_reader(cluster)
        chunks = client.map(make_chunk, range(6))
        wait(chunks)
        before = collect(reader)
        assert value(before, "dask.spill.count", dask_activity_name="disk-read") == 0

        client.submit(sum_chunks, chunks).result()  # reads every chunk, spilled or not
        after = collect(reader)
        assert value(after, "dask.spill.count", dask_activity_name="disk-read") > 0
        assert value(after, "dask.spill.size", dask_activity_name="disk-read") > 0
        assert value(after, "dask.spill.time", dask_activity_name="deserialize") > 0
        assert value(after, "dask.spill.count", dask_activity_name="memory-read") > 0


def test_counters_are_cumulative_and_monotonic():
    with spilling_cluster() as (cluster, client):
        reader = metric_reader(cluster)
        chunks = client.map(make_chunk, range(6))
        wait(chunks)
        first = collect(reader)
        second = collect(reader)  # nothing happened in between
        for name in ("dask.spill.count", "dask.spill.size", "dask.spill.time"):
            assert [p.value for p in second[name]] == [p.value for p in first[name]]
            # one start time per series, kept across collections: a new start
            # time (a new process) is what marks a reset
            assert [p.start_time_unix_nano for p in second[name]] == [
                p.start_time_unix_nano for p in first[name]
            ]


def test_each_worker_reports_its_own_series():
    with spilling_cluster(n_workers=2) as (cluster, client):
        a, b = cluster.workers.values()
        on_a = client.map(make_chunk, range(6), workers=[a.address])
        on_b = client.map(make_chunk, range(10, 11), workers=[b.address])
        wait(on_a + on_b)
        points = collect(metric_reader(cluster))

        for name in LEVELS + ("dask.spill.count", "dask.memory.threshold"):
            assert set(by_worker(points, name)) == {a.address, b.address}, name
        names = {
            p.attributes["dask.worker.address"]: p.attributes["dask.worker.name"]
            for p in points["dask.spill.memory.keys"]
        }
        assert names == {a.address: str(a.name), b.address: str(b.name)}
        disk = by_worker(points, "dask.spill.disk.size")
        assert disk[a.address] == a.data.spilled_total.disk > 0
        assert disk[b.address] == 0
        assert by_worker(points, "dask.spill.memory.keys") == {a.address: 2, b.address: 1}


def test_closed_worker_reports_once_more_then_stops():
    with spilling_cluster(n_workers=2) as (cluster, client):
        reader = metric_reader(cluster)
        a, b = cluster.workers.values()
        chunks = client.map(make_chunk, range(6), workers=[b.address])
        wait(chunks)
        assert set(by_worker(collect(reader), "dask.spill.memory.keys")) == {
            a.address,
            b.address,
        }
        written = b.data.cumulative_metrics["disk-write", "count"]
        client.sync(b.close)
        # Its final values, in case nothing collected them since they last changed
        last = collect(reader)
        assert by_worker(last, "dask.spill.count")[b.address] >= written > 0
        # then nothing
        points = collect(reader)
        for name in LEVELS + ("dask.spill.count", "dask.memory.threshold"):
            assert set(by_worker(points, name)) == {a.address}, name
        provider = cluster.scheduler.plugins["dask-otel"].telemetry.meter_provider
        attached = SpillInstruments.of(provider).attached
        assert [w.attributes["dask.worker.address"] for w in attached] == [a.address]


def test_memory_thresholds_in_bytes():
    config = {
        "distributed.worker.memory.target": 0.6,
        "distributed.worker.memory.spill": 0.7,
        "distributed.worker.memory.pause": 0.8,
        "distributed.worker.memory.terminate": 0.95,
    }
    # A limit far above the test process' memory (Dask caps it to the host's),
    # so that the memory monitor does not act
    with spilling_cluster(config, memory_limit="64 GiB") as (cluster, client):
        (worker,) = cluster.workers.values()
        limit = worker.memory_manager.memory_limit
        points = collect(metric_reader(cluster))
        thresholds = {
            p.attributes["dask.threshold"]: p.value
            for p in points["dask.memory.threshold"]
        }
        # No nanny, so nothing enforces the terminate threshold: not reported
        assert thresholds == {
            "limit": limit,
            "target": int(limit * 0.6),
            "spill": int(limit * 0.7),
            "pause": int(limit * 0.8),
        }


def test_spilling_disabled_exports_levels(caplog):
    config = {"distributed.worker.memory.target": False}
    with caplog.at_level(logging.WARNING, logger="dask_otel"):
        with spilling_cluster(config) as (cluster, client):
            (worker,) = cluster.workers.values()
            assert type(worker.data) is dict
            chunks = client.map(make_chunk, range(3))
            wait(chunks)
            points = collect(metric_reader(cluster))
    assert value(points, "dask.spill.memory.keys") == 3
    assert value(points, "dask.spill.memory.size") == 3 * sizeof(make_chunk(0))
    for name in ("dask.spill.disk.keys", "dask.spill.disk.size", "dask.spill.disk.memory_size"):
        assert [p.value for p in points[name]] == [0], name
    assert "dask.spill.count" not in points
    assert not [r for r in caplog.records if r.name == "dask_otel"]


def test_a_broken_worker_is_skipped_and_the_others_still_report():
    with spilling_cluster(n_workers=2) as (cluster, client):
        a, b = cluster.workers.values()

        class Changing(Mapping):
            """cumulative_metrics being written to while it is read"""

            def __getitem__(self, key):
                raise KeyError(key)

            def __len__(self):
                return 1

            def __iter__(self):
                raise RuntimeError("dictionary changed size during iteration")

        a.data.cumulative_metrics = Changing()  # type: ignore[attr-defined]
        chunks = client.map(make_chunk, range(6), workers=[b.address])
        wait(chunks)
        points = collect(metric_reader(cluster))
        assert set(by_worker(points, "dask.spill.count")) == {b.address}
        # levels of the busy worker are still read
        assert set(by_worker(points, "dask.spill.memory.keys")) == {a.address, b.address}


# --- a third-party buffer (ManualEvictProto, as dask-cuda's ProxifyHostFile) ----------


class ThirdPartyBuffer(dict):
    """The least ManualEvictProto asks, as dask-cuda's ProxifyHostFile does it: a
    MutableMapping with ``evict()`` and a ``fast`` that is False when there is
    nothing to evict, else an object with ``evict()``: no ``slow``, no sizes"""

    class EvictDummy:
        @staticmethod
        def evict() -> tuple[None, None, int]:
            return None, None, -1

    @property
    def fast(self) -> Any:
        return self.EvictDummy() if self else False

    def evict(self) -> int:
        return -1


def test_third_party_buffer_exports_what_it_can(caplog):
    with caplog.at_level(logging.WARNING, logger="dask_otel"):
        with spilling_cluster(data=ThirdPartyBuffer) as (cluster, client):
            (worker,) = cluster.workers.values()
            assert isinstance(worker.data, ThirdPartyBuffer)
            chunks = client.map(make_chunk, range(2))
            wait(chunks)
            points = collect(metric_reader(cluster))
    # It cannot tell what is on disk, nor the size of what is in memory
    assert set(points) & set(LEVELS) == set()
    assert "dask.spill.count" not in points
    assert value(points, "dask.memory.threshold", dask_threshold="limit") == MEMORY_LIMIT
    assert not [r for r in caplog.records if r.name == "dask_otel"]
