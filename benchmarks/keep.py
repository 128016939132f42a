"""What ``otel.traces.keep`` saves: the bytes of spans a real OTLP receiver on 127.0.0.1
gets (every byte the exporter sent, through a counting proxy) for 200 runs of a
LocalCluster (2 worker processes), 10 of which err and 10 of which last 1.2 s (each run
a ``distributed.span`` root with a sub-span and one task: 3 spans), at
``traceidratio`` 1, at 0.01 with ``otel.traces.keep`` (``erred: true``,
``slower-than: 1s``), and at 0.01 without it. Each setting runs in a process of its own
(one bridge per process); the runs alternate. Reported: median bytes, their spread,
spans received, and the ratio to ``traceidratio`` 1.

Usage::

    python -m benchmarks.keep             # 3 rounds of the 3 settings (~2 min)
    python -m benchmarks.keep --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "ratio 1": ({"OTEL_TRACES_SAMPLER_ARG": "1.0"}, {}),
    "ratio 0.01 + keep": ({"OTEL_TRACES_SAMPLER_ARG": "0.01"},
                          {"otel.traces.keep.erred": True, "otel.traces.keep.slower-than": "1s"}),
    "ratio 0.01": ({"OTEL_TRACES_SAMPLER_ARG": "0.01"}, {}),
}
RUNS, ERRED, SLOW = 200, 10, 10


def one(name: str) -> dict:
    """Run the workload under setting ``name`` in this process: bytes and spans received"""
    import dask
    from distributed import Client, LocalCluster, span, wait

    from benchmarks.harness import quiet_logs
    from benchmarks.volume import CountingProxy
    from tests.support.otlp_receiver import OTLPReceiver
    from tests.support.tasks import fail, inc, slow

    env, config = SETTINGS[name]
    with OTLPReceiver("http/protobuf") as receiver, quiet_logs():
        proxy = CountingProxy(receiver.port)
        os.environ.update({**{k: v for k, v in receiver.env().items() if not k.endswith("_ENDPOINT")},
                           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{proxy.port}/v1/traces",
                           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_METRICS_EXPORTER": "none",
                           "OTEL_LOGS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "200", **env})
        with dask.config.set({"distributed.scheduler.preload": ["dask_otel"], "otel.spans.export-delay": "200ms",
                              "otel.spans.poll-interval": "100ms", **config}):
            with LocalCluster(n_workers=2, threads_per_worker=8, dashboard_address=None) as cluster, \
                    Client(cluster) as client:
                futures = []
                for i in range(RUNS):
                    task = fail if i < ERRED else slow if i < ERRED + SLOW else inc
                    with span(f"run {i}"), span("step"):
                        args = (i, 1.2) if task is slow else (i,)
                        futures.append(client.submit(task, *args, key=f"run{i}-0"))
                wait(futures)
                time.sleep(4)  # the export delay, a poll and a batch
        deadline = time.time() + 10
        while time.time() < deadline and len(receiver.spans()) < 3 * (ERRED + SLOW):
            time.sleep(0.2)
        time.sleep(1)
        return {"bytes": proxy.sent, "spans": len(receiver.spans())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    from benchmarks.harness import median, print_machine, print_table, spread

    got: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name in SETTINGS:
            out = subprocess.run([sys.executable, "-m", "benchmarks.keep", "--one", name],
                                 capture_output=True, text=True, check=True).stdout
            got[name].append(json.loads(out.strip().splitlines()[-1]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"benchmarks.keep, commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print_machine()
    base = median([r["bytes"] for r in got["ratio 1"]])
    print_table(["setting", "span bytes, median", "spread", "spans, median", "bytes / ratio 1"],
                [(name, f"{median([r['bytes'] for r in rs]):.0f}",
                  spread([r["bytes"] for r in rs], "{:.0f}"),
                  f"{median([r['spans'] for r in rs]):.0f}",
                  f"{median([r['bytes'] for r in rs]) / base:.3f}") for name, rs in got.items()])


if __name__ == "__main__":
    main()
