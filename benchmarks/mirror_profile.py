"""Where the scheduler thread time of mirroring spans goes.

Runs the workload of overhead.py (harness.Workload) on a LocalCluster with worker
processes and the bridge, with ``otel.spans.export-delay: 1h`` so that nothing is
exported while it runs. Then, on the scheduler's event loop, with the export delay
set to 0, it calls ``SpanMirror.poll()`` until everything is exported. A span is
exported once, so the workload runs twice on the same cluster:

1. polled without a profiler, timed with ``time.thread_time``: the scheduler
   thread time per mirrored OTel span;
2. polled under cProfile: the time split by where the code lives
   (``dask_otel/``, ``distributed/``, ``opentelemetry/``, the rest), then the
   functions with the most time.

It uses only ``SpanMirror.poll``, ``.mirrored``, ``.config`` (and ``.builder.drain``
once spans are built off the loop), so it keeps
working while the mirror's internals change.

Usage::

    python -m benchmarks.mirror_profile            # the overhead.py workload
    python -m benchmarks.mirror_profile --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time
from collections import Counter
from typing import Any

import dask
from distributed import Client, LocalCluster

from benchmarks.harness import (
    PLUGIN_NAME,
    ReceiverProcess,
    Workload,
    print_machine,
    print_table,
    quiet_logs,
    run_on_loop,
    use_otel_env,
)

#: Where a function's code lives, by a piece of its file's path
OWNERS = (
    ("/dask_otel/", "dask_otel"),
    ("/distributed/", "distributed (Dask's span and TaskGroup properties)"),
    ("/opentelemetry/", "opentelemetry SDK"),
)


def poll_until_exported(mirror: Any, profile: cProfile.Profile | None) -> tuple[float, int]:
    """Poll (on the event loop) until nothing is left to export; (thread seconds,
    OTel spans exported)"""
    before = mirror.mirrored
    t0 = time.thread_time()
    if profile is not None:
        profile.enable()
    try:
        for _ in range(100_000):
            more = mirror.poll()
            if not more:
                break
    finally:
        if profile is not None:
            profile.disable()
    elapsed = time.thread_time() - t0
    if getattr(mirror, "builder", None) is not None:
        # Spans are built off the loop: counted once the builder thread is done
        mirror.builder.drain(60)
    return elapsed, mirror.mirrored - before


def owner(filename: str) -> str:
    for piece, name in OWNERS:
        if piece in filename:
            return name
    return "other (builtins, stdlib)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=200)
    parser.add_argument("--outer", type=int, default=20)
    parser.add_argument("--prefixes", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    print("dask_otel: where mirroring spans spends scheduler thread time")
    print_machine()
    workload = Workload(spans=args.spans, outer=args.outer, prefixes=args.prefixes,
                        tasks=args.tasks)
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        config = {"distributed.scheduler.preload": ["dask_otel"],
                  "otel.spans.export-delay": "1h"}
        with dask.config.set(config):
            cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                   host="127.0.0.1", dashboard_address="127.0.0.1:0")
        try:
            with Client(cluster.scheduler_address) as client:
                mirror = cluster.scheduler.plugins[PLUGIN_NAME].mirror
                delayed = mirror.config
                results = []
                profiler = cProfile.Profile()
                for profile in (None, profiler):
                    mirror.config = delayed
                    workload.run(client)
                    time.sleep(1.5)  # a heartbeat from every worker: fine metrics are in
                    mirror.config = dataclasses.replace(delayed, export_delay=0.0)
                    # Polls during the workload put each group off until its
                    # export delay (1h) had passed: look at every one again
                    groups = getattr(mirror, "ledger", mirror)
                    groups = getattr(groups, "groups", None) or getattr(groups, "open_groups", {})
                    for batch in groups.values():
                        batch.wake = 0.0
                    results.append(run_on_loop(
                        cluster, lambda p=profile: poll_until_exported(mirror, p)))
        finally:
            cluster.close()

    (seconds, n), (profiled_seconds, profiled_n) = results
    print(f"\n== polls exporting the workload's {n} OTel spans ({workload.spans} Dask spans "
          f"and their TaskGroups) ==")
    print(f"  {seconds * 1e3:.1f} ms of scheduler thread time: {seconds / n * 1e6:.1f} us "
          f"per span (no profiler)")
    print(f"  under cProfile: {profiled_seconds * 1e3:.1f} ms for {profiled_n} spans")

    stats = pstats.Stats(profiler)
    by_owner: Counter[str] = Counter()
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        by_owner[owner(filename)] += tottime
    total = sum(by_owner.values()) or 1.0
    print("\n== where the profiled time goes (own time of each function, by package) ==")
    print_table(["code in", "ms", "share", "us per span"], [
        [name, f"{t * 1e3:.1f}", f"{t / total:.0%}", f"{t / profiled_n * 1e6:.1f}"]
        for name, t in by_owner.most_common()
    ])
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
        print(f"\n== top {args.top} functions by {order} time ==")
        print(out.getvalue().split("\n", 4)[-1].rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
