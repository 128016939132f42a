"""What the bridge costs the scheduler's event loop: the longest block it causes,
and scheduler thread time per mirrored span.

Runs the workload of overhead.py (harness.Workload) on fresh LocalClusters with
worker processes, alternating without (A) and with (B) the bridge, exporting over
OTLP/gRPC to a receiver in another process. In B runs every entry point of the
bridge on the event loop is timed (``time.perf_counter`` for how long it blocked
the loop, ``time.thread_time`` for CPU):

- ``SpanMirror.poll`` (the periodic callback, every ``otel.spans.poll-interval``;
  a poll that stops at the mirror's time budget and goes on at the next turn of
  the loop counts as several calls), which calls ``span_of`` /
  ``group_span_of`` (since spans are built off the loop: reading a span's numbers
  for the builder thread; before, building the spans; ``mirror_span`` /
  ``mirror_group``, which also handed them to the SDK, before the "one house"
  layout: timed separately, nested);
- ``OtelSchedulerPlugin.update_graph`` (each graph submitted);
- ``OtelSchedulerPlugin.transition`` is called for every task transition. Wrapping
  it would cost more than it does, so it is timed apart: a loop of calls
  (non-erred transitions, the only kind in this workload) times the count of
  transitions in the run.

Garbage collections that happen to start inside a callback, on its thread, are
timed (``gc.callbacks``: wall and thread CPU) and reported apart: they are the
price of Dask's heap and land in whichever code allocates at the wrong moment. A
collection on another thread (the builder's, the client's) only keeps a callback
waiting: it is not subtracted.

The batch span processor's thread is not the event loop; its CPU is reported as
export cost per span (``CountingSpanExporter.export`` timed with thread_time).
Nor is the bridge's builder thread (``dask_otel-build``: attributes, events, links,
``ReadableSpan``, the span processors' ``on_end``), whose CPU (its thread clock) is
reported per span apart; both count in the bridge's share of the scheduler's CPU.

Also reported, A and B: the longest tick of the scheduler's own event-loop
health check (``distributed.admin.tick.interval``: 20 ms, so a 20 ms tick means no
block), which sees blocks by Dask itself too.

Targets: longest block by the bridge < 5 ms; scheduler thread time per mirrored
span below 25 us (a prior Dask tracing prototype's overhead per span).

Usage::

    python -m benchmarks.eventloop                 # 3 pairs of the overhead workload
    python -m benchmarks.eventloop --pairs 5 --tasks 20000 --spans 200
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from distributed import LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

from benchmarks.harness import (
    GCClock,
    PLUGIN_NAME,
    ReceiverProcess,
    Run,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    run_workload,
    spread,
    use_otel_env,
    verdict,
)

BLOCK_TARGET = 0.005
PER_SPAN_TARGET = 25e-6


class Call(NamedTuple):
    wall: float
    cpu: float
    #: seconds of garbage collection on the calling thread during the call: wall
    #: and CPU (a collection on another thread is not the callback's)
    gc: float
    gc_cpu: float
    #: what ``extra`` counted during the call
    extra: int


class Timed:
    """Replaces ``obj.name`` (looked up on the instance by its callers) with a
    wrapper that records a :class:`Call` per call"""

    def __init__(self, obj: Any, name: str, gc_clock: GCClock,
                 extra: Callable[[], int] | None = None):
        self.calls: list[Call] = []
        original = getattr(obj, name)
        calls = self.calls
        perf_counter, thread_time = time.perf_counter, time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            before = extra() if extra else 0
            ident = threading.get_ident()
            g0, gc0 = gc_clock.wall[ident], gc_clock.cpu[ident]
            w0, c0 = perf_counter(), thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                w1, c1 = perf_counter(), thread_time()
                calls.append(Call(w1 - w0, c1 - c0, gc_clock.wall[ident] - g0,
                                  gc_clock.cpu[ident] - gc0, (extra() - before) if extra else 0))

        setattr(obj, name, timed)

    @property
    def cpu(self) -> float:
        return sum(c.cpu for c in self.calls)

    @property
    def gc(self) -> float:
        return sum(c.gc for c in self.calls)

    @property
    def gc_cpu(self) -> float:
        return sum(c.gc_cpu for c in self.calls)

    @property
    def longest(self) -> Call:
        return max(self.calls, default=Call(0.0, 0.0, 0.0, 0.0, 0))


def transition_hook_cost(plugin: Any, n: int = 200_000) -> float:
    """Seconds per call of the plugin's transition hook for a non-erred
    transition, called as the scheduler calls it"""
    hook = plugin.transition
    t0 = time.thread_time()
    for _ in range(n):
        hook("x", "processing", "memory", stimulus_id="s")
    return (time.thread_time() - t0) / n


def _first(obj: object, *names: str) -> str:
    """The first of ``names`` that ``obj`` has: the same probe on both sides of a
    rename, for before/after figures"""
    return next(name for name in names if hasattr(obj, name))


class BuilderClock:
    """CPU seconds of the bridge's builder threads (``dask_otel-build``) since
    :meth:`reset`: a thread ends after ``IDLE_EXIT`` idle and the next spans start
    another, so each thread's CPU is added when it ends (wrapping
    ``SpanBuilder._run``), and a live one's is read from its clock. 0 before spans
    were built off the loop."""

    def __init__(self) -> None:
        self.ended = 0.0
        #: thread ident -> its CPU clock when it started or at reset
        self.started: dict[int, float] = {}
        try:
            from dask_otel.scheduler.builder import SpanBuilder
        except ImportError:
            return
        run, clock = SpanBuilder._run, self

        def timed_run(builder) -> None:
            ident = threading.get_ident()
            clock.started[ident] = time.thread_time()
            try:
                run(builder)
            finally:
                clock.ended += time.thread_time() - clock.started.pop(ident, 0.0)

        SpanBuilder._run = timed_run

    @staticmethod
    def _cpu(ident: int) -> float | None:
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, ProcessLookupError):  # it ended meanwhile
            return None

    def reset(self) -> None:
        self.ended = 0.0
        for ident in list(self.started):
            if (cpu := self._cpu(ident)) is not None:
                self.started[ident] = cpu

    def read(self) -> float:
        live = 0.0
        for ident, start in list(self.started.items()):
            if (cpu := self._cpu(ident)) is not None:
                live += cpu - start
        return self.ended + live


BUILDER_CLOCK = BuilderClock()


def bridge_probe(cluster: LocalCluster) -> Callable[[], dict]:
    scheduler = cluster.scheduler
    plugin = scheduler.plugins[PLUGIN_NAME]
    mirror = plugin.mirror
    gc_clock = GCClock()
    timers = {
        # spans a poll exported: handed to the builder thread (before it, to the SDK)
        "poll": Timed(mirror, "poll", gc_clock, extra=lambda: (
            mirror.builder.queued if getattr(mirror, "builder", None) else mirror.mirrored)),
        "update_graph": Timed(plugin, "update_graph", gc_clock),
        # Building the OTel spans (and, before the "one house" layout, handing
        # them to the SDK): span_of/group_span_of, formerly mirror_span/mirror_group
        "mirror_span": Timed(mirror, _first(mirror, "span_of", "mirror_span"), gc_clock),
        "mirror_group": Timed(
            mirror, _first(mirror, "group_span_of", "mirror_group"), gc_clock
        ),
    }
    telemetry = plugin.telemetry
    if hasattr(telemetry, "accounted_of"):  # one list of every signal's exporters
        accounted = telemetry.accounted_of("spans")
    else:  # before it: a list per signal; before the "one house" layout, export_stats
        accounted = getattr(telemetry, "accounted_span_exporters", None)
        if accounted is None:
            accounted = telemetry.export_stats
    exports = [Timed(stats, "export", gc_clock) for stats in accounted]
    transitions0 = scheduler.transition_counter
    mirrored0 = mirror.mirrored
    BUILDER_CLOCK.reset()

    def finish() -> dict:
        gc_clock.close()
        return {
            "timers": timers,
            "exports": exports,
            "transitions": scheduler.transition_counter - transitions0,
            "transition_hook": transition_hook_cost(plugin),
            "transition_noop": transition_hook_cost(SchedulerPlugin()),
            "mirrored": mirror.mirrored - mirrored0,
            "builder": BUILDER_CLOCK.read(),
        }

    return finish


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--spans", type=int, default=200)
    parser.add_argument("--outer", type=int, default=20)
    parser.add_argument("--prefixes", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--drain", type=float, default=8.0)
    args = parser.parse_args(argv)

    print("dask_otel event-loop and per-span cost benchmark")
    print_machine()
    workload = Workload(spans=args.spans, outer=args.outer, prefixes=args.prefixes,
                        tasks=args.tasks)
    print(f"\n== {workload.spans} spans, {workload.n_tasks} tasks, {workload.otel_spans} "
          f"OTel spans per run; {args.pairs} pairs, {args.workers} worker processes ==")
    pairs: list[tuple[Run, Run]] = []
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        for n in range(args.pairs):
            a = run_workload(workload, False, workers=args.workers, drain=args.drain,
                             receiver=receiver)
            b = run_workload(workload, True, workers=args.workers, drain=args.drain,
                             receiver=receiver, probe=bridge_probe)
            pairs.append((a, b))
            t = b.probe["timers"]
            poll = t["poll"].longest
            print(f"  pair {n + 1}: max tick A {a.max_tick * 1e3:.0f} ms, "
                  f"B {b.max_tick * 1e3:.0f} ms; longest poll {poll.wall * 1e3:.2f} ms "
                  f"({poll.extra} spans), longest update_graph hook "
                  f"{t['update_graph'].longest.wall * 1e3:.2f} ms; "
                  f"mirrored {b.probe['mirrored']}, received {b.received}", flush=True)

    rows = []
    per_span: dict[str, list[float]] = {k: [] for k in
                                        ("hooks", "graph", "polls", "mirror", "transition",
                                         "total", "total_no_gc", "builder", "export")}
    for _, b in pairs:
        p = b.probe
        t = p["timers"]
        mirrored = max(p["mirrored"], 1)
        hooks_cpu = t["poll"].cpu + t["update_graph"].cpu
        transition_cpu = p["transitions"] * p["transition_hook"]
        per_span["hooks"].append(hooks_cpu / mirrored)
        for key, hook in (("graph", "update_graph"), ("polls", "poll")):
            per_span[key].append((t[hook].cpu - t[hook].gc_cpu) / mirrored)
        per_span["mirror"].append((t["mirror_span"].cpu + t["mirror_group"].cpu) / mirrored)
        per_span["transition"].append(transition_cpu / mirrored)
        per_span["total"].append((hooks_cpu + transition_cpu) / mirrored)
        # A full collection of the scheduler's heap (~0.2 s, with or without the
        # bridge: see Dask's max tick) lands in whichever callback allocates last
        hooks_gc = t["poll"].gc_cpu + t["update_graph"].gc_cpu
        per_span["total_no_gc"].append((hooks_cpu - hooks_gc + transition_cpu) / mirrored)
        per_span["builder"].append(p["builder"] / mirrored)
        per_span["export"].append(sum(e.cpu for e in p["exports"]) / mirrored)

    def per_run(fn: Callable[[Run, Run], float], scale: float = 1e3) -> list[float]:
        return [fn(a, b) * scale for a, b in pairs]

    def calls(b: Run, *names: str) -> list[Call]:
        return [c for name in names for c in b.probe["timers"][name].calls]

    hooks = ("poll", "update_graph")
    polls = [c.wall for _, b in pairs for c in calls(b, "poll")]
    graphs = [c.wall for _, b in pairs for c in calls(b, "update_graph")]
    measures = [
        ("longest bridge callback, wall (ms)",
         per_run(lambda a, b: max(c.wall for c in calls(b, *hooks))), True),
        ("  the same without GC pauses inside it (ms)",
         per_run(lambda a, b: max(c.wall - c.gc for c in calls(b, *hooks))), True),
        ("longest bridge callback, CPU (ms)",
         per_run(lambda a, b: max(c.cpu for c in calls(b, *hooks))), True),
        ("  the same without GC pauses inside it (ms)",
         per_run(lambda a, b: max(c.cpu - c.gc_cpu for c in calls(b, *hooks))), True),
        ("longest poll, wall (ms)", per_run(lambda a, b: max(calls(b, "poll")).wall), False),
        ("  spans it exported", per_run(lambda a, b: max(calls(b, "poll")).extra, 1), False),
        ("  its CPU (ms; the rest it waited for a core)",
         per_run(lambda a, b: max(calls(b, "poll")).cpu), False),
        ("  GC pauses inside it (ms)", per_run(lambda a, b: max(calls(b, "poll")).gc), False),
        ("longest update_graph hook, wall (ms)",
         per_run(lambda a, b: max(calls(b, "update_graph")).wall), False),
        ("  its CPU (ms)", per_run(lambda a, b: max(calls(b, "update_graph")).cpu), False),
        ("  GC pauses inside it (ms)",
         per_run(lambda a, b: max(calls(b, "update_graph")).gc), False),
        ("scheduler max tick, A no bridge (ms)", per_run(lambda a, b: a.max_tick), False),
        ("scheduler max tick, B bridge (ms)", per_run(lambda a, b: b.max_tick), False),
    ]
    print(f"\n== event loop: longest block caused by the bridge (median of {len(pairs)} runs) ==")
    rows = [
        [label, f"{median(values):.2f}", spread(values, "{:.2f}"),
         "< 5" if target else "", verdict(median(values) < BLOCK_TARGET * 1e3) if target else ""]
        for label, values, target in measures
    ]
    print_table(["measure", "median", "spread", "target", ""], rows)
    print(f"  all polls: p50 {median(polls) * 1e3:.3f} ms, "
          f"p99 {_quantile(polls, 0.99) * 1e3:.2f} ms ({len(polls)} polls); "
          f"update_graph hook p50 {median(graphs) * 1e3:.3f} ms "
          f"({len(graphs)} graphs). Max tick: Dask's 20 ms health-check tick, blocks by Dask "
          f"itself included.")

    print(f"\n== scheduler thread time per mirrored OTel span (Dask span or TaskGroup), "
          f"median of {len(pairs)} runs ==")
    labels = {
        "hooks": "poll + update_graph hooks, measured",
        "graph": "  update_graph hook, without GC pauses",
        "polls": "  polls, without GC pauses",
        "mirror": "    of which span_of/group_span_of (reading; before: building)",
        "transition": "transition hook (calls x cost per call)",
        "total": "total on the scheduler thread",
        "total_no_gc": "  the same without GC pauses inside hooks",
        "builder": "builder thread: spans built, on_end (not the event loop)",
        "export": "export thread (not the event loop)",
    }
    rows = []
    for key, label in labels.items():
        values = [v * 1e6 for v in per_span[key]]
        target = key.startswith("total")
        rows.append([label, f"{median(values):.1f}", spread(values, "{:.1f}"),
                     "< 25" if target else "", verdict(median(values) < 25) if target else ""])
    print_table(["us per span", "median", "spread", "target", ""], rows)
    b0 = pairs[0][1].probe
    print(f"  ({b0['transitions']} transitions per run at "
          f"{b0['transition_hook'] * 1e9:.0f} ns per hook call; Dask calls the hook of every "
          f"plugin, and the SchedulerPlugin base class's no-op costs "
          f"{b0['transition_noop'] * 1e9:.0f} ns)")

    # The same cost as a share of the scheduler's CPU: a sharper estimate of
    # overhead.py's CPU ratio than A/B timing on a noisy machine
    shares, loop_shares, loop_shares_no_gc = [], [], []
    for a, b in pairs:
        p = b.probe
        t = p["timers"]
        loop_cpu = (t["poll"].cpu + t["update_graph"].cpu
                    + p["transitions"] * p["transition_hook"])
        bridge_cpu = loop_cpu + p["builder"] + sum(e.cpu for e in p["exports"])
        shares.append(bridge_cpu / a.scheduler_cpu)
        loop_shares.append(loop_cpu / a.scheduler_cpu)
        loop_shares_no_gc.append(
            (loop_cpu - t["poll"].gc_cpu - t["update_graph"].gc_cpu) / a.scheduler_cpu)
    print(f"\n  bridge CPU on the event loop per run, as a share of run A's scheduler CPU: "
          f"{median(loop_shares) * 100:.2f}% ({spread([x * 100 for x in loop_shares], '{:.2f}')}); "
          f"without the full collections that landed in a bridge callback (the heap's, "
          f"whoever allocates when one is due): {median(loop_shares_no_gc) * 100:.2f}% "
          f"({spread([x * 100 for x in loop_shares_no_gc], '{:.2f}')})")
    print(f"  bridge CPU in the scheduler process (event loop + builder and export threads) "
          f"per run, as a "
          f"share of run A's scheduler CPU: {median(shares) * 100:.1f}% "
          f"({spread([x * 100 for x in shares], '{:.1f}')}); i.e. an expected scheduler CPU "
          f"ratio of {1 + median(shares):.3f}")
    return 0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    sys.exit(main())
