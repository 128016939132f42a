"""CPU of the bridge's threads, per thread, with the collector up, refused, hung
(accepts TCP, never answers) or answering UNAVAILABLE: the outage policy
(docs/deploy.md, "When telemetry fails") must make an outage cost no more than a
healthy collector.

    python -m benchmarks.outage_cpu [--rounds 2] [--spans 100] [--retry]   # from the repository root
    python -m benchmarks.outage_cpu --close 5   # close times instead

``--close N``: N rounds of the close of a 1-worker LocalCluster right after 3 Dask
spans, the flush's export the first (spans every 5 s, the SDK's 10 s exporter
timeout), with the collector refused, answering UNAVAILABLE or hung, each against
the same close without the bridge (as ``tests/test_faults.py`` times them: spans
exported 200 ms after they end, ``otel.flush-timeout`` 5 s, 10 s when hung).

Each run: a LocalCluster (scheduler in this process, 2 worker processes) with the
preload, spans and metrics over OTLP/gRPC (spans every 500 ms, metrics every
second, the SDK's default 10 s exporter timeout), the workload, then a drain of
8 s; CPU per thread of this process from ``/proc/self/task``
(:func:`benchmarks.harness.thread_cpu`, 10 ms resolution). The modes alternate
within each round. ``--retry`` adds the same outages with
``otel.export.retry-during-outage: true`` (the SDK's own retries), for reference.
The receiver runs in its own process; the hung collector (a socket that accepts and
never answers) in a thread of this one, listed apart.
"""

from __future__ import annotations

import argparse
import os

import dask

from benchmarks.harness import (
    EXITED,
    ReceiverProcess,
    Workload,
    dask_otel_commit,
    median,
    print_machine,
    print_table,
    quiet_logs,
    run_workload,
    spread,
    unreachable_env,
    use_otel_env,
)
from tests.support.otlp_receiver import BlackHole

#: The bridge's threads, and the others of the scheduler process, by the name
#: thread_cpu gives them
THREADS = {
    "span processor": "OtelBatchSpanRecordProcessor",
    "metric reader": "OtelPeriodicExportingMetricReader",
}
EXPORT_ENV = {
    "OTEL_BSP_SCHEDULE_DELAY": "500",
    "OTEL_METRIC_EXPORT_INTERVAL": "1000",
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
}


def grpc_threads(threads: dict[str, float]) -> float:
    """gRPC's C-core threads (named by the OS) and its Python callback threads"""
    return sum(cpu for name, cpu in threads.items()
               if name.startswith("native:grpc") or "grpc" in name.lower())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spans", type=int, default=100,
                        help="Dask spans (each with 5 TaskGroups), 10 roots")
    parser.add_argument("--retry", action="store_true",
                        help="also the outages with otel.export.retry-during-outage")
    parser.add_argument("--close", type=int, metavar="N",
                        help="time N closes per collector fault instead")
    args = parser.parse_args()
    if args.close:
        close_times(args.close)
        return
    os.environ.update(EXPORT_ENV)
    workload = Workload(spans=args.spans, outer=10, prefixes=5, tasks=20 * args.spans)
    modes = ["up", "refused", "hung", "unavailable"]
    if args.retry:
        modes += ["refused+retry", "hung+retry", "unavailable+retry"]
    results: dict[str, list] = {m: [] for m in modes}
    print_machine()
    print(f"dask_otel commit {dask_otel_commit()}; workload: {workload.otel_spans} OTel spans, "
          f"{workload.n_tasks} tasks; rounds: {args.rounds}; taken under load (shared machine)")
    with quiet_logs(), ReceiverProcess() as receiver, BlackHole() as hole:
        _exporter_warnings_on()
        for _ in range(args.rounds):
            for mode in modes:
                fault, _, retry = mode.partition("+")
                receiver.set_mode("unavailable" if fault == "unavailable" else "ok")
                env = {
                    "up": receiver.env, "unavailable": receiver.env,
                    "refused": unreachable_env(), "hung": hole.env(protocol="grpc"),
                }[fault]
                use_otel_env(env)
                with dask.config.set({"otel.export.retry-during-outage": bool(retry),
                                      "otel.flush-timeout": "2s"}):
                    run = run_workload(workload, bridge=True, drain=8.0, receiver=receiver)
                results[mode].append(run)
                print(f"  {mode}: span processor "
                      f"{run.threads.get(THREADS['span processor'], 0):.2f}s, metric reader "
                      f"{run.threads.get(THREADS['metric reader'], 0):.2f}s, received "
                      f"{run.received}", flush=True)
    rows = []
    for mode, runs in results.items():
        def col(f):
            values = [f(r) for r in runs]
            return f"{median(values):.2f} ({spread(values, '{:.2f}')})"

        rows.append([
            mode,
            col(lambda r: r.threads.get(THREADS["span processor"], 0.0)),
            col(lambda r: r.threads.get(THREADS["metric reader"], 0.0)),
            col(lambda r: grpc_threads(r.threads)),
            col(lambda r: r.threads.get(EXITED, 0.0)),
            col(lambda r: r.scheduler_cpu),
            col(lambda r: r.received or 0),
        ])
    print()
    print("CPU seconds per run (median (spread)), workload + 8 s drain:")
    print_table(["collector", "span processor", "metric reader", "gRPC threads",
                 "exited threads", "scheduler process", "spans received"], rows)


