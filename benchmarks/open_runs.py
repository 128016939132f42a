"""What ``dask.workflow.active`` and ``dask.workflow.tasks`` cost per collection.

Both are read in the metric reader's thread (holding the GIL against the event loop)
from the records of the open Dask spans: ``Outcomes.open_runs`` walks the open roots
and sums Dask's ``Span.states`` of each (every TaskGroup of its span tree). An
in-process ``LocalCluster`` with the bridge (metrics to memory) runs ``--runs`` roots
of ``--steps`` sub-spans, each with a TaskGroup of its own prefix; then a ledger holding
every one of those Dask spans as open (what the mirror holds while they run) is read
``--repeat`` times, as a collection of the two instruments reads it. CPU of this
thread, median (min-max), per collection, per open run and per TaskGroup.

Usage::

    python -m benchmarks.open_runs --runs 100 --steps 10
"""

from __future__ import annotations

import argparse
import time

import dask
from distributed import Client, LocalCluster, span, wait

from benchmarks.harness import median, print_machine, spread
from dask_otel.scheduler.ledger import Ledger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=51)
    args = parser.parse_args()
    print_machine()
    config = {"distributed.scheduler.preload": ["dask_otel"], "otel.metrics.exporter": "memory",
              "otel.traces.exporter": "none"}
    with dask.config.set(config), LocalCluster(n_workers=1, processes=False,
                                               dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        for run in range(args.runs):
            with span(f"run-{run}"):
                for step in range(args.steps):
                    with span(f"step-{step}"):
                        wait(client.submit(int, step, key=f"r{run}s{step}-0"))
        outcomes = cluster.scheduler.plugins["dask-otel"].mirror.outcomes
        ledger = Ledger()  # every span opened by hand, as the mirror holds them while they run
        for dask_span in cluster.scheduler.extensions["spans"].spans.values():
            ledger.open_span(dask_span)
        roots = sum(record.span.parent is None for record in ledger.records.values())
        groups = sum(len(record.span.groups) for record in ledger.records.values())
        cpu = {}
        for by_state in (False, True):
            times = []
            for _ in range(args.repeat):
                start = time.thread_time()
                outcomes.open_runs(ledger, by_state)
                times.append(time.thread_time() - start)
            cpu[by_state] = times[1:]
    print(f"{roots} open runs ({len(ledger.records)} open Dask spans), {groups} TaskGroups")
    for by_state, name in ((False, "dask.workflow.active"), (True, "dask.workflow.tasks")):
        t = cpu[by_state]
        print(f"{name}: {median(t) * 1e3:.3f} ms per collection ({spread([x * 1e3 for x in t])}), "
              f"{median(t) / roots * 1e6:.1f} us per open run, "
              f"{median(t) / groups * 1e6:.2f} us per TaskGroup")


if __name__ == "__main__":
    main()
