"""What one metric collection costs per exported series, and who spends it.

An in-process ``LocalCluster`` (scheduler and ``--workers`` workers in this
process, so one MeterProvider holds the scheduler's and the workers'
instruments) with the preload key, metrics to an in-memory reader, traces to
memory (so that the span mirror gives the fine metrics their exemplars). The
overhead workload (``harness.Workload``: ``--spans`` Dask spans, ``--prefixes``
task prefixes each, ``--tasks`` tasks) runs once to fill Dask's fine
performance metrics and the workers' SpillBuffer counters; then the reader
collects ``--repeat`` times, which is what the metric reader's thread does per
``OTEL_METRIC_EXPORT_INTERVAL`` before it exports.

A collection is split without reading a private name: every observable
instrument's callbacks are wrapped when they are created (the public
``Meter.create_observable_*``), and one last observable gauge of this script,
created after all of the bridge's, marks the end of the callbacks. The SDK
calls each instrument's callbacks and then consumes its measurements (a
Measurement per observation with its attributes checked and copied, the exemplar
filter, attribute hashing, aggregation, exemplar reservoir) before it calls the
next instrument's, so per instrument:

- **bridge**: CPU inside its callback (reading Dask, building observations);
- **SDK consume**: CPU from the end of its callback to the start of the next;
- **SDK collect** (all instruments together): from the marker to the end of
  ``get_metrics_data()``: data points and their exemplars, built per series.

Then the same data is encoded as OTLP protobuf (the exporter's work before it
sends) and, with ``--export``, sent to an OTLP/gRPC receiver in another process
(``benchmarks/receiver.py``) by the SDK's OTLP exporter, and timed.

``--grow`` adds 1 to every fine-metrics value between collections (outside the
timed part), as heartbeats do during a workload: every fine-metrics series then
carries an exemplar. Without it nothing changes between collections (an idle
cluster). CPU is ``time.thread_time()`` of the collecting thread; medians over
the collections after the first (which creates the series), with min-max.
Garbage collections that start inside a collection are counted where they run
(as in a live scheduler) and reported apart (wall time, ``gc.callbacks``): a
full one costs in proportion to the whole heap, here a scheduler and its workers.

To compare two versions of ``dask_otel/``, alternate runs with each one first
on the path: ``PYTHONPATH=<copy>:. python -P -m benchmarks.metrics_collection``.

``--sdk-variants`` compares settings of the SDK within one process instead,
where a shared machine's slow periods hit every variant alike: the bridge's scheduler and spill
instruments (not Dask's families) are created again on one fresh MeterProvider
per variant, attached to the same servers, and the variants' collections
alternate. Variants: the SDK's defaults; a View giving the bridge's observable
instruments a reservoir that is passed over when nothing was offered to it
(:class:`LazyExemplarReservoir`); the ``always_off`` exemplar filter (no
exemplars: what they cost).

Usage::

    python -m benchmarks.metrics_collection                    # 2 workers, 4,000 tasks
    python -m benchmarks.metrics_collection --grow --dask-families --export
    python -m benchmarks.metrics_collection --sdk-variants [--grow]
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import dask
from distributed import Client, LocalCluster
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    Meter,
    MeterProvider,
)
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from benchmarks.harness import (
    GCClock,
    ReceiverProcess,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    spread,
)

#: Who reads each instrument, by name: the first matching prefix
GROUPS = (
    ("dask.activity.", "fine metrics (scheduler)"),
    ("dask.otel.", "self-metrics (scheduler)"),
    ("dask.spill.", "spill (worker)"),
    ("dask.memory.threshold", "spill (worker)"),
    ("dask.worker.", "Dask's families (worker)"),
    ("dask.", "Dask's families (scheduler)"),
    ("", "other"),
)


def group_of(name: str) -> str:
    return next(group for prefix, group in GROUPS if name.startswith(prefix))


class Clock:
    """Marks taken inside the SDK's collection by the wrapped callbacks"""

    def __init__(self) -> None:
        #: (instrument name, thread CPU at its callbacks' start, at their end)
        self.marks: list[tuple[str, float, float]] = []

    def wrap(self, name: str, callback: Callable) -> Callable:
        @functools.wraps(callback)
        def timed(options: CallbackOptions) -> Iterable[Observation]:
            start = time.thread_time()
            out = list(callback(options))
            self.marks.append((name, start, time.thread_time()))
            return out

        return timed


