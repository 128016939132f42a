"""What the bridge costs the workers: worker-process CPU per task and workload wall
time, without (A) and with (B) the preload key, alternating on fresh clusters.

overhead.py measures the scheduler's process. On a small machine the workers share
its cores, so CPU the bridge spends in the workers (the in-task context, the
SDK's export threads, metric readers) lengthens the run, and with it the CPU the
scheduler spends per second of wall time on its periodic work. This script shows
that side: the sum over worker processes of ``time.process_time()`` during the
workload (read with ``Client.run``), per task.

Usage::

    python benchmarks/workers.py              # 3 pairs of the overhead workload
    python benchmarks/workers.py --pairs 5
"""

from __future__ import annotations

import argparse
import sys
import time

import dask
from distributed import Client, LocalCluster

from harness import (
    ReceiverProcess,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    spread,
    use_otel_env,
)


def _cpu() -> float:
    return time.process_time()


def one_run(workload: Workload, bridge: bool, workers: int) -> tuple[float, float]:
    """(workload wall seconds, worker CPU seconds per task)"""
    config = {"distributed.scheduler.preload": ["dask_otel"] if bridge else []}
    with dask.config.set(config):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address="127.0.0.1:0")
    try:
        with Client(cluster.scheduler_address) as client:
            client.wait_for_workers(workers)
            client.run(lambda: None)  # connections up before the clock starts
            before = client.run(_cpu)
            t0 = time.perf_counter()
            workload.run(client)
            wall = time.perf_counter() - t0
            after = client.run(_cpu)
    finally:
        cluster.close()
    return wall, sum(after[w] - before[w] for w in before) / workload.n_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--spans", type=int, default=200)
    args = parser.parse_args(argv)

    print("dask_otel worker-side cost benchmark")
    print_machine()
    workload = Workload(spans=args.spans, outer=20, prefixes=5, tasks=args.tasks)
    rows: list[tuple[float, float, float, float]] = []
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        for n in range(args.pairs):
            wa, ca = one_run(workload, False, args.workers)
            wb, cb = one_run(workload, True, args.workers)
            rows.append((wa, wb, ca, cb))
            print(f"  pair {n + 1}: wall A {wa:.2f}s B {wb:.2f}s; worker CPU per task "
                  f"A {ca * 1e6:.0f} us B {cb * 1e6:.0f} us", flush=True)
    wall = [b / a for a, b, _, _ in rows]
    cpu = [b / a for _, _, a, b in rows]
    added = [(b - a) * 1e6 for _, _, a, b in rows]
    print(f"\n== median of {len(rows)} pairs ==")
    print_table(["measure", "median", "spread"], [
        ["workload wall, B/A", f"{median(wall):.3f}", spread(wall, "{:.3f}")],
        ["worker CPU per task, B/A", f"{median(cpu):.3f}", spread(cpu, "{:.3f}")],
        ["worker CPU per task, B - A (us)", f"{median(added):.0f}", spread(added, "{:.0f}")],
        ["worker CPU per task, A (us)", f"{median([r[2] * 1e6 for r in rows]):.0f}", ""],
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
