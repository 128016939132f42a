"""Cost of one collection of Dask's own families (``otel.metrics.dask``) and of
the spill instruments, per exported series, on an in-process cluster of 2 and of
50 workers.

A: the bridge's family instruments (:mod:`dask_otel.export.dask_families`) of the
scheduler and every worker, attached to an in-memory metric reader of their own,
collected: the callbacks and the SDK's aggregation, what the reader's thread does
per export. S: the same for the spill instruments (:mod:`dask_otel.spill`) of every
worker. B (without dask_otel): Dask's own Prometheus collectors of the same
servers (``COLLECTORS``, one ``WorkerMetricCollector`` per worker), their
families built, as Prometheus scraping every endpoint would have them. A, S and B
alternate, ``--repeat`` times each; medians with min-max, of the collecting
thread's CPU time (what a loaded machine disturbs least) and of wall time.

``--before DIR`` runs the same measurement, in fresh processes, alternately on
the dask_otel of DIR (a worktree of an older commit) and on this one,
``--rounds`` times each: every sample of a side pooled, medians with spread.

Usage::

    python -m benchmarks.dask_families                    # 2 and 50 workers
    python -m benchmarks.dask_families --workers 2 --repeat 5
    python -m benchmarks.dask_families --before /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent.parent


def inc(x: int) -> int:
    return x + 1


def measure(workers: list[int], repeat: int) -> dict[str, dict[str, list[float]]]:
    """``{workers: {"A"|"S"|"B": [wall ms], "A cpu"|...: [thread CPU ms],
    "A points"|...: [n]}}`` on the dask_otel this process imports"""
    import dask
    from distributed import Client, LocalCluster
    from distributed.http.scheduler.prometheus.core import COLLECTORS
    from distributed.http.worker.prometheus.core import WorkerMetricCollector
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from benchmarks.harness import quiet_logs
    from dask_otel.export.dask_families import DaskFamilies
    from dask_otel.spill import ObservedWorker

    out: dict[str, dict[str, list[float]]] = {}
    with quiet_logs(), dask.config.set({"distributed.scheduler.preload": []}):
        for n in workers:
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=False,
                              dashboard_address="127.0.0.1:0",
                              worker_dashboard_address="127.0.0.1:0") as cluster, \
                    Client(cluster) as client:
                # some task prefixes and states to report
                for prefix in range(20):
                    client.gather(client.map(inc, range(20), key=[f"p{prefix}-{i}" for i in range(20)]))
                readers, owns = {}, {}
                for side in "AS":
                    readers[side] = InMemoryMetricReader()
                    owns[side] = SimpleNamespace(
                        metric_attributes={}, telemetry=SimpleNamespace(
                            meter_provider=MeterProvider(metric_readers=[readers[side]])))
                attached = [DaskFamilies(cluster.scheduler, owns["A"])]
                attached += [DaskFamilies(w, owns["A"]) for w in cluster.workers.values()]
                attached += [ObservedWorker(w, owns["S"]) for w in cluster.workers.values()]
                dask_collectors = [c(cluster.scheduler) for c in COLLECTORS]
                dask_collectors += [WorkerMetricCollector(w) for w in cluster.workers.values()]

                def points(side: str):
                    def collect() -> int:
                        data = readers[side].get_metrics_data()
                        return sum(len(m.data.data_points) for rm in data.resource_metrics
                                   for sm in rm.scope_metrics for m in sm.metrics
                                   if sm.scope.name == "dask_otel")
                    return collect

                def dasks() -> int:
                    return sum(len(f.samples) for c in dask_collectors for f in c.collect())

                fns = {"A": points("A"), "S": points("S"), "B": dasks}
                for fn in fns.values():
                    fn()  # warm
                row: dict[str, list[float]] = {}
                for _ in range(repeat):
                    for side, fn in fns.items():
                        t0, c0 = time.perf_counter(), time.thread_time()
                        count = fn()
                        c1, t1 = time.thread_time(), time.perf_counter()
                        row.setdefault(side, []).append((t1 - t0) * 1000)
                        row.setdefault(f"{side} cpu", []).append((c1 - c0) * 1000)
                        row.setdefault(f"{side} points", []).append(count)
                for x in attached:
                    x.close()
                for own in owns.values():
                    own.telemetry.meter_provider.shutdown()
            out[str(n)] = row
    return out


def cell(values: list[float], fmt: str = "{:.2f}") -> str:
    from benchmarks.harness import median, spread

    return f"{fmt.format(median(values))} ({spread(values, fmt)})"


def per_series(ms: list[float], points: list[float]) -> list[float]:
    return [t * 1000 / p for t, p in zip(ms, points) if p]


def report(results: dict[str, dict[str, list[float]]]) -> None:
    from benchmarks.harness import median, print_table

    for clock, suffix in (("thread CPU time", " cpu"), ("wall time", "")):
        print(f"-- {clock}")
        rows = []
        for n, row in results.items():
            a, s, b = (row[side + suffix] for side in "ASB")
            rows.append([
                n, int(median(row["A points"])), cell(a),
                cell(per_series(a, row["A points"]), "{:.1f}"),
                int(median(row["S points"])), cell(s),
                cell(per_series(s, row["S points"]), "{:.1f}"),
                int(median(row["B points"])), cell(b),
            ])
        print_table(["workers", "A points", "A: families ms", "A us/series", "S points",
                     "S: spill ms", "S us/series", "B samples", "B: Dask's collectors ms"],
                    rows)


def compare(before: Path, workers: list[int], repeat: int, rounds: int) -> None:
    """Alternate fresh processes on ``before``'s dask_otel and on this one"""
    pooled: dict[str, dict[str, dict[str, list[float]]]] = {"before": {}, "after": {}}
    for _ in range(rounds):
        for side, tree in (("before", before), ("after", HERE)):
            env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
            child = subprocess.run(
                [sys.executable, __file__, "--child", "--repeat", str(repeat),
                 "--workers", *map(str, workers)],
                env=env, check=True, capture_output=True, text=True, cwd=tree,
            )
            for n, row in json.loads(child.stdout.splitlines()[-1]).items():
                for key, values in row.items():
                    pooled[side].setdefault(n, {}).setdefault(key, []).extend(values)
    for side, tree in (("before", before), ("after", HERE)):
        commit = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
                                capture_output=True, text=True).stdout.strip()
        print(f"\n== {side}: {commit[:100]}; {rounds} processes x {repeat} collections ==")
        report(pooled[side])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 50])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--before", type=Path, help="a worktree of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(measure(args.workers, args.repeat)))
        return 0
    from benchmarks.harness import print_machine

    print("dask_otel: collection of Dask's own families (otel.metrics.dask) and spill instruments")
    print_machine()
    if args.before is not None:
        compare(args.before, args.workers, args.repeat, args.rounds)
        return 0
    print(f"\n== one collection, median (min-max) of {args.repeat}, A/S/B alternating ==")
    report(measure(args.workers, args.repeat))
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file by --before: import from the tree given
        sys.path[:1] = []
    sys.exit(main())
