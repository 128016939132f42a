"""Cost of one collection of the fine performance metrics, by number of task prefixes.

The three ``dask.activity.*`` instruments read ``Scheduler.cumulative_worker_metrics``
on the metric reader's thread, holding the GIL against the scheduler's event loop.
This benchmark fills a real scheduler's ``cumulative_worker_metrics`` with the keys
that ``execute`` produces for N task prefixes (the activities a worker reports for
a task: thread-cpu, thread-noncpu, executor, other, memory-read, disk-read,
disk-write, deserialize...), attaches the bridge's scheduler instruments to an
in-memory metric reader, and times ``collect()``: the bridge's callbacks and the
SDK's aggregation together, which is what the reader's thread does per export.

Reported per N: the median wall and CPU time of one collection over ``--repeat``
collections (with min-max), the peak of memory allocated during one (tracemalloc,
measured apart), and the number of points exported. By default nothing changes
between collections (the bridge hands the SDK its previous observations again);
with ``--grow`` one key of Dask's mapping grows before each, as a heartbeat's would,
so that every collection reads Dask's mapping again.

Usage::

    python -m benchmarks.fine_metrics                  # 100, 1,000, 10,000 prefixes
    python -m benchmarks.fine_metrics --prefixes 100 1000 --repeat 3
    python -m benchmarks.fine_metrics --grow           # a key changes before each collection
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

import dask
from distributed import LocalCluster
from opentelemetry.sdk.metrics import MetricsTimeoutError
from benchmarks.harness import median, print_machine, print_table, quiet_logs, spread

#: What a worker's context_meter reports for the tasks of one prefix, as
#: (activity, unit): the keys Dask 2026 sends with heartbeats for plain tasks
#: that read their inputs from memory and from disk
EXECUTE_ACTIVITIES = (
    ("thread-cpu", "seconds"),
    ("thread-noncpu", "seconds"),
    ("executor", "seconds"),
    ("other", "seconds"),
    ("memory-read", "count"),
    ("memory-read", "bytes"),
    ("disk-read", "count"),
    ("disk-read", "bytes"),
    ("disk-read", "seconds"),
    ("deserialize", "seconds"),
    ("decompress", "seconds"),
)


def fill(scheduler, prefixes: int) -> None:
    metrics = scheduler.cumulative_worker_metrics
    metrics.clear()
    for i in range(prefixes):
        for activity, unit in EXECUTE_ACTIVITIES:
            metrics["execute", f"prefix-{i}", activity, unit] = 1.0 + i


def collect(reader) -> int:
    data = reader.get_metrics_data()
    return sum(
        len(metric.data.data_points)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name.startswith("dask.activity.")
    )


def measure(reader, repeat: int, grow: dict | None = None
            ) -> tuple[list[float], list[float], float, int]:
    """``grow``: the mapping whose first key grows before each collection"""
    walls, cpus = [], []
    points = 0
    for _ in range(repeat):
        if grow is not None:
            grow[next(iter(grow))] += 1.0
        w0, c0 = time.perf_counter(), time.thread_time()
        points = collect(reader)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
    if grow is not None:
        grow[next(iter(grow))] += 1.0
    tracemalloc.start()
    collect(reader)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return walls, cpus, peak / 2**20, points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--grow", action="store_true",
                        help="a key of Dask's mapping grows before each collection")
    args = parser.parse_args(argv)

    print("dask_otel fine metrics collection benchmark")
    print_machine()
    rows = []
    config = {
        "distributed.scheduler.preload": ["dask_otel"],
        "otel.traces.exporter": "none",
        "otel.metrics.exporter": "memory",
    }
    with quiet_logs(), dask.config.set(config):
        with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster:
            plugin = cluster.scheduler.plugins["dask-otel"]
            (reader,) = plugin.telemetry.metric_readers
            for n in args.prefixes:
                fill(cluster.scheduler, n)
                try:
                    collect(reader)  # warm: instruments and aggregations exist
                    walls, cpus, peak, points = measure(
                        reader, args.repeat,
                        cluster.scheduler.cumulative_worker_metrics if args.grow else None)
                except MetricsTimeoutError as e:  # the reader's 10 s: nothing exported
                    rows.append([f"{n:,}", "", "", f"failed: {e}", "", ""])
                    continue
                rows.append([
                    f"{n:,}", f"{len(cluster.scheduler.cumulative_worker_metrics):,}",
                    f"{points:,}",
                    f"{median(walls) * 1000:.1f} ({spread([w * 1000 for w in walls], '{:.1f}')})",
                    f"{median(cpus) * 1000:.1f} ({spread([c * 1000 for c in cpus], '{:.1f}')})",
                    f"{peak:.1f}",
                ])
    print(f"\n== one collection, median of {args.repeat}"
          f"{', a key grown before each' if args.grow else ', nothing changed'} ==")
    print_table(["prefixes", "keys", "points", "wall ms", "CPU ms", "peak alloc MiB"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