CLOCK = Clock()


def wrap_meter() -> None:
    """Time the callbacks of every observable instrument created from now on"""
    for method in ("create_observable_counter", "create_observable_gauge",
                   "create_observable_up_down_counter"):
        original = getattr(Meter, method)

        def create(self, name, callbacks=None, *args, _original=original, **kwargs):
            callbacks = [CLOCK.wrap(name, cb) for cb in callbacks or ()]
            return _original(self, name, callbacks, *args, **kwargs)

        setattr(Meter, method, create)


MARKER = "benchmark.collection.marker"


def collect_once(reader) -> tuple[dict, dict[str, int], dict[str, int], float, object]:
    """One collection: ``({instrument: (bridge, consume)}, points, exemplars,
    sdk collect, data)``, CPU seconds"""
    CLOCK.marks.clear()
    t0 = time.thread_time()
    data = reader.get_metrics_data()
    t1 = time.thread_time()
    marks = CLOCK.marks
    split = {}
    for (name, start, end), (_, following, _) in zip(marks, marks[1:]):
        bridge, consume = split.get(name, (0.0, 0.0))
        split[name] = (bridge + end - start, consume + following - end)
    marker_end = marks[-1][2]
    assert marks[-1][0] == MARKER, "the marker is not the last instrument"
    split["(before the first callback)"] = (0.0, marks[0][1] - t0)
    points: dict[str, int] = {}
    exemplars: dict[str, int] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                pts = metric.data.data_points
                points[metric.name] = points.get(metric.name, 0) + len(pts)
                exemplars[metric.name] = exemplars.get(metric.name, 0) + sum(
                    len(getattr(p, "exemplars", ()) or ()) for p in pts)
    return split, points, exemplars, t1 - marker_end, data


def encode_cost(data) -> tuple[float, int]:
    """CPU of encoding ``data`` as the OTLP exporters do, and its size"""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    t0 = time.thread_time()
    size = len(encode_metrics(data).SerializeToString())
    return time.thread_time() - t0, size


def grow(scheduler) -> None:
    metrics = scheduler.cumulative_worker_metrics
    for key in list(metrics):
        if isinstance(key, tuple) and len(key) >= 3:
            metrics[key] += 1.0


def sdk_variants() -> dict[str, tuple[MeterProvider, InMemoryMetricReader]]:
    from dask_otel.export.instruments import EXEMPLAR_VIEWS

    settings: dict[str, dict] = {
        "SDK defaults": {},
        "lazy reservoir view": {"views": EXEMPLAR_VIEWS},
        "exemplar filter always_off": {"exemplar_filter": AlwaysOffExemplarFilter()},
    }
    out = {}
    for name, kwargs in settings.items():
        reader = InMemoryMetricReader()
        out[name] = (MeterProvider([reader], shutdown_on_exit=False, **kwargs), reader)
    return out


