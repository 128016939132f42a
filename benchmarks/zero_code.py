"""Zero-code: what the other instrumentations ``opentelemetry-instrument`` loads do
on Dask servers, and what disabling them saves; with ``--startup``, what the
``dask`` entry point costs a process that never uses Dask.

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

``--startup``: ``opentelemetry-instrument python -c pass``, A with every installed
instrumentor (the ``dask`` entry point loaded), B with
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=dask``; one warm-up pair, then ``--pairs``
interleaved pairs (``--tree``: another checkout's dask_otel); each process's wall
and CPU time and peak RSS (the OS's accounting of the finished process); medians of
A/B wall and CPU and of A-B peak RSS over the pairs. Needs only opentelemetry-distro:
``python -m benchmarks.zero_code --startup --pairs 20``.

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


#: Runs its arguments and prints their wall and CPU seconds, peak RSS (KiB) and exit code: a
#: small process (-S -I), since a child's peak RSS counts the memory of the process
#: it was forked from (this one has distributed imported)
MEASURE = [
    sys.executable, "-S", "-I", "-c",
    "import os, sys, time\n"
    "started = time.perf_counter()\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execve(sys.argv[1], sys.argv[1:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "print(time.perf_counter() - started, usage.ru_utime + usage.ru_stime, usage.ru_maxrss,\n"
    "      os.waitstatus_to_exitcode(status))",
]


def startup_run(dask_on: bool, tree: Path) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds of ``opentelemetry-instrument python -c pass``,
    with the dask_otel of ``tree``"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update({"PYTHONPATH": str(tree), "OTEL_TRACES_EXPORTER": "none",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    if not dask_on:
        env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "dask"
    # cwd: ``-c`` puts it first on sys.path, before PYTHONPATH
    out = subprocess.run([*MEASURE, *INSTRUMENT, sys.executable, "-c", "pass"], env=env,
                         cwd=tree, capture_output=True, text=True, check=True)
    wall, cpu, kib, code = out.stdout.split()
    if code != "0":
        raise RuntimeError(f"opentelemetry-instrument python -c pass exited {code}: {out.stderr}")
    return float(wall), int(kib) / 1024, float(cpu)  # KiB on Linux


def startup(pairs: int, tree: Path) -> None:
    print("zero_code --startup: opentelemetry-instrument python -c pass; A = the dask "
          f"entry point loaded, B = OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=dask; dask_otel of {tree}")
    print_machine()
    startup_run(True, tree), startup_run(False, tree)  # warm-up: the files in the page cache
    a, b = [], []
    for i in range(pairs):
        a.append(startup_run(True, tree))
        b.append(startup_run(False, tree))
        print(f"  pair {i + 1}: A {a[-1][0]:.3f}s {a[-1][1]:.1f} MiB, "
              f"B {b[-1][0]:.3f}s {b[-1][1]:.1f} MiB", flush=True)
    ratios = [x[0] / y[0] for x, y in zip(a, b)]
    extra = [x[1] - y[1] for x, y in zip(a, b)]
    cpu_ratios = [x[2] / y[2] for x, y in zip(a, b)]
    print_table(["measure", "median", "spread (min-max)"], [
        ["A wall s", f"{median([x[0] for x in a]):.3f}", spread([x[0] for x in a])],
        ["B wall s", f"{median([y[0] for y in b]):.3f}", spread([y[0] for y in b])],
        ["A peak MiB", f"{median([x[1] for x in a]):.1f}", spread([x[1] for x in a], "{:.1f}")],
        ["B peak MiB", f"{median([y[1] for y in b]):.1f}", spread([y[1] for y in b], "{:.1f}")],
        ["wall A/B (goal <= 1.05)", f"{median(ratios):.3f}", spread(ratios)],
        ["peak MiB A-B (goal <= 1)", f"{median(extra):.2f}", spread(extra, "{:.2f}")],
        ["CPU A/B (user + sys)", f"{median(cpu_ratios):.3f}", spread(cpu_ratios)],
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--startup", action="store_true",
                        help="the dask entry point's cost to a process that never uses Dask")
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="--startup: the checkout whose dask_otel to load (another commit's)")
    parser.add_argument("--spans", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--drain", type=float, default=3.0)
    args = parser.parse_args()
    if args.startup:
        startup(args.pairs, args.tree)
        return
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
