"""What the benchmarks share: the workload, one measured run of a LocalCluster
with or without the bridge, the OTLP receiver process, statistics and the
description of the machine.

Where CPU is measured
---------------------
``LocalCluster(processes=True)`` runs the scheduler (and the nannies) on an event
loop thread of this process and the workers in subprocesses. The client gets its
own event loop thread (``Client(cluster.scheduler_address)``), and builds graphs
in the main thread. So:

    scheduler CPU = CPU of this process - main thread - the client's loop thread

It covers the scheduler's event loop (where the bridge's hooks and polls run),
the bridge's export threads (batch span processor, gRPC, metric reader), Dask's
offload thread, and the nannies (a few heartbeats). The client's share is
measured with ``time.thread_time()`` on its own threads and subtracted.

Each run also records the CPU of every thread of this process by name
(:func:`thread_cpu`, from ``/proc/self/task``), so that a B/A gap can be traced to
the thread that spent it: the event loop, the SDK's export threads, gRPC's, Dask's
offload thread. Threads Python does not know (gRPC's C core) are
listed by their OS name; CPU of threads that started and ended within the run
shows as ``(exited threads)``: the process total minus the live threads' sum.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster, span, wait

#: The repository root, from which ``python -m benchmarks.receiver`` runs
REPO = Path(__file__).resolve().parent.parent
#: Name of the bridge's plugin in Scheduler.plugins
PLUGIN_NAME = "dask-otel"


# --- the machine -----------------------------------------------------------------


def machine() -> dict[str, str]:
    """What the numbers were measured on"""
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = "?"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        kib = int(f.readline().split()[1])
        memory = f"{kib / 2**20:.0f} GiB"
    versions = {
        name: version(dist)
        for name, dist in [
            ("dask", "dask"),
            ("distributed", "distributed"),
            ("opentelemetry-sdk", "opentelemetry-sdk"),
            ("otlp-grpc-exporter", "opentelemetry-exporter-otlp-proto-grpc"),
            ("grpcio", "grpcio"),
            ("dask-otel", "dask-otel"),
        ]
    }
    return {
        "dask_otel (last commit)": dask_otel_commit(),
        "cpus (nproc)": str(os.cpu_count()),
        "cpu model": model,
        "memory": memory,
        "python": platform.python_version(),
        **versions,
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def dask_otel_commit() -> str:
    """The commit of the dask_otel being measured, "+ changes" if its files differ
    from it (the package is installed editable: what is on disk is what runs; a
    checkout on PYTHONPATH, as for a before/after run, is the one imported)"""
    import dask_otel

    root = Path(dask_otel.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=False).stdout.strip()

    commit = git("log", "-1", "--format=%h %s", "--", "dask_otel") or "?"
    if git("status", "--porcelain", "--", "dask_otel"):
        commit += " + uncommitted changes in dask_otel/"
    return commit


def print_machine() -> None:
    info = machine()
    width = max(map(len, info))
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")


# --- statistics and tables ---------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """min-max, and the interquartile range when there are enough values"""
    if not values:
        return "-"
    out = f"{fmt.format(min(values))}-{fmt.format(max(values))}"
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        out += f" (IQR {fmt.format(q1)}-{fmt.format(q3)})"
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


# --- where the telemetry goes --------------------------------------------------------


class ReceiverProcess:
    """``benchmarks/receiver.py`` (tests/support/otlp_receiver.py's OTLPReceiver, gRPC) in
    a subprocess, so that its CPU is not the scheduler's"""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.receiver"], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError("the OTLP receiver process did not start")
        #: OTEL_* variables pointing an exporter at it
        self.env: dict[str, str] = json.loads(line)

    def _ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def count(self) -> int:
        """Spans received since the last clear()"""
        return int(self._ask("count"))

    def clear(self) -> None:
        self._ask("clear")

    def set_mode(self, mode: str) -> None:
        """The receiver's fault mode: ``ok``, ``unavailable`` (gRPC UNAVAILABLE)"""
        self._ask(f"mode {mode}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unreachable_env() -> dict[str, str]:
    """OTEL_* variables pointing at a closed port on 127.0.0.1 (bound then closed:
    nothing listens there unless someone else grabs the port meanwhile)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }


def use_otel_env(env: dict[str, str]) -> None:
    """Point this process and the worker processes it starts at ``env`` (as a user
    would export it); nothing else of OTEL_* is touched (batching stays default)"""
    for key in list(os.environ):
        if key.startswith("OTEL_EXPORTER_OTLP_"):
            del os.environ[key]
    os.environ.update(env)


# --- the workload ----------------------------------------------------------------------


def _stage(x: int) -> int:
    return x + 1


@dataclass(frozen=True)
class Workload:
    """``spans`` Dask spans on two levels: ``outer`` roots, each with
    ``spans / outer - 1`` children. Every span gets ``prefixes`` chained stages
    with their own task prefix (``stage<j>_s<span>``, so that no TaskGroup is
    shared between spans), ``tasks / (spans * prefixes)`` tasks wide. The roots run
    one after the other; the children of one root run together."""

    spans: int = 200
    outer: int = 20
    prefixes: int = 5
    tasks: int = 20_000

    def __post_init__(self) -> None:
        if self.spans % self.outer or self.spans < 2 * self.outer:
            raise ValueError("spans must be a multiple of outer, with >= 1 child each")

    @property
    def width(self) -> int:
        return max(1, self.tasks // (self.spans * self.prefixes))

    @property
    def n_tasks(self) -> int:
        return self.spans * self.prefixes * self.width

    @property
    def otel_spans(self) -> int:
        """OTel spans the bridge should export: one per Dask span and per TaskGroup"""
        return self.spans * (1 + self.prefixes)

    def graph(self, index: int) -> tuple[dict, list[str]]:
        dsk: dict[str, tuple] = {}
        for j in range(self.prefixes):
            for k in range(self.width):
                dep = k if j == 0 else f"stage{j - 1}_s{index}-{k}"
                dsk[f"stage{j}_s{index}-{k}"] = (_stage, dep)
        last = self.prefixes - 1
        return dsk, [f"stage{last}_s{index}-{k}" for k in range(self.width)]

    def _submit(self, client: Client, index: int) -> list:
        dsk, keys = self.graph(index)
        return client.get(dsk, keys, sync=False)

    def run(self, client: Client) -> None:
        index = 0
        children = self.spans // self.outer - 1
        for o in range(self.outer):
            futures: list = []
            with span(f"outer-{o}"):
                futures += self._submit(client, index)
                index += 1
                for i in range(children):
                    with span(f"inner-{i}"):
                        futures += self._submit(client, index)
                        index += 1
            wait(futures)
            del futures


# --- one measured run --------------------------------------------------------------------


class GCClock:
    """Seconds the garbage collector has run so far (``gc.callbacks``). A
    collection runs in whatever code allocates when a threshold is crossed, so
    its pause lands in a random callback; what it costs is proportional to the
    whole heap, which is Dask's."""

    def __init__(self) -> None:
        self.total = 0.0
        #: By thread (``threading.get_ident()``): wall and CPU seconds of the
        #: collections that ran on it. A collection on another thread (the
        #: bridge's builder, the client's) stops a callback without costing it CPU.
        self.wall: dict[int, float] = defaultdict(float)
        self.cpu: dict[int, float] = defaultdict(float)
        self._started: dict[int, tuple[float, float]] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = (time.perf_counter(), time.thread_time())
        elif (started := self._started.pop(ident, None)) is not None:
            wall = time.perf_counter() - started[0]
            self.total += wall
            self.wall[ident] += wall
            self.cpu[ident] += time.thread_time() - started[1]

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Name of the row for CPU of threads that ended within a run
EXITED = "(exited threads)"


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, from ``/proc/self/task``
    (Linux; {} elsewhere), summed by name with digits folded
    (``ThreadPoolExecutor-3_0`` -> ``ThreadPoolExecutor-N_N``). Python threads go by
    their Python name; threads Python does not know (gRPC's C core) by their OS
    name, as ``native:<comm>``. Resolution: one clock tick (10 ms)."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    comm, _, rest = f.read().partition("(")[2].rpartition(")")
            except OSError:  # ended meanwhile
                continue
            fields = rest.split()
            utime, stime = int(fields[11]), int(fields[12])
            name = python_names.get(int(tid)) or f"native:{comm}"
            out[re.sub(r"\d+", "N", name)] += (utime + stime) / _CLK_TCK
    return dict(out)


def thread_cpu_delta(
    before: dict[str, float], after: dict[str, float], process_cpu: float
) -> dict[str, float]:
    """CPU per thread name between two :func:`thread_cpu` readings; what the
    process spent beyond the live threads goes to :data:`EXITED`"""
    delta = {name: cpu - before.get(name, 0.0) for name, cpu in after.items()}
    delta = {name: cpu for name, cpu in delta.items() if cpu > 0}
    delta[EXITED] = max(process_cpu - sum(delta.values()), 0.0)
    return delta


async def _thread_time() -> float:
    return time.thread_time()


async def _reset_tick_max(scheduler: Any) -> None:
    scheduler.digests_max["tick-duration"] = 0.0


@dataclass
class Run:
    """Measures of one workload on one fresh LocalCluster"""

    bridge: bool
    #: seconds from the first submit to the last result (cluster start excluded)
    wall: float = 0.0
    #: scheduler CPU seconds (see module docstring) over the workload + drain
    scheduler_cpu: float = 0.0
    #: the same over the workload only
    scheduler_cpu_workload: float = 0.0
    #: CPU seconds of the scheduler's event loop thread over workload + drain
    loop_cpu: float = 0.0
    #: CPU seconds of the client's threads (main + its loop), subtracted above
    client_cpu: float = 0.0
    #: longest tick of the scheduler's event loop (distributed.admin.tick, 20 ms
    #: apart: a tick of 20 ms means no block), over workload + drain
    max_tick: float = 0.0
    #: OTel spans the bridge handed to the SDK; spans the receiver got
    mirrored: int = 0
    received: int | None = None
    #: CPU seconds by thread name over workload + drain, client threads included
    #: (see :func:`thread_cpu_delta`)
    threads: dict[str, float] = field(default_factory=dict)
    #: what a probe measured
    probe: dict = field(default_factory=dict)
    #: CPU seconds of this process (scheduler, nannies; the client is not up yet
    #: or already closed) and wall seconds of ``LocalCluster(...)``, workers up,
    #: and of ``cluster.close()``
    start_cpu: float = 0.0
    start_wall: float = 0.0
    close_cpu: float = 0.0
    close_wall: float = 0.0


def run_workload(
    workload: Workload,
    bridge: bool,
    *,
    workers: int = 2,
    drain: float = 8.0,
    receiver: ReceiverProcess | None = None,
    probe: Callable[[LocalCluster], Callable[[], dict]] | None = None,
) -> Run:
    """Start a LocalCluster with worker processes (with the preload key when
    ``bridge``), run ``workload``, then wait ``drain`` seconds so that the bridge
    exports what finished last (same wait without the bridge), and measure.

    ``probe(cluster)`` is called before the workload; what it returns is called
    after the drain and its dict stored in ``Run.probe``.
    """
    result = Run(bridge=bridge)
    preload = ["dask_otel"] if bridge else []
    cpu0, t0 = time.process_time(), time.perf_counter()
    with dask.config.set({"distributed.scheduler.preload": preload}):
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True,
            host="127.0.0.1", dashboard_address="127.0.0.1:0",
        )
    result.start_cpu, result.start_wall = time.process_time() - cpu0, time.perf_counter() - t0
    try:
        with Client(cluster.scheduler_address) as client:
            client.wait_for_workers(workers)
            client.run(lambda: None)  # connections up before the clock starts
            plugin = cluster.scheduler.plugins.get(PLUGIN_NAME)
            if bridge and getattr(plugin, "mirror", None) is None:
                raise RuntimeError(f"the bridge is not running: {getattr(plugin, 'error', None)}")
            if receiver is not None:
                receiver.clear()
            finish_probe = probe(cluster) if probe else None
            gc.collect()
            cluster.sync(_reset_tick_max, cluster.scheduler)

            def clocks() -> tuple[float, float, float, float]:
                return (
                    time.process_time(),
                    time.thread_time() + client.sync(_thread_time),
                    cluster.sync(_thread_time),
                    time.perf_counter(),
                )

            threads0 = thread_cpu()
            cpu0, client0, loop0, t0 = clocks()
            workload.run(client)
            cpu1, client1, _, t1 = clocks()
            time.sleep(drain)
            cpu2, client2, loop2, _ = clocks()
            result.threads = thread_cpu_delta(threads0, thread_cpu(), cpu2 - cpu0)

            result.wall = t1 - t0
            result.scheduler_cpu_workload = (cpu1 - cpu0) - (client1 - client0)
            result.scheduler_cpu = (cpu2 - cpu0) - (client2 - client0)
            result.client_cpu = client2 - client0
            result.loop_cpu = loop2 - loop0
            result.max_tick = cluster.scheduler.digests_max["tick-duration"]
            if plugin is not None and plugin.mirror is not None:
                result.mirrored = plugin.mirror.mirrored
            if receiver is not None:
                result.received = receiver.count()
            if finish_probe is not None:
                result.probe = finish_probe()
    finally:
        cpu0, t0 = time.process_time(), time.perf_counter()
        cluster.close()
        result.close_cpu, result.close_wall = time.process_time() - cpu0, time.perf_counter() - t0
        forget_closed_servers()
    return result


def forget_closed_servers() -> None:
    """Let a closed cluster's scheduler go: ``distributed.core._expects_comm`` is a
    ``functools.cache`` keyed by every server's bound handlers, so each Scheduler a
    process ever ran stays alive with its state (its transition log, the spans
    extension's TaskGroups). Without this, each run's full garbage collections
    also walked every earlier run's scheduler, and a later run (B after A) paid
    for the earlier ones: at 100,000 tiny tasks B's collections on the event loop
    took 4.95 s against A's 2.07 (benchmarks/README.md, "The slope")."""
    import distributed.core

    cache_clear = getattr(distributed.core._expects_comm, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    gc.collect()


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Dask logs a line per cluster start and stop, and the exporter one per
    failed export (collector unreachable); keep the tables readable"""
    import logging

    names = ["distributed", "opentelemetry", "dask_otel"]
    old = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in old.items():
            logging.getLogger(n).setLevel(level)


def ratio_rows(
    runs: Sequence[tuple[Run, Run]], measures: Sequence[tuple[str, str, float | None]]
) -> tuple[list[list[str]], dict[str, float]]:
    """Rows of per-pair ratios B/A for each ``(attribute, label, target)``"""
    rows = []
    medians = {}
    for attr, label, target in measures:
        ratios = [getattr(b, attr) / getattr(a, attr) for a, b in runs]
        med = median(ratios)
        medians[attr] = med
        a_med = median([getattr(a, attr) for a, _ in runs])
        b_med = median([getattr(b, attr) for _, b in runs])
        rows.append([
            label, f"{a_med:.2f}", f"{b_med:.2f}", f"{med:.3f}", spread(ratios),
            "-" if target is None else f"<= {target:.2f}",
            "-" if target is None else verdict(med <= target),
        ])
    return rows, medians


def run_on_loop(cluster: LocalCluster, fn: Callable[[], Any]) -> Any:
    """Call ``fn`` on the scheduler's event loop thread and return its result"""

    async def call() -> Any:
        return fn()

    return cluster.sync(call)