def compare_sdk_variants(cluster: LocalCluster, bridge_provider, args) -> None:
    from dask_otel.scheduler.metrics import SchedulerInstruments
    from dask_otel.spill import SpillInstruments

    variants = sdk_variants()
    readers = {}
    for name, (provider, reader) in variants.items():
        for cls in (SchedulerInstruments, SpillInstruments):
            instruments = cls.of(provider)
            for server in cls.of(bridge_provider).attached:
                instruments.attach(server)
        provider.get_meter("benchmark").create_observable_gauge(
            MARKER, callbacks=[lambda options: []])
        readers[name] = reader
    parts: dict[str, dict[str, list[float]]] = {
        name: defaultdict(list) for name in variants}
    points: dict[str, int] = {}
    exemplars: dict[str, int] = {}
    for n in range(args.repeat + 1):
        for name, reader in readers.items():
            if args.grow:
                cluster.sync(_on_loop, grow, cluster.scheduler)
            split, pts, ex, collect_cpu, _ = collect_once(reader)
            if n == 0:
                continue
            points[name], exemplars[name] = sum(pts.values()), sum(ex.values())
            parts[name]["bridge"].append(sum(b for b, _ in split.values()))
            parts[name]["consume"].append(sum(c for _, c in split.values()))
            parts[name]["collect"].append(collect_cpu)
            parts[name]["total"].append(sum(b + c for b, c in split.values()) + collect_cpu)
    print(f"\n== SDK variants in one process, collections alternating; fine metrics "
          f"{'grow' if args.grow else 'unchanged'}; median of {args.repeat} each; "
          f"us per exported point ==")
    base = median(parts["SDK defaults"]["total"])
    rows = []
    for name in variants:
        per = max(points[name], 1)
        cells = [f"{median(v) * 1e6 / per:.2f} ({spread([x * 1e6 / per for x in v], '{:.2f}')})"
                 for v in (parts[name][k] for k in ("bridge", "consume", "collect", "total"))]
        rows.append([name, f"{points[name]:,}", f"{exemplars[name]:,}", *cells,
                     f"x{median(parts[name]['total']) / base:.3f}"])
    print_table(["variant", "points", "exemplars", "bridge", "SDK consume", "SDK collect",
                 "collection", "vs defaults"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--spans", type=int, default=40)
    parser.add_argument("--outer", type=int, default=20)
    parser.add_argument("--prefixes", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--grow", action="store_true",
                        help="every fine-metrics series grows between collections")
    parser.add_argument("--dask-families", action="store_true", help="otel.metrics.dask on")
    parser.add_argument("--sdk-variants", action="store_true",
                        help="compare SDK settings in this process (see the docstring)")
    parser.add_argument("--export", action="store_true",
                        help="also send each collection to an OTLP/gRPC receiver process")
    args = parser.parse_args(argv)

    print("dask_otel metric collection benchmark")
    print_machine()
    wrap_meter()
    config = {
        "distributed.scheduler.preload": ["dask_otel"],
        "otel.traces.exporter": "memory",
        "otel.metrics.exporter": "memory",
        "otel.metrics.dask": args.dask_families,
    }
    workload = Workload(spans=args.spans, outer=args.outer, prefixes=args.prefixes,
                        tasks=args.tasks)
    receiver = ReceiverProcess() if args.export else None
    with quiet_logs(), dask.config.set(config), LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=False, protocol="tcp",
        host="127.0.0.1", dashboard_address="127.0.0.1:0",
    ) as cluster, Client(cluster) as client:
        workload.run(client)
        time.sleep(3)  # the last heartbeats (fine metrics) and span exports
        plugin = cluster.scheduler.plugins["dask-otel"]
        (reader,) = plugin.telemetry.metric_readers
        provider = plugin.telemetry.meter_provider
        if args.sdk_variants:
            compare_sdk_variants(cluster, provider, args)
            return 0
        provider.get_meter("benchmark").create_observable_gauge(
            MARKER, callbacks=[lambda options: []])
        exporter = None
        if receiver is not None:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )

            exporter = OTLPMetricExporter(
                endpoint=receiver.env["OTEL_EXPORTER_OTLP_ENDPOINT"], insecure=True)

        bridge: dict[str, list[float]] = defaultdict(list)
        consume: dict[str, list[float]] = defaultdict(list)
        sdk_collect, totals, encodes, sends = [], [], [], []
        points: dict[str, int] = {}
        exemplars: dict[str, list[int]] = defaultdict(list)
        size = 0
        gc_seconds, gc_full = [], []
        gc.collect()
        gc_clock = GCClock()
        for n in range(args.repeat + 1):
            if args.grow:
                cluster.sync(_on_loop, grow, cluster.scheduler)
            gc0, full0 = gc_clock.total, gc.get_stats()[2]["collections"]
            split, points, ex, collect_cpu, data = collect_once(reader)
            gc1, full1 = gc_clock.total, gc.get_stats()[2]["collections"]
            encode, size = encode_cost(data)
            send = None
            if exporter is not None:
                t0 = time.thread_time()
                exporter.export(data)
                send = time.thread_time() - t0
            if n == 0:
                continue  # the first collection creates every series
            for name, (b, c) in split.items():
                bridge[name].append(b)
                consume[name].append(c)
            for name, count in ex.items():
                exemplars[name].append(count)
            sdk_collect.append(collect_cpu)
            gc_seconds.append(gc1 - gc0)
            gc_full.append(full1 - full0)
            totals.append(sum(b + c for b, c in split.values()) + collect_cpu)
            encodes.append(encode)
            if send is not None:
                sends.append(send)
        gc_clock.close()
        if exporter is not None:
            exporter.shutdown()
    if receiver is not None:
        receiver.close()

    print(f"\n== {args.workers} in-process workers, {workload.n_tasks} tasks, "
          f"{workload.spans} spans x {workload.prefixes} prefixes; fine metrics "
          f"{'grow' if args.grow else 'unchanged'} between collections; Dask's families "
          f"{'on' if args.dask_families else 'off'}; median of {args.repeat} collections ==")
    by_group: dict[str, dict[str, list[float]]] = defaultdict(
        lambda: {"bridge": [0.0] * args.repeat, "consume": [0.0] * args.repeat})
    group_points: dict[str, int] = defaultdict(int)
    group_exemplars: dict[str, float] = defaultdict(float)
    for name in bridge:
        group = "(SDK, before the callbacks)" if name.startswith("(") else (
            "(marker)" if name == MARKER else group_of(name))
        for i in range(args.repeat):
            by_group[group]["bridge"][i] += bridge[name][i]
            by_group[group]["consume"][i] += consume[name][i]
        group_points[group] += points.get(name, 0)
        group_exemplars[group] += median(exemplars.get(name, [0]))
    total_points = sum(points.values())

    def us(values: list[float], per: int) -> str:
        per = max(per, 1)
        return f"{median(values) * 1e6 / per:.1f} ({spread([v * 1e6 / per for v in values], '{:.1f}')})"

    rows = []
    for group, parts in sorted(by_group.items()):
        if group == "(marker)":
            continue
        n = group_points[group]
        rows.append([group, f"{n:,}", f"{group_exemplars[group]:.0f}",
                     f"{median(parts['bridge']) * 1000:.2f}",
                     f"{median(parts['consume']) * 1000:.2f}",
                     us(parts["bridge"], n) if n else "-",
                     us(parts["consume"], n) if n else "-"])
    print("\n  by who reads the instruments: CPU ms per collection; us per exported point")
    print_table(["instruments", "points", "exemplars", "bridge ms", "SDK consume ms",
                 "bridge us/point", "SDK consume us/point"], rows)
    print("\n  the whole collection, per exported point (us), all instruments")
    bridge_all = [sum(by_group[g]["bridge"][i] for g in by_group) for i in range(args.repeat)]
    consume_all = [sum(by_group[g]["consume"][i] for g in by_group) for i in range(args.repeat)]
    rows = [
        ["bridge callbacks", us(bridge_all, total_points), f"{median(bridge_all) * 1000:.2f}"],
        ["SDK consume (filter, hash, aggregate, reservoir)", us(consume_all, total_points),
         f"{median(consume_all) * 1000:.2f}"],
        ["SDK collect (points, exemplars)", us(sdk_collect, total_points),
         f"{median(sdk_collect) * 1000:.2f}"],
        ["collection, all of the above", us(totals, total_points),
         f"{median(totals) * 1000:.2f}"],
        [f"OTLP protobuf encoding ({size:,} bytes)", us(encodes, total_points),
         f"{median(encodes) * 1000:.2f}"],
    ]
    if sends:
        rows.append(["OTLP/gRPC export to the receiver (encoding included)",
                     us(sends, total_points), f"{median(sends) * 1000:.2f}"])
    print_table(["part", "us per point, median (min-max)", "ms per collection"], rows)
    print(f"  {total_points:,} points per collection; garbage collection inside it (counted "
          f"above, wherever it ran): {median(gc_seconds) * 1000:.2f} ms median "
          f"({spread([g * 1000 for g in gc_seconds], '{:.2f}')}), {sum(gc_full)} full "
          f"collections in {args.repeat}")
    return 0


async def _on_loop(fn, *args):
    fn(*args)


if __name__ == "__main__":
    sys.exit(main())
