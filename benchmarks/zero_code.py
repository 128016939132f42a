"""Zero-code: what the other instrumentations ``opentelemetry-instrument`` loads do
on Dask servers, and what disabling them saves.

Each run starts ``opentelemetry-instrument dask scheduler`` and two
``opentelemetry-instrument dask worker --no-nanny`` (the bridge on through the
``dask`` entry point, no preload), runs the workload (``--spans`` Dask spans of
``--tasks`` tiny tasks each), fetches the scheduler's ``/metrics`` page
``--requests`` times, waits ``--drain`` seconds, then stops the processes (Ctrl-C)
and counts what reached an OTLP receiver, by instrumentation scope.

A: ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=click,asyncio,tornado`` (the line
docs/deploy.md proposes); B: every installed instrumentation on. Alternating A B;
medians of B/A of the scheduler's and the workers' CPU (``time.process_time`` in
each process, workload + drain) and the workload's wall time.

Needs opentelemetry-instrumentation-click, -asyncio and -tornado installed (in a
throwaway venv: they are not the project's dependencies) and dask_otel installed
with its entry point::

    python -m venv --system-site-packages /tmp/zc && /tmp/zc/bin/pip install -e . \\
        opentelemetry-distro opentelemetry-instrumentation-{click,asyncio,tornado}
    /tmp/zc/bin/python -m benchmarks.zero_code
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from distributed import Client, span

from benchmarks.harness import median, print_machine, print_table, spread
from tests.support.otlp_receiver import OTLPReceiver

REPO = Path(__file__).resolve().parents[1]
INSTRUMENT = [
    sys.executable, "-c",
    (
        "import sys; from opentelemetry.instrumentation.auto_instrumentation import run; "
        "sys.argv[0] = 'opentelemetry-instrument'; sys.exit(run())"
    ),
]
#: What docs/deploy.md proposes to disable on Dask servers
DISABLED = "click,asyncio,tornado"


def inc(x: int) -> int:
    return x + 1


def one_run(disabled: str | None, args: argparse.Namespace) -> dict:
    with OTLPReceiver("grpc") as receiver, tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
        env.update(receiver.env())
        env.update({
            "PYTHONPATH": str(REPO),
            "OTEL_SERVICE_NAME": "dask",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
            "DASK_OTEL__SPANS__EXPORT_DELAY": "300ms",
        })
        if disabled:
            env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = disabled
        scheduler_file = Path(tmp) / "scheduler.json"
        procs = []

        def spawn(*cmd: str) -> None:
            procs.append(subprocess.Popen(
                [*INSTRUMENT, sys.executable, "-m", *cmd], env=env, cwd=tmp,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))

        spawn("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
              "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file))
        while not scheduler_file.exists():
            time.sleep(0.1)
        for i in range(2):
            spawn("distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                  "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1",
                  "--dashboard-address", "127.0.0.1:0", "--name", f"w{i}")
        address = json.loads(scheduler_file.read_text())["address"]
        try:
            with Client(address, timeout=60) as client:
                client.wait_for_workers(2, timeout=60)
                dashboard = client.scheduler_info()["services"]["dashboard"]
                cpu0 = client.run_on_scheduler(time.process_time)
                wcpu0 = client.run(time.process_time)
                t0 = time.perf_counter()
                for s in range(args.spans):
                    with span(f"stage{s}"):
                        futures = client.map(inc, range(args.tasks), key=[
                            f"inc{s}-{i}" for i in range(args.tasks)])
                        client.gather(futures)
                        del futures
                wall = time.perf_counter() - t0
                for _ in range(args.requests):
                    with urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/metrics") as r:
                        r.read()
                time.sleep(args.drain)
                cpu = client.run_on_scheduler(time.process_time) - cpu0
                wcpu = sum(client.run(time.process_time).values()) - sum(wcpu0.values())
            started = time.monotonic()
        finally:
            for p in procs[::-1]:  # workers first, the scheduler last
                p.send_signal(signal.SIGINT)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        time.sleep(2)  # the click span is sent as the scheduler exits
        spans = receiver.spans()
        scopes = Counter(s.scope for s in spans)
        click = [s for s in spans if "click" in s.scope]
        return {
            "wall": wall, "cpu": cpu, "worker_cpu": wcpu, "scopes": dict(scopes),
            "click_durations": sorted(round(s.duration, 1) for s in click),
            "stopped_after": time.monotonic() - started,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--spans", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--drain", type=float, default=3.0)
    args = parser.parse_args()
    print("zero_code: A = OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=" + DISABLED + ", B = all on")
    print_machine()
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for side, disabled in (("A", DISABLED), ("B", None)):
            run = one_run(disabled, args)
            runs[side].append(run)
            print(f"  pair {i + 1} {side}: wall {run['wall']:.2f}s scheduler cpu {run['cpu']:.2f}s "
                  f"workers cpu {run['worker_cpu']:.2f}s spans by scope {run['scopes']} "
                  f"click span durations {run['click_durations']}", flush=True)
    rows = []
    for name, key in (("workload wall", "wall"), ("scheduler CPU", "cpu"),
                      ("workers CPU", "worker_cpu")):
        ratios = [b[key] / a[key] for a, b in zip(runs["A"], runs["B"])]
        rows.append([f"{name} B/A", f"{median(ratios):.3f}", spread(ratios)])
    print_table(["measure", "median", "spread (min-max)"], rows)


if __name__ == "__main__":
    main()
