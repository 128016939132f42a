"""The scheduler plugin's transition hook per call, with real tasks: what bounding
task times by the scheduler's clock (issue 18) costs the scheduler per task.

Dask calls ``SchedulerPlugin.transition`` for every transition of every task. The
hook now reads the clock when a task is sent (``processing``) and when the
scheduler hears back from it (it leaves ``processing``). This submits 1,000 tasks
to a cluster with no worker (they stay in the scheduler, their TaskGroup open in
the mirror), then calls the hook as Dask does, for those keys, for three kinds of
transition: one the hook ignores (``released -> waiting``), ``waiting ->
processing`` and ``processing -> memory``. Thread time per call, min and median of
``--rounds``, against a no-op ``SchedulerPlugin`` in the same process.

Before/after: run it once from the repository (the code under test) and once with
``PYTHONPATH`` pointing at another checkout; the module prints which
``dask_otel`` it measured.

    python -m benchmarks.transition_hook [--rounds 15] [--calls 200000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask
from distributed import Client, LocalCluster, span
from distributed.diagnostics.plugin import SchedulerPlugin

import dask_otel
from dask_otel.worker.plugin import PLUGIN_NAME

KINDS = (("released", "waiting"), ("waiting", "processing"), ("processing", "memory"))


def per_call(hook, keys: list, start: str, finish: str, calls: int) -> float:
    rounds = calls // len(keys)
    t0 = time.thread_time()
    for _ in range(rounds):
        for key in keys:
            hook(key, start, finish, stimulus_id="s")
    return (time.thread_time() - t0) / (rounds * len(keys))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    print(f"dask_otel from {dask_otel.__file__}")
    config = {"distributed.scheduler.preload": ["dask_otel"], "otel.traces.exporter": "memory",
              "otel.metrics.exporter": "none"}
    with dask.config.set(config), LocalCluster(
        n_workers=0, processes=False, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        with span("bench"):
            futures = client.map(lambda x: x, range(1000), key=[f"hook-{i}" for i in range(1000)])
        scheduler = cluster.scheduler
        plugin = scheduler.plugins[PLUGIN_NAME]
        deadline = time.monotonic() + 30
        # The graph is taken in on the scheduler's thread: wait for its group
        while not (plugin.mirror is not None and plugin.mirror.ledger.groups):
            assert time.monotonic() < deadline, "no open group"
            time.sleep(0.01)
        keys = [f.key for f in futures]
        noop = SchedulerPlugin().transition
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # alternated: the machine is shared
            for start, finish in KINDS:
                name = f"{start} -> {finish}"
                results.setdefault(f"noop {name}", []).append(
                    per_call(noop, keys, start, finish, args.calls))
                results.setdefault(f"hook {name}", []).append(
                    per_call(plugin.transition, keys, start, finish, args.calls))
        del futures
    print(f"{'transition':32} {'min ns':>8} {'median ns':>10} {'max ns':>8}")
    for name, values in results.items():
        print(f"{name:32} {min(values) * 1e9:8.0f} {statistics.median(values) * 1e9:10.0f} "
              f"{max(values) * 1e9:8.0f}")


if __name__ == "__main__":
    main()
