"""What the bridge costs per task, as a slope, and what it costs once: the
scheduler process's CPU per task without (A) and with (B) the preload key,
between two sizes of the same workload, and the start and close of the cluster.

Each point is one run on a fresh ``LocalCluster`` with two single-threaded worker
processes (``harness.run_workload``), exporting over OTLP/gRPC to a receiver in
another process on 127.0.0.1. At each size three runs follow each other: A; B with
every ``otel.*`` key at its default (Dask spans and TaskGroups mirrored, no task
spans); B with task spans at sample ratio 1 (``otel.tasks.spans: true``,
``otel.tasks.sample-ratio: 1.0``: every task a span, built by the worker that ran
it). Workloads:

``tiny``
    ``harness.Workload`` scaled with the task count: one Dask span per 100 tasks
    (5 chained TaskGroups of 20 ``inc`` tasks each), ten spans per root, the roots
    one after the other: 6 OTel spans per 100 tasks at any size.
``dataframe``
    A workflow run again and again, each run one root span with two children: a
    ``dask.dataframe`` shuffle (``df.shuffle("id")``: P2P, Dask's default on a
    cluster) and a groupby aggregation (also through a P2P shuffle) of
    ``dask.datasets.timeseries`` (24 partitions of 3,600 rows, made on the
    workers): 327 tasks and 21 TaskGroups a run.

Per run: the scheduler process's CPU (this process less the client's threads,
see harness.py) over the workload and a ``--drain``, the worker processes' CPU over
the same interval (psutil), the tasks the scheduler ran (counted from Dask's
TaskGroups), the CPU and wall time of ``LocalCluster(...)`` and ``close()``.

Reported:

- **steady cost**: the slope (CPU at the larger size - CPU at the smaller) / (tasks
  at the larger - tasks at the smaller), in us per task, A and B, and B/A; the
  start, the close, the drain and everything else paid once per run cancel out;
- **fixed cost**: start and close of the cluster, B - A, the median over the runs
  of the session (CPU and wall), and the worker processes' CPU up to the first
  task (interpreter, imports, the bridge's set-up).

One run per point: the figures are ratios from one run; ``--repeats N`` runs each
point N times (A, B, B ratio 1 in turn) and takes medians.

Usage::

    python -m benchmarks.slope                  # tiny 10k -> 100k, dataframe 1k -> 3k: ~13 min idle
    python -m benchmarks.slope --dataframe      # tiny only: ~10 min idle
    python -m benchmarks.slope --tiny 2000 10000 --dataframe 1000 2000   # a quick look
    python -m benchmarks.slope --tiny --dataframe 10000 100000   # the dataframe at the peer's sizes: ~1.5 h
    python -m benchmarks.slope --million        # tiny also at 1,000,000: ~1.5 h more
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import dask
import psutil
from distributed import Client, LocalCluster, span

from benchmarks.harness import (
    ReceiverProcess,
    Run,
    Workload,
    median,
    print_machine,
    print_table,
    quiet_logs,
    run_workload,
    use_otel_env,
)

#: The B sides: dask config over the defaults (A: no preload key)
CONFIGS: dict[str, dict] = {
    "B": {},
    "B ratio 1": {"otel.tasks.spans": True, "otel.tasks.sample-ratio": 1.0},
}


def tiny(tasks: int) -> Workload:
    """``tasks`` tiny tasks, a Dask span per 100, ten spans per root"""
    spans = 10 * max(round(tasks / 1000), 1)
    return Workload(spans=spans, outer=spans // 10, prefixes=5, tasks=tasks)


@dataclass(frozen=True)
class DataFrameWorkflow:
    """``runs`` root spans one after the other, each a shuffle and a groupby of the
    same generated frame, in a child span each"""

    runs: int

    #: tasks one run gives on dask/distributed 2026.8.0 (327: the figures count
    #: them, see ``tasks_run``); only used to choose ``runs`` for a number of tasks
    TASKS_PER_RUN = 330

    def run(self, client: Client) -> None:
        import dask.dataframe  # noqa: F401  (dask.datasets.timeseries needs it)

        # dask-expr warns that it ignores annotations; distributed.span's reach the
        # scheduler another way (each task lands in its span: checked by reading
        # the spans extension after a run)
        warnings.filterwarnings("ignore", "Dask annotations", UserWarning)
        for r in range(self.runs):
            df = dask.datasets.timeseries(
                start="2000-01-01", end="2000-01-02", freq="1s", partition_freq="1h", seed=r
            )
            with span(f"etl-{r}"):
                with span("shuffle"):
                    df.shuffle("id").map_partitions(len).sum().compute()
                with span("groupby"):
                    df.groupby("name").agg({"x": "mean", "y": "sum"}).compute()


def dataframe(tasks: int) -> DataFrameWorkflow:
    return DataFrameWorkflow(runs=max(1, round(tasks / DataFrameWorkflow.TASKS_PER_RUN)))


WORKLOADS: dict[str, Callable[[int], object]] = {"tiny": tiny, "dataframe": dataframe}


def tasks_run(cluster: LocalCluster) -> int:
    """Tasks the scheduler has had, of every TaskGroup of a Dask span (every task:
    a task outside any span is in the "default" span); a TaskGroup counts a task
    in whatever state, forgotten included"""
    ext = cluster.scheduler.extensions["spans"]
    groups = {id(tg): tg for s in ext.spans.values() for tg in s.groups}
    return sum(len(tg) for tg in groups.values())


def workers_cpu(cluster: LocalCluster) -> float:
    """CPU seconds of the worker processes since they started"""
    total = 0.0
    for ws in cluster.scheduler.workers.values():
        times = psutil.Process(ws.pid).cpu_times()
        total += times.user + times.system
    return total


def probe(cluster: LocalCluster) -> Callable[[], dict]:
    """Worker CPU at the start (the workers' start-up) and over the run, tasks run"""
    started = workers_cpu(cluster)
    tasks0 = tasks_run(cluster)

    def finish() -> dict:
        return {"workers_start_cpu": started, "workers_cpu": workers_cpu(cluster) - started,
                "tasks": tasks_run(cluster) - tasks0}

    return finish


def one_run(workload: object, side: str, args: argparse.Namespace,
            receiver: ReceiverProcess) -> Run:
    with dask.config.set(CONFIGS.get(side, {})):
        return run_workload(workload, side != "A", workers=args.workers, drain=args.drain,
                            receiver=receiver, probe=probe)


def describe(side: str, run: Run, receiver: ReceiverProcess) -> str:
    tasks = run.probe["tasks"]
    # Resident memory now: whether a larger size fits the machine (the receiver
    # holds what it got until the next run's clear())
    rss = psutil.Process().memory_info().rss / 2**30
    receiver_rss = psutil.Process(receiver.proc.pid).memory_info().rss / 2**30
    return (f"{side:<9} {tasks:>8} tasks  wall {run.wall:7.1f}s  sched CPU "
            f"{run.scheduler_cpu:7.2f}s ({run.scheduler_cpu / tasks * 1e6:6.0f} us/task)  "
            f"workers CPU {run.probe['workers_cpu']:7.2f}s  start {run.start_wall:5.2f}s "
            f"close {run.close_wall:5.2f}s  mirrored {run.mirrored} received {run.received}  "
            f"RSS {rss:.2f} GiB, receiver {receiver_rss:.2f} GiB")


def slope(small: list[Run], large: list[Run], cpu: Callable[[Run], float]) -> float:
    """Seconds per task between the two sizes (medians over repeats)"""
    d_cpu = median([cpu(r) for r in large]) - median([cpu(r) for r in small])
    d_tasks = median([r.probe["tasks"] for r in large]) - median([r.probe["tasks"] for r in small])
    return d_cpu / d_tasks


def scheduler_cpu(r: Run) -> float:
    return r.scheduler_cpu


def worker_cpu(r: Run) -> float:
    return r.probe["workers_cpu"]


def steady_rows(name: str, runs: dict[tuple[int, str], list[Run]],
                sizes: list[int]) -> list[list[str]]:
    """One row per pair of consecutive sizes: us per task A, B, B ratio 1, and B/A"""
    rows = []
    for small, large in zip(sizes, sizes[1:]):
        tasks = f"{median([r.probe['tasks'] for r in runs[small, 'A']]):,.0f} -> " \
                f"{median([r.probe['tasks'] for r in runs[large, 'A']]):,.0f}"
        for label, cpu in (("scheduler", scheduler_cpu), ("workers", worker_cpu)):
            per = {side: slope(runs[small, side], runs[large, side], cpu) * 1e6
                   for side in ("A", *CONFIGS)}
            rate = median([r.probe["tasks"] / r.wall for r in runs[large, "A"]])
            rows.append([name, tasks, label, f"{rate:,.0f}", f"{per['A']:.0f}",
                         f"{per['B']:.0f}", f"{per['B'] / per['A']:.3f}",
                         f"{per['B ratio 1']:.0f}", f"{per['B ratio 1'] / per['A']:.3f}"])
    return rows


def fixed_rows(all_runs: dict[str, list[Run]]) -> list[list[str]]:
    """Start and close, median over every run of each side; B - A"""
    measures = [
        ("start: scheduler process CPU (ms)", lambda r: r.start_cpu * 1e3),
        ("start: wall, workers up (ms)", lambda r: r.start_wall * 1e3),
        ("start: worker processes' CPU, both (ms)", lambda r: r.probe["workers_start_cpu"] * 1e3),
        ("close: scheduler process CPU (ms)", lambda r: r.close_cpu * 1e3),
        ("close: wall (ms)", lambda r: r.close_wall * 1e3),
    ]
    rows = []
    for label, value in measures:
        a = median([value(r) for r in all_runs["A"]])
        row = [label, f"{a:.0f}"]
        for side in CONFIGS:
            b = median([value(r) for r in all_runs[side]])
            row += [f"{b:.0f}", f"{b - a:+.0f}"]
        rows.append(row)
    return rows


def estimate(done: dict[int, float], size: int) -> float:
    """Seconds a point of ``size`` should take, linear in tasks from the largest
    size done (its three runs)"""
    largest = max(done)
    return done[largest] * size / largest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", type=int, nargs="*", default=[10_000, 100_000],
                        metavar="TASKS", help="sizes of the tiny workload (none: skip it)")
    parser.add_argument("--dataframe", type=int, nargs="*", default=[1_000, 3_000],
                        metavar="TASKS", help="sizes of the dataframe workload (none: skip it)")
    parser.add_argument("--million", action="store_true",
                        help="the tiny workload at 1,000,000 tasks too (estimated first)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each point")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--drain", type=float, default=3.0,
                        help="seconds waited after the workload, every run alike (the "
                             "spans' export delay and a poll; what the SDK exports "
                             "later is the same at every size and cancels in a slope)")
    args = parser.parse_args(argv)
    sizes = {"tiny": sorted(set(args.tiny + ([1_000_000] if args.million else []))),
             "dataframe": sorted(set(args.dataframe))}
    sizes = {name: s for name, s in sizes.items() if s}
    for name, s in sizes.items():
        if len(s) < 2:
            parser.error(f"--{name} needs two sizes for a slope, got {s}")

    print("dask_otel slope benchmark: scheduler CPU per task, A (no bridge) and B")
    print_machine()
    started = time.monotonic()
    runs: dict[str, dict[tuple[int, str], list[Run]]] = {name: {} for name in sizes}
    by_side: dict[str, list[Run]] = {side: [] for side in ("A", *CONFIGS)}
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        for name, points in sizes.items():
            print(f"\n== {name}: {' -> '.join(f'{n:,}' for n in points)} tasks; "
                  f"{args.repeats} run(s) per point per side ==", flush=True)
            took: dict[int, float] = {}
            for size in points:
                if took:
                    print(f"  {size:,} tasks: estimated {estimate(took, size) / 60:.0f} min "
                          f"for its {3 * args.repeats} runs", flush=True)
                t0 = time.monotonic()
                workload = WORKLOADS[name](size)
                for _ in range(args.repeats):
                    for side in ("A", *CONFIGS):
                        run = one_run(workload, side, args, receiver)
                        runs[name].setdefault((size, side), []).append(run)
                        by_side[side].append(run)
                        print(f"  {describe(side, run, receiver)}", flush=True)
                took[size] = time.monotonic() - t0

    steady = (["workload", "tasks", "process", "tasks/s (A)", "A us/task", "B us/task", "B/A",
               "B ratio 1 us/task", "B ratio 1/A"],
              [row for name in sizes for row in steady_rows(name, runs[name], sizes[name])])
    fixed = ([f"fixed cost, median of {len(by_side['A'])} runs", "A", "B", "B - A", "B ratio 1",
              "B ratio 1 - A"], fixed_rows(by_side))
    print(f"\n== steady cost: CPU per task as the slope between sizes, "
          f"{args.repeats} run(s) per point ==")
    print_table(*steady)
    print("\n== fixed cost: start and close of the cluster ==")
    print_table(*fixed)
    print("\n== the same, for benchmarks/README.md ==")
    for headers, rows in (steady, fixed):
        print()
        for row in [headers, ["---"] * len(headers), *rows]:
            print("| " + " | ".join(row) + " |")
    print(f"  total benchmark time {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
