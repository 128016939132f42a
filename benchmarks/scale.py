"""Does the bridge's cost stay flat as completed Dask spans pile up?

Dask keeps every span forever; the bridge must not. On an in-process LocalCluster
(``processes=False``, so that the test can reach the scheduler's objects) with the
preload key, exporting over OTLP/gRPC to a receiver in another process, this
creates 10,000 Dask spans of one task each (so 20,000 OTel spans: the Dask span
and its TaskGroup), in two shapes:

``roots``
    10,000 root spans, one after the other.
``children``
    10,000 sub-spans of one root span that stays open (a pipeline wrapped in
    ``with span("pipeline")``): while the next step runs, the root is not done.
    A step whose task can never run (it asks for a resource no worker has) is
    kept last, so that Dask's ``Span.done`` of the root has to look at every
    finished step before it finds the unfinished one, as it does for a real
    pipeline whose current step is its newest.
``tenants``
    What a cluster shared by many users looks like: ``--open`` (1,000) root spans
    stay open throughout (long-running workflows, each waiting on a task that
    cannot run), while the 10,000 one-task root spans come and go.

For each shape it reports:

- the cost of one ``SpanMirror.poll()`` with nothing to export, after 10 and after
  10,000 completed spans (median of ``--polls`` calls on the event loop; PASS if
  the second is no more than 1.10 x the first or 1 us more, the margin being
  timer noise);
- the bridge's retained memory: ``tracemalloc`` is started after the first 10
  spans; at 1,000 spans and at three more points up to 10,000, once the bridge
  has mirrored everything and the collector has received it (so the SDK's queue
  is empty), what is still allocated from a traceback that goes through
  ``dask_otel/`` is summed, split into the span mirror and the metric callbacks
  (Dask's own retention is not counted). PASS if the span mirror's share grows by
  less than 64 KiB from 1,000 to 10,000 spans, i.e. under 7 bytes per span: less
  than any per-span record would take (one dict entry alone is ~100 bytes), and
  above the noise of CPython's free lists, which keep a few recently freed dicts
  allocated. Also the sizes of the mirror's own structures (its ``Ledger``:
  open span records, open TaskGroup batches, leaves). With ``--no-tracemalloc``, the cost of a poll at
  those points instead.
- ``children`` only: how long the poll that finally exports the root (with its
  10,000 sub-spans) blocks the event loop;
- ``tenants`` only: the longest poll (CPU less garbage collection, and wall)
  while 1,000 more short spans come and go (after the memory checkpoints,
  without tracemalloc), with the 1,000 long ones open: a poll looks at an open
  TaskGroup only once its export delay has passed.

Usage::

    python -m benchmarks.scale                    # 10 and 10,000 spans, roots and children
    python -m benchmarks.scale --shape tenants    # the same with 1,000 spans open throughout
    python -m benchmarks.scale --spans 2000 --shape roots
    python -m benchmarks.scale --shape tenants --no-tracemalloc   # polls, not memory: minutes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster, span, wait

from benchmarks.harness import (
    GCClock,
    PLUGIN_NAME,
    ReceiverProcess,
    median,
    print_machine,
    print_table,
    quiet_logs,
    run_on_loop,
    use_otel_env,
    verdict,
)

DASK_OTEL_DIR = str(Path(__import__("dask_otel").__file__).resolve().parent)
#: Spans submitted between two waits for their results
BATCH = 500


def _inc(x: int) -> int:
    return x + 1


class Pipeline:
    """Submits one-task Dask spans, each with its own task prefix, and knows how
    many OTel spans the bridge should have exported"""

    def __init__(self, client: Client, mirror: Any, receiver: ReceiverProcess, shape: str):
        self.client = client
        self.mirror = mirror
        self.receiver = receiver
        self.shape = shape
        self.created = 0
        #: OTel spans expected so far: a Dask span and its TaskGroup per step
        self.expected = 0
        self.blocker: Any = None

    def add(self, n: int) -> None:
        """``n`` more completed steps; for ``children``, then a new running step
        after them. The old running step is cancelled only once the new one is
        in: a root that is done, even for an instant, may be exported."""
        futures = []
        for _ in range(n):
            i = self.created
            self.created += 1
            with span(f"step-{i}"):
                futures.append(self.client.submit(_inc, i, key=f"{self.shape}{i}-0"))
            if len(futures) >= BATCH:
                wait(futures)
                futures.clear()
        wait(futures)
        del futures
        self.expected += 2 * n
        if self.shape == "children":
            old = self.blocker
            with span(f"running-step-{self.created}"):
                self.blocker = self.client.submit(
                    _inc, 0, key=f"blocker{self.created}-0", resources={"never": 1}
                )
            if old is not None:
                self._cancel(old)

    def _cancel(self, future: Any) -> None:
        future.cancel()
        self.expected += 2  # its span and TaskGroup are exported once cancelled

    def finish(self) -> None:
        """Cancel the running step: the root is done, and is exported"""
        if self.blocker is not None:
            self._cancel(self.blocker)
            self.blocker = None
            self.expected += 1

    def wait_exported(self, timeout: float = 300) -> None:
        """Until the bridge has mirrored, and the collector received, every span"""
        deadline = time.monotonic() + timeout
        while self.mirror.mirrored < self.expected or self.receiver.count() < self.expected:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.mirror.mirrored} spans mirrored and {self.receiver.count()} "
                    f"received of {self.expected} after {timeout}s; open spans "
                    f"{len(self.mirror.ledger.records)}, open groups {len(self.mirror.ledger.groups)}"
                )
            time.sleep(0.2)


def poll_cost(cluster: LocalCluster, mirror: Any, reps: int) -> tuple[float, float]:
    """(median, 90th percentile) seconds of one poll, on the event loop"""

    def timed() -> list[float]:
        out = []
        poll = mirror.poll
        for _ in range(reps):
            t0 = time.perf_counter()
            poll()
            out.append(time.perf_counter() - t0)
        return out

    durations = sorted(run_on_loop(cluster, timed))
    return median(durations), durations[int(0.9 * (len(durations) - 1))]


#: Which part of the bridge an allocation belongs to, by the innermost dask_otel
#: file in its traceback
PARTS = {"metrics.py": "metrics", "instruments.py": "metrics"}


def bridge_allocations() -> tuple[dict[str, int], list[str]]:
    """Bytes still allocated from a traceback that goes through dask_otel/, by part
    (``spans``: the span mirror and the plugin; ``metrics``: the metric callbacks),
    and the three lines (innermost dask_otel frame) holding the most.

    Walks the raw traces rather than ``Snapshot.filter_traces(all_frames=True)``,
    which takes minutes on a process with millions of traces: tracemalloc hands out
    one tuple per distinct traceback, so each is looked at once.
    """
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    prefix = DASK_OTEL_DIR + "/"
    seen: dict[int, tuple[str, int] | None] = {}
    by_line: Counter[tuple[str, int]] = Counter()
    for _domain, size, frames, *_ in snapshot.traces._traces:
        key = id(frames)
        if key not in seen:
            seen[key] = next((f for f in frames if f[0].startswith(prefix)), None)
        line = seen[key]
        if line is not None:
            by_line[line] += size
    del snapshot, seen
    parts = {"spans": 0, "metrics": 0}
    for (filename, _), size in by_line.items():
        parts[PARTS.get(Path(filename).name, "spans")] += size
    top = [
        f"{size / 1024:.1f} KiB allocated under {Path(f).name}:{n}"
        for (f, n), size in by_line.most_common(3)
    ]
    return parts, top


def mirror_structures(mirror: Any) -> dict[str, int]:
    """Sizes of the mirror's Ledger: open span records, open TaskGroup batches,
    leaves, and exported roots remembered with their caller"""
    ledger = mirror.ledger
    parts = (ledger.records, ledger.groups, ledger.leaves, ledger.reopened_parents)
    return {
        "open_spans": len(ledger.records),
        "open_groups": len(ledger.groups),
        "leaves": len(ledger.leaves),
        "reopened_roots": len(ledger.reopened_parents),
        "bytes": sum(map(sys.getsizeof, parts))
        + sum(map(sys.getsizeof, ledger.records.values())),
    }


def checkpoints(small: int, large: int) -> list[int]:
    """Span counts at which the bridge's allocations are looked at"""
    first = min(1000, large)
    points = {first, large, *(first + (large - first) * k // 3 for k in (1, 2))}
    return sorted(p for p in points if p > small)


def run_shape(args: argparse.Namespace, receiver: ReceiverProcess, shape: str) -> list[list[str]]:
    small, large = args.small, args.spans
    print(f"\n== {shape}: {small} then {large} one-task Dask spans ==", flush=True)
    with dask.config.set({"distributed.scheduler.preload": ["dask_otel"]}):
        cluster = LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False,
            dashboard_address="127.0.0.1:0",
        )
    rows: list[list[str]] = []
    memory: list[tuple[int, dict[str, int]]] = []
    polls: list[tuple[int, float]] = []  # without tracemalloc: (spans, poll seconds)
    longest = longest_wall = 0.0
    try:
        with Client(cluster) as client:
            plugin = cluster.scheduler.plugins[PLUGIN_NAME]
            mirror = plugin.mirror
            if mirror is None:
                raise RuntimeError(f"the bridge is not running: {plugin.error}")
            ext = cluster.scheduler.extensions["spans"]
            receiver.clear()
            pipeline = Pipeline(client, mirror, receiver, shape)
            tenants = open_tenants(client, args.open) if shape == "tenants" else []
            root = span("pipeline") if shape == "children" else contextlib.nullcontext()
            with root:
                pipeline.add(small)
                pipeline.wait_exported()
                p_small = poll_cost(cluster, mirror, args.polls)
                s_small = mirror_structures(mirror)
                print(f"  {pipeline.created:>6} spans: poll {p_small[0] * 1e6:.1f} us "
                      f"(p90 {p_small[1] * 1e6:.1f}); {s_small}", flush=True)

                if args.tracemalloc:
                    tracemalloc.start(25)
                top: list[str] = []
                for point in checkpoints(small, large):
                    pipeline.add(point - pipeline.created)
                    pipeline.wait_exported()
                    if not args.tracemalloc:
                        # Poll cost along the way instead (tracemalloc would inflate it)
                        polls.append((point, poll_cost(cluster, mirror, args.polls)[0]))
                        print(f"  {point:>6} spans: poll {polls[-1][1] * 1e6:.1f} us; "
                              f"{mirror_structures(mirror)}", flush=True)
                        continue
                    parts, top = bridge_allocations()
                    memory.append((point, parts))
                    print(f"  {point:>6} spans: still allocated by the bridge: span mirror "
                          f"{parts['spans'] / 1024:.1f} KiB, metrics "
                          f"{parts['metrics'] / 1024:.1f} KiB", flush=True)
                tracemalloc.stop()
                for line in top:
                    print(f"      {line}")

                gc.collect()
                p_large = poll_cost(cluster, mirror, args.polls)
                s_large = mirror_structures(mirror)
                print(f"  {pipeline.created:>6} spans: poll {p_large[0] * 1e6:.1f} us "
                      f"(p90 {p_large[1] * 1e6:.1f}); {s_large}; Dask holds "
                      f"{len(ext.spans)} spans", flush=True)

                if tenants:
                    # Polls while short spans come and go, timed without tracemalloc
                    live: list[float] = []
                    live_cpu: list[float] = []
                    with timing_polls(mirror, live, live_cpu):
                        pipeline.add(min(1000, large))
                        pipeline.wait_exported()
                    longest, longest_wall = max(live_cpu), max(live)
                    print(f"  {len(tenants)} spans open throughout; {len(live)} polls while "
                          f"{min(1000, large)} more came and went: wall median "
                          f"{median(live) * 1e3:.2f} ms, longest {longest_wall * 1e3:.1f} ms; "
                          f"CPU without GC median {median(live_cpu) * 1e3:.2f} ms, longest "
                          f"{longest * 1e3:.1f} ms", flush=True)
                if shape == "children":
                    # The last step finishes: the root is done, and exported in one poll
                    longest = _time_polls_until_root_exported(mirror, pipeline)
                    print(f"  root with {large} sub-spans exported; longest poll "
                          f"{longest * 1e3:.1f} ms", flush=True)
    finally:
        cluster.close()

    ratio = p_large[0] / p_small[0]
    flat_poll = p_large[0] <= max(1.10 * p_small[0], p_small[0] + 1e-6)
    rows.append([shape, f"poll after {small} spans (us)", f"{p_small[0] * 1e6:.1f}", "", ""])
    if polls:
        rows.append([shape, "poll after " + " / ".join(str(n) for n, _ in polls) + " spans (us)",
                     " / ".join(f"{t * 1e6:.1f}" for _, t in polls), "", ""])
    rows.append([shape, f"poll after {large} spans (us)", f"{p_large[0] * 1e6:.1f}",
                 f"x{ratio:.2f} (<= x1.10 or +1 us)", verdict(flat_poll)])
    if memory:
        (first, m_first), (last, m_last) = memory[0], memory[-1]
        growth = m_last["spans"] - m_first["spans"]
        rows.append([shape, "span mirror allocations held at " + " / ".join(
                         str(n) for n, _ in memory) + " spans (KiB)",
                     " / ".join(f"{m['spans'] / 1024:.0f}" for _, m in memory),
                     f"{growth / 1024:+.1f} KiB {first}->{last} (< 64)",
                     verdict(growth < 64 * 1024)])
        rows.append([shape, "metrics allocations held, same points (KiB)",
                     " / ".join(f"{m['metrics'] / 1024:.0f}" for _, m in memory), "", ""])
    rows.append([shape, f"open spans/groups/leaves after {small} / {large}",
                 f"{s_small['open_spans']}/{s_small['open_groups']}/{s_small['leaves']} / "
                 f"{s_large['open_spans']}/{s_large['open_groups']}/{s_large['leaves']}",
                 "", ""])
    if shape == "tenants":
        rows.append([shape, f"longest poll, {args.open} open throughout: CPU without GC (wall) (ms)",
                     f"{longest * 1e3:.1f} ({longest_wall * 1e3:.1f})",
                     "< 5 CPU (event loop)", verdict(longest < 0.005)])
    if shape == "children":
        rows.append([shape, f"poll exporting the root of {large} (ms)",
                     f"{longest * 1e3:.1f}", "< 5 (event loop)", verdict(longest < 0.005)])
    return rows


def open_tenants(client: Client, n: int) -> list[Any]:
    """``n`` root spans that stay open: each waits on a task no worker can run"""
    futures = []
    for j in range(n):
        with span(f"tenant-{j}"):
            futures.append(client.submit(_inc, j, key=f"tenant{j}-0", resources={"never": 1}))
    return futures


@contextlib.contextmanager
def timing_polls(mirror: Any, durations: list[float], cpu: list[float] | None = None):
    """Wrap ``mirror.poll`` (as the plugin calls it) to append each poll's wall
    time to ``durations`` and its CPU less garbage collection to ``cpu``: a full
    collection of Dask's heap runs in whichever call crosses the threshold, and a
    wall time includes waiting for a core the workers use"""
    poll = mirror.poll
    gc_clock = GCClock()
    perf_counter, thread_time = time.perf_counter, time.thread_time

    def timed() -> Any:
        g0 = gc_clock.total
        t0, c0 = perf_counter(), thread_time()
        try:
            return poll()
        finally:
            durations.append(perf_counter() - t0)
            if cpu is not None:
                cpu.append(thread_time() - c0 - (gc_clock.total - g0))

    mirror.poll = timed
    try:
        yield
    finally:
        mirror.poll = poll
        gc_clock.close()


def _time_polls_until_root_exported(mirror: Any, pipeline: Pipeline) -> float:
    """Cancel the running step and time every poll until the root is exported;
    the longest"""
    durations: list[float] = []
    with timing_polls(mirror, durations):
        pipeline.finish()
        pipeline.wait_exported(timeout=120)
    return max(durations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=10)
    parser.add_argument("--polls", type=int, default=500, help="polls timed per measure")
    parser.add_argument("--shape", choices=["roots", "children", "tenants", "both"],
                        default="both", help="both: roots and children")
    parser.add_argument("--open", type=int, default=1000,
                        help="tenants: root spans open throughout")
    parser.add_argument("--no-tracemalloc", dest="tracemalloc", action="store_false",
                        help="time polls at the checkpoints instead of reading the bridge's "
                             "allocations: tracemalloc slows a run ~40 x (tenants: ~2 spans/s)")
    args = parser.parse_args(argv)

    print("dask_otel scale benchmark")
    print_machine()
    rows = []
    started = time.monotonic()
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        for shape in (["roots", "children"] if args.shape == "both" else [args.shape]):
            rows += run_shape(args, receiver, shape)
    print("\n== summary ==")
    print_table(["shape", "measure", "value", "target", ""], rows)
    print(f"  total benchmark time {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
