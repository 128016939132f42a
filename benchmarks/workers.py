"""What the bridge costs the workers: worker-process CPU per task and workload wall
time, without (A) and with (B) the preload key, alternating on fresh clusters.

overhead.py measures the scheduler's process. On a small machine the workers share
its cores, so CPU the bridge spends in the workers (the in-task context, the
SDK's export threads, metric readers) lengthens the run, and with it the CPU the
scheduler spends per second of wall time on its periodic work. This script shows
that side: the sum over worker processes of ``time.process_time()`` during the
workload (read with ``Client.run``), per task.

Usage::

    python -m benchmarks.workers              # 3 pairs of the overhead workload
    python -m benchmarks.workers --pairs 5
"""

from __future__ import annotations

import argparse
import sys
import time

import dask
from distributed import Client, LocalCluster
from benchmarks.harness import (
    ReceiverProcess,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    spread,
    thread_cpu,
    thread_cpu_delta,
    use_otel_env,
)


def _cpu() -> tuple[float, dict[str, float]]:
    return time.process_time(), thread_cpu()


def one_run(
    workload: Workload, bridge: bool, workers: int
) -> tuple[float, float, dict[str, float]]:
    """(workload wall seconds, worker CPU seconds per task, worker CPU seconds by
    thread name, summed over the workers)"""
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
    threads: dict[str, float] = {}
    for w, (cpu0, threads0) in before.items():
        cpu1, threads1 = after[w]
        for name, cpu in thread_cpu_delta(threads0, threads1, cpu1 - cpu0).items():
            threads[name] = threads.get(name, 0.0) + cpu
    cpu = sum(after[w][0] - before[w][0] for w in before)
    return wall, cpu / workload.n_tasks, threads


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
    threads: list[tuple[dict[str, float], dict[str, float]]] = []
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        for n in range(args.pairs):
            wa, ca, ta = one_run(workload, False, args.workers)
            wb, cb, tb = one_run(workload, True, args.workers)
            rows.append((wa, wb, ca, cb))
            threads.append((ta, tb))
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
    names = sorted({name for a, b in threads for name in (*a, *b)})
    by_thread = []
    for name in names:
        diff = [b.get(name, 0.0) - a.get(name, 0.0) for a, b in threads]
        by_thread.append((-abs(median(diff)), [
            name, f"{median([a.get(name, 0.0) for a, _ in threads]):.2f}",
            f"{median([b.get(name, 0.0) for _, b in threads]):.2f}",
            f"{median(diff):+.2f}", f"{min(diff):+.2f}..{max(diff):+.2f}"]))
    print("\n  CPU by thread of the worker processes, summed over workers (s), largest B-A first")
    print_table(["thread", "A median", "B median", "B-A median", "B-A min..max"],
                [row for _, row in sorted(by_thread, key=lambda r: r[0])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
