"""What watching for stalls costs when nothing stalls (dask_otel/stalls.py).

Two parts:

1. The overhead workload (harness.Workload) on fresh LocalClusters with worker
   processes, alternating without (A) and with (B) the preload key. In B the
   scheduler's watchdog thread (``dask_otel-stalls``, in this process) is found
   and its wakeups counted (``voluntary_ctxt_switches`` in
   ``/proc/self/task/<tid>/status``: each wait that ends is one) over workload and
   drain; in both, the collections of this process (``gc.get_stats``) and the CPU
   of the scheduler's event-loop thread.
2. On this process, no cluster: what the loop pays per tick, the bridge's tick
   callback of before this feature (a closure: clock, subtraction, comparison)
   against :meth:`LoopWatch.measure`, alternated; and per collection,
   ``gc.collect(0)`` with and without :meth:`LoopWatch.timed` in ``gc.callbacks``
   (it runs on whichever thread collects, the loop's too), alternated.

Usage::

    python -m benchmarks.stalls                  # 3 pairs, 4,000 tasks
    python -m benchmarks.stalls --pairs 5 --tasks 20000 --spans 200
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from time import monotonic

from benchmarks.harness import (
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    run_workload,
    spread,
)


def _switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise RuntimeError("no voluntary_ctxt_switches")


def _collections() -> int:
    return sum(s["collections"] for s in gc.get_stats())


def probe(cluster):
    """Wakeups of the watchdog (None without the bridge) and collections of this
    process, from now until the returned function is called"""
    watchdog = next((t for t in threading.enumerate() if t.name == "dask_otel-stalls"), None)
    wakes0 = _switches(watchdog.native_id) if watchdog is not None else None
    gc0, t0 = _collections(), time.perf_counter()

    def finish() -> dict:
        seconds = time.perf_counter() - t0
        wakes = _switches(watchdog.native_id) - wakes0 if watchdog is not None else None
        return {"seconds": seconds, "wakes": wakes, "collections": _collections() - gc0}

    return finish


def old_tick(limit: float = 3.0):
    """The bridge's tick callback before the watchdog (integ at fce8203)"""
    last = [monotonic()]

    def measure() -> None:
        now = monotonic()
        late, last[0] = now - last[0], now
        if late > limit:
            pass

    return measure


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e9


def micro(rounds: int, calls: int) -> list[list[str]]:
    from dask_otel.stalls import LoopWatch

    watch = LoopWatch.__new__(LoopWatch)  # its state, no loop, thread or gc entry
    watch.limit, watch.last, watch.stacks = 3.0, monotonic(), []
    watch.gc_began = watch.gc_ended = watch.gc_seconds = 0.0
    watch.thread = threading.get_ident()
    old = old_tick()
    ticks_a, ticks_b, gc_a, gc_b = [], [], [], []
    collect = gc.collect
    for _ in range(rounds):
        ticks_a.append(per_call(old, calls))
        ticks_b.append(per_call(watch.measure, calls))
        gc_a.append(per_call(lambda: collect(0), calls // 20))
        gc.callbacks.append(watch.timed)
        try:
            gc_b.append(per_call(lambda: collect(0), calls // 20))
        finally:
            gc.callbacks.remove(watch.timed)
    return [
        ["tick callback, ns per call", f"{median(ticks_a):.0f}", spread(ticks_a, "{:.0f}"),
         f"{median(ticks_b):.0f}", spread(ticks_b, "{:.0f}")],
        ["gc.collect(0), ns per collection", f"{median(gc_a):.0f}", spread(gc_a, "{:.0f}"),
         f"{median(gc_b):.0f}", spread(gc_b, "{:.0f}")],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--spans", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    print_machine()
    workload = Workload(spans=args.spans, outer=args.spans // 10, tasks=args.tasks)
    rows = []
    with quiet_logs():
        for pair in range(args.pairs + 1):  # the first pair warms up
            for bridge in (False, True):
                run = run_workload(workload, bridge, probe=probe)
                p = run.probe
                if pair:
                    rows.append([pair, "B" if bridge else "A", f"{p['seconds']:.1f}",
                                 "-" if p["wakes"] is None else p["wakes"],
                                 "-" if p["wakes"] is None else f"{p['wakes'] / p['seconds']:.2f}",
                                 f"{p['collections'] / p['seconds']:.1f}",
                                 f"{run.loop_cpu:.2f}", f"{run.max_tick * 1000:.0f}"])
    print(f"\nworkload: {workload.n_tasks} tasks, {workload.spans} Dask spans; "
          "distributed.admin.tick.limit as configured (default 3 s)")
    print_table(["pair", "run", "seconds", "watchdog wakes", "wakes/s",
                 "collections/s", "loop CPU s", "max tick ms"], rows)
    print(f"\nper call, {args.rounds} rounds alternating (A: before, B: with the watchdog)")
    print_table(["what", "A median", "A spread", "B median", "B spread"],
                micro(args.rounds, args.calls))


if __name__ == "__main__":
    main()
