"""Scheduler thread time per span of the mirror's export path, replayed: steadier
than one pass.

Runs the overhead workload (harness.Workload) on a LocalCluster with worker
processes and the bridge, with ``otel.spans.export-delay: 1h`` so that nothing is
exported while it runs. Then, on the scheduler's event loop, with the export delay
set to 0, it copies the mirror's state, and ``--repeats`` times: puts the copy
back, collects garbage, and polls with the garbage collector off until everything
is exported, timed with ``time.thread_time``. The SDK's span processors are set
aside meanwhile (ReadableSpans are built, not queued), so each pass is the same
work on the same Dask objects. Prints min and median us per OTel span.

Unlike mirror_profile.py this reads and writes the mirror's internals (the names
in ``STATE``), so it must follow them when they change.

Usage::

    python -m benchmarks.replay_export               # 15 passes
    PYTHONPATH=<a checkout>:. python -P -m benchmarks.replay_export   # another commit's dask_otel
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time

import dask
from distributed import Client, LocalCluster
from benchmarks.harness import (
    PLUGIN_NAME,
    ReceiverProcess,
    Workload,
    print_machine,
    quiet_logs,
    run_on_loop,
    use_otel_env,
)
from benchmarks.mirror_profile import poll_until_exported

#: The mirror's per-span state, restored before each pass (present ones only)
STATE = (
    "open_spans", "open_groups", "erred", "ends", "open_children", "open_groups_of",
    "idle", "folded", "remote_parents", "reopened_parents", "entered", "links",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    print("dask_otel: the span mirror's export path, replayed")
    print_machine()
    workload = Workload(spans=200, outer=20, prefixes=5, tasks=20_000)
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
                workload.run(client)
                time.sleep(1.5)  # a heartbeat from every worker: fine metrics are in
                mirror.config = dataclasses.replace(mirror.config, export_delay=0.0)
                names = [n for n in STATE if hasattr(mirror, n)]
                # Totals in `folded` are summed into: deep copies; the rest shallow
                saved = {n: copy.copy(getattr(mirror, n)) for n in names}
                sink = mirror.sink
                processors, sink.processors = sink.processors, []

                def passes() -> tuple[list[float], int]:
                    out, n = [], 0
                    for _ in range(args.repeats):
                        for name in names:
                            value = saved[name]
                            setattr(mirror, name, copy.deepcopy(value) if name == "folded"
                                    else copy.copy(value))
                        gc.collect()
                        gc.disable()
                        try:
                            seconds, n = poll_until_exported(mirror, None)
                        finally:
                            gc.enable()
                        out.append(seconds / n * 1e6)
                    return out, n

                try:
                    per_span, n = run_on_loop(cluster, passes)
                finally:
                    sink.processors = processors
        finally:
            cluster.close()
    print(f"\n== {n} OTel spans exported per pass, {len(per_span)} passes, GC off ==")
    print(f"  us per span: min {min(per_span):.1f}, median {statistics.median(per_span):.1f}, "
          f"max {max(per_span):.1f}")
    print("  passes: " + " ".join(f"{x:.1f}" for x in per_span))
    return 0


if __name__ == "__main__":
    sys.exit(main())
