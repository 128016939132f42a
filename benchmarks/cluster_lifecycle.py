"""What the bridge costs a cluster's start and close, collector up (issue 18, 3a).

An in-process ``LocalCluster(n_workers=2, processes=False)`` is started and closed
``--cycles`` times per run, alternating A (no preload) and B (the preload key
``distributed.scheduler.preload: [dask_otel]``), with the OTLP/gRPC receiver
(tests/support/otlp_receiver.py, in its own process) up. The first
``--warmup`` cycles of each run are left out (imports, first connections); the
medians of the rest are compared. Nothing runs on the cluster: start is the
``LocalCluster(...)`` call, close is ``cluster.close()``.

Target: B - A <= 5 ms for start and for close.

Usage::

    python -m benchmarks.cluster_lifecycle                  # 15 cycles, median of the last 13
    python -m benchmarks.cluster_lifecycle --profile start  # cProfile of B's starts
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import dask
from distributed import LocalCluster

from benchmarks.harness import (
    ReceiverProcess,
    median,
    print_machine,
    print_table,
    quiet_logs,
    spread,
    use_otel_env,
    verdict,
)

TARGET_MS = 5.0


def cycle(bridge: bool, profiler: cProfile.Profile | None, what: str) -> tuple[float, float]:
    """Seconds to start and to close one cluster"""
    preload = ["dask_otel"] if bridge else []
    with dask.config.set({"distributed.scheduler.preload": preload}):
        if profiler is not None and what == "start":
            profiler.enable()
        t0 = time.perf_counter()
        cluster = LocalCluster(
            n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None
        )
        started = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
    if profiler is not None and what == "close":
        profiler.enable()
    t0 = time.perf_counter()
    cluster.close()
    closed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    return started, closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", choices=["start", "close"])
    args = parser.parse_args()
    print_machine()
    print(f"LocalCluster(n_workers=2, processes=False) x {args.cycles} per side, "
          f"A B alternating; medians of the last {args.cycles - args.warmup}\n")
    profiler = cProfile.Profile() if args.profile else None
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with ReceiverProcess() as receiver, quiet_logs():
        use_otel_env({**receiver.env, "OTEL_TRACES_EXPORTER": "otlp",
                      "OTEL_METRICS_EXPORTER": "otlp"})
        for _ in range(args.cycles):
            for bridge in (False, True):
                times[bridge].append(cycle(bridge, profiler if bridge else None, args.profile))
    rows = []
    for i, what in enumerate(("start", "close")):
        a = [t[i] * 1000 for t in times[False][args.warmup:]]
        b = [t[i] * 1000 for t in times[True][args.warmup:]]
        extra = median(b) - median(a)
        rows.append([what, f"{median(a):.1f}", spread(a, "{:.1f}"), f"{median(b):.1f}",
                     spread(b, "{:.1f}"), f"{extra:+.1f}",
                     verdict(extra <= TARGET_MS)])
    print_table(["ms", "A median", "A spread", "B median", "B spread", "B-A",
                 f"<= {TARGET_MS:g} ms"], rows)
    if profiler is not None:
        print(f"\ncProfile of B's {args.profile}s (cumulative, top 40):")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
