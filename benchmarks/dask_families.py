"""Cost of one collection of Dask's own families (``otel.metrics.dask``) on an
in-process cluster of 2 and of 50 workers.

A: the bridge's family instruments (:mod:`dask_otel.scheduler.dask_families`,
:mod:`dask_otel.worker.dask_families`) of the scheduler and every worker,
attached to an in-memory metric reader of their own, collected: the callbacks
and the SDK's aggregation, what the reader's thread does per export.
B (without dask_otel): Dask's own Prometheus collectors of the same servers
(``SchedulerMetricCollector`` & co, one ``WorkerMetricCollector`` per worker),
their families built, as Prometheus scraping every endpoint would have them.
A and B alternate, ``--repeat`` times each; medians with min-max.

Usage::

    python -m benchmarks.dask_families                    # 2 and 50 workers
    python -m benchmarks.dask_families --workers 2 --repeat 5
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import dask
from distributed import Client, LocalCluster
from distributed.http.scheduler.prometheus.core import COLLECTORS
from distributed.http.worker.prometheus.core import WorkerMetricCollector
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from benchmarks.harness import median, print_machine, print_table, quiet_logs, spread
from dask_otel.scheduler.dask_families import SchedulerFamilies
from dask_otel.worker.dask_families import WorkerFamilies


def inc(x: int) -> int:
    return x + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 50])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)

    print("dask_otel: collection of Dask's own families (otel.metrics.dask)")
    print_machine()
    rows = []
    with quiet_logs(), dask.config.set({"distributed.scheduler.preload": []}):
        for n in args.workers:
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=False,
                              dashboard_address="127.0.0.1:0",
                              worker_dashboard_address="127.0.0.1:0") as cluster, \
                    Client(cluster) as client:
                # some task prefixes and states to report
                for prefix in range(20):
                    client.gather(client.map(inc, range(20), key=[f"p{prefix}-{i}" for i in range(20)]))
                reader = InMemoryMetricReader()
                provider = MeterProvider(metric_readers=[reader])
                own = SimpleNamespace(metric_attributes={},
                                      telemetry=SimpleNamespace(meter_provider=provider))
                attached = [SchedulerFamilies(cluster.scheduler, own)]
                attached += [WorkerFamilies(w, own) for w in cluster.workers.values()]
                dask_collectors = [c(cluster.scheduler) for c in COLLECTORS]
                dask_collectors += [WorkerMetricCollector(w) for w in cluster.workers.values()]

                def ours() -> int:
                    data = reader.get_metrics_data()
                    return sum(len(m.data.data_points) for rm in data.resource_metrics
                               for sm in rm.scope_metrics for m in sm.metrics)

                def dasks() -> int:
                    return sum(len(f.samples) for c in dask_collectors for f in c.collect())

                ours(), dasks()  # warm
                a, b = [], []
                for _ in range(args.repeat):
                    for fn, out in ((ours, a), (dasks, b)):
                        t0 = time.perf_counter()
                        points = fn()
                        out.append((time.perf_counter() - t0) * 1000)
                        if fn is ours:
                            n_points = points
                        else:
                            n_samples = points
                for x in attached:
                    x.close()
                provider.shutdown()
            rows.append([
                n, n_points, f"{median(a):.2f} ({spread(a, '{:.2f}')})",
                n_samples, f"{median(b):.2f} ({spread(b, '{:.2f}')})",
                f"{median(a) / median(b):.2f}",
            ])
    print(f"\n== one collection, median (min-max) of {args.repeat}, A/B alternating ==")
    print_table(["workers", "A points", "A: dask_otel ms", "B samples",
                 "B: Dask's collectors ms", "A/B"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