def _exporter_warnings_on() -> None:
    """The outage policy ends a retry at the exporter's WARNING that announces it
    (held, not shown): with the ``opentelemetry`` loggers at CRITICAL, as
    quiet_logs() sets them, that record is never made and every failed export runs
    the SDK's retry cycle in this process (the workers' processes are not quieted)"""
    import logging

    logging.getLogger("opentelemetry").setLevel(logging.WARNING)


def close_times(rounds: int) -> None:
    """Seconds to close, with the bridge minus without, per fault (alternating)"""
    from distributed import span

    from tests.support.cluster import seconds_to_close
    from tests.support.otlp_receiver import OTLPReceiver, closed_port

    def workload(client) -> None:
        for i in range(3):
            with span(f"stage {i}"):
                client.gather(client.map(lambda x: x + 1, range(5), key=[f"s{i}-{j}" for j in range(5)]))

    def close_time(config: dict) -> float:
        return seconds_to_close(config, workload, settle=0.5, n_workers=1)

    print_machine()
    print(f"dask_otel commit {dask_otel_commit()}; close after 3 Dask spans, 1 worker; "
          f"rounds: {rounds}; taken under load (shared machine)")
    faults = ["refused", "unavailable", "hung"]
    added: dict[str, list[float]] = {f: [] for f in faults}
    with quiet_logs(), OTLPReceiver("grpc", mode="unavailable") as receiver, BlackHole() as hole:
        _exporter_warnings_on()
        for _ in range(rounds):
            for fault in faults:
                env = {"refused": unreachable_env(), "unavailable": receiver.env,
                       "hung": hole.env(protocol="grpc")}[fault]
                env = env() if callable(env) else env
                use_otel_env({**env, "OTEL_BSP_SCHEDULE_DELAY": "5000",
                              "OTEL_EXPORTER_OTLP_TIMEOUT": "10", "OTEL_TRACES_EXPORTER": "otlp",
                              "OTEL_METRICS_EXPORTER": "none"})
                # The mirror's export delay and poll of tests/test_faults.py: its spans
                # are in the SDK's queue when the close starts
                config = {"otel.flush-timeout": "10s" if fault == "hung" else "5s",
                          "otel.spans.export-delay": "200ms", "otel.spans.poll-interval": "100ms",
                          "otel.traces.exporter": "otlp", "otel.metrics.exporter": "none"}
                without = close_time({**config, "distributed.scheduler.preload": []})
                with_bridge = close_time({**config, "distributed.scheduler.preload": ["dask_otel"]})
                added[fault].append(with_bridge - without)
                print(f"  {fault}: {with_bridge:.2f}s with the bridge, {without:.2f}s without",
                      flush=True)
    print()
    print("Seconds the bridge adds to the close (median (spread)):")
    print_table(["collector", "added"], [
        [fault, f"{median(v):.2f} ({spread(v, '{:.2f}')})"] for fault, v in added.items()
    ])


if __name__ == "__main__":
    main()
