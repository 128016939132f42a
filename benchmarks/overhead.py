"""Overhead of the bridge: the same workload without (A) and with (B) the preload
key, alternating A B A B on fresh LocalClusters with worker processes.

Workload (harness.Workload): 200 Dask spans on two levels (20 roots run one after
the other, each with 9 children that run together), 5 task prefixes per span,
20,000 tasks; the bridge exports over OTLP/gRPC to a receiver in another process
(``--collector up``) or to a closed port on 127.0.0.1 (``--collector down``).
Only the workload is timed; cluster start and stop are not. After the workload,
both A and B wait ``--drain`` seconds, so that B's CPU includes mirroring and
exporting the spans that finished last.

Reported, as the median over pairs of the ratio B/A:

- wall time of the workload (target <= 1.02);
- scheduler CPU (this process minus the client's threads, see harness.py) over
  workload + drain (target <= 1.03); also over the workload only, and the CPU of
  the scheduler's event loop thread.

Everything else (``OTEL_BSP_*``, ``otel.spans.*``, metric export interval) is left
at its default, as a user would run it. ``--metric-interval MS [MS ...]`` sets
``OTEL_METRIC_EXPORT_INTERVAL`` (``default``: unset, the SDK's 60 s) for A and B
alike and runs the pairs of each value interleaved (pair 1 of each, then pair 2
of each...), so that a slow period of a shared machine hits every value: one
table per value.

Usage::

    python -m benchmarks.overhead                      # 5 pairs, collector up and down
    python -m benchmarks.overhead --pairs 7 --collector up
    python -m benchmarks.overhead --tasks 2000 --spans 40 --outer 10 --pairs 2   # quick look
    python -m benchmarks.overhead --tasks 4000 --spans 40 --collector up \
        --metric-interval 1000 default           # the metric side: 1 s against 60 s
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.harness import (
    EXITED,
    ReceiverProcess,
    Run,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    ratio_rows,
    run_workload,
    unreachable_env,
    use_otel_env,
)

#: (Run attribute, label, target ratio)
MEASURES = [
    ("wall", "workload wall time (s)", 1.02),
    ("scheduler_cpu", "scheduler CPU, workload+drain (s)", 1.03),
    ("scheduler_cpu_workload", "scheduler CPU, workload only (s)", None),
    ("loop_cpu", "scheduler loop thread CPU (s)", None),
    ("client_cpu", "client CPU, subtracted (s)", None),
]


def describe(run: Run) -> str:
    what = "B (bridge)" if run.bridge else "A (no bridge)"
    out = (
        f"{what:<13} wall {run.wall:6.2f}s  sched CPU {run.scheduler_cpu:6.2f}s"
        f" (workload {run.scheduler_cpu_workload:6.2f}s, loop {run.loop_cpu:6.2f}s)"
        f"  client {run.client_cpu:5.2f}s  max tick {run.max_tick * 1000:5.0f}ms"
    )
    if run.bridge:
        out += f"  mirrored {run.mirrored}"
        if run.received is not None:
            out += f" received {run.received}"
    return out


def thread_rows(pairs: list[tuple[Run, Run]]) -> list[list[str]]:
    """CPU seconds by thread name: A and B medians, and the median of B - A over
    pairs, largest difference first. Threads the client runs are included (the
    main thread and the client's loop are subtracted from scheduler CPU)."""
    names = sorted({name for a, b in pairs for name in (*a.threads, *b.threads)})
    rows = []
    for name in names:
        a = [run.threads.get(name, 0.0) for run, _ in pairs]
        b = [run.threads.get(name, 0.0) for _, run in pairs]
        diff = [y - x for x, y in zip(a, b)]
        rows.append((median(diff), [name, f"{median(a):.2f}", f"{median(b):.2f}",
                                    f"{median(diff):+.2f}", f"{min(diff):+.2f}..{max(diff):+.2f}"]))
    rows.sort(key=lambda r: -abs(r[0]) if r[1][0] != EXITED else 0)
    return [row for _, row in rows]


INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"


def use_interval(interval: str) -> None:
    """``OTEL_METRIC_EXPORT_INTERVAL`` for the next clusters (read when the
    bridge builds its metric reader); ``default`` unsets it"""
    if interval == "default":
        os.environ.pop(INTERVAL, None)
    else:
        os.environ[INTERVAL] = interval


def measure(args: argparse.Namespace, collector: str) -> dict[str, dict[str, float]]:
    """Median ratios per metric interval (``{interval: {measure: ratio}}``)"""
    workload = Workload(spans=args.spans, outer=args.outer, prefixes=args.prefixes,
                        tasks=args.tasks)
    intervals = args.metric_interval or [os.environ.get(INTERVAL, "default")]
    receiver = ReceiverProcess() if collector == "up" else None
    by_interval: dict[str, list[tuple[Run, Run]]] = {i: [] for i in intervals}
    try:
        use_otel_env(receiver.env if receiver else unreachable_env())
        print(f"\n== collector {collector}: {workload.spans} spans, {workload.n_tasks} tasks, "
              f"{workload.otel_spans} OTel spans per run; {args.pairs} pairs "
              f"(+{args.warmup} warm-up), {args.workers} worker processes; "
              f"{INTERVAL}: {', '.join(intervals)} ==")
        for n in range(args.warmup + args.pairs):
            label = "warm-up" if n < args.warmup else f"pair {n - args.warmup + 1}"
            for interval in intervals:
                use_interval(interval)
                pair = []
                for bridge in (False, True):
                    run = run_workload(workload, bridge, workers=args.workers,
                                       drain=args.drain, receiver=receiver)
                    tag = f"{label} {interval}" if args.metric_interval else label
                    print(f"  {tag:<14} {describe(run)}", flush=True)
                    pair.append(run)
                if n >= args.warmup:
                    by_interval[interval].append((pair[0], pair[1]))
    finally:
        if receiver is not None:
            receiver.close()
    return {interval: report(workload, collector, pairs, interval if args.metric_interval else None)
            for interval, pairs in by_interval.items()}


def report(workload: Workload, collector: str, pairs: list[tuple[Run, Run]],
           interval: str | None) -> dict[str, float]:
    if interval is not None:
        print(f"\n  == {INTERVAL}={interval} ==")
    print(f"\n  collector {collector}: median of {len(pairs)} pairs")
    rows, medians = ratio_rows(pairs, MEASURES)
    print_table(["measure", "A median", "B median", "B/A median", "B/A min-max",
                 "target", ""], rows)
    print("\n  CPU by thread of the scheduler's process (s), largest B-A first")
    print_table(["thread", "A median", "B median", "B-A median", "B-A min..max"],
                thread_rows(pairs))
    ticks_a = median([a.max_tick * 1000 for a, _ in pairs])
    ticks_b = median([b.max_tick * 1000 for _, b in pairs])
    print(f"  longest event-loop tick (20 ms = no block), median over runs: "
          f"A {ticks_a:.0f} ms, B {ticks_b:.0f} ms")
    mirrored = [b.mirrored for _, b in pairs]
    print(f"  OTel spans mirrored per B run: {min(mirrored)}-{max(mirrored)} "
          f"(expected {workload.otel_spans})", end="")
    if collector == "up":
        received = [b.received or 0 for _, b in pairs]
        print(f"; received by the collector by the end of the drain: "
              f"{min(received)}-{max(received)}", end="")
    print()
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted pairs first")
    parser.add_argument("--spans", type=int, default=200)
    parser.add_argument("--outer", type=int, default=20, help="root spans")
    parser.add_argument("--prefixes", type=int, default=5, help="task prefixes per span")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--drain", type=float, default=8.0,
                        help="seconds waited after the workload, in A and B alike")
    parser.add_argument("--collector", choices=["up", "down", "both"], default="both")
    parser.add_argument("--metric-interval", nargs="+", metavar="MS",
                        help="OTEL_METRIC_EXPORT_INTERVAL values to interleave "
                             "('default': unset, 60 s)")
    args = parser.parse_args(argv)

    print("dask_otel overhead benchmark")
    print_machine()
    started = time.monotonic()
    results = {}
    with quiet_logs():
        for collector in (["up", "down"] if args.collector == "both" else [args.collector]):
            for interval, medians in measure(args, collector).items():
                results[collector, interval] = medians

    print("\n== summary (median B/A over pairs) ==")
    rows = [
        [collector, interval, f"{m['wall']:.3f}", "PASS" if m["wall"] <= 1.02 else "MISS",
         f"{m['scheduler_cpu']:.3f}", "PASS" if m["scheduler_cpu"] <= 1.03 else "MISS"]
        for (collector, interval), m in results.items()
    ]
    print_table(["collector", INTERVAL, "wall ratio", "<= 1.02", "sched CPU ratio", "<= 1.03"],
                rows)
    print(f"  total benchmark time {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
