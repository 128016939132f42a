"""Bytes on the wire: what a real OTLP receiver on 127.0.0.1 gets from a 2-worker
LocalCluster (worker processes) running the overhead workload (harness.Workload:
4,000 tasks, 40 Dask spans, 200 TaskGroups), for OTLP/HTTP and OTLP/gRPC, without
and with gzip (``OTEL_EXPORTER_OTLP_COMPRESSION``), task spans off and on.

Each signal goes to its own counting TCP proxy in front of the receiver
(``OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT``): "wire" is every byte the exporters
sent, HTTP or HTTP/2 framing and headers included. "request" is the OTLP
requests' protobuf size as the receiver decodes them (what ``status()`` counts).
Bytes do not depend on machine load: one run per setting is enough.

Also the CPU the SDK's OTLP/HTTP gzip (``gzip.GzipFile``, level 9) spends on the
same requests, per item: what defaulting to gzip would add to the export threads.

Reported: bytes per Dask or TaskGroup span (task spans off), per task span (the
difference that turning them on makes, per task), per metric export of the
cluster once the workload's series exist (the last request of the scheduler and
of each worker), per log record, and per hour at the default
intervals for a cluster as measured (spans and task spans as the workload makes
them, every 5 s batch; metrics every 60 s).

Usage::

    python -m benchmarks.volume                 # both protocols, gzip off and on (~4 min)
    python -m benchmarks.volume --protocol http/protobuf --compression none   # one row (~1 min)
    python -m benchmarks.volume --knobs         # what each knob saves, OTLP/HTTP (~5 min)
"""

from __future__ import annotations

import argparse
import gzip
import io
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import dask
from distributed import Client, LocalCluster

from benchmarks.harness import Workload, print_machine, print_table, quiet_logs
from tests.support.otlp_receiver import OTLPReceiver

SIGNALS = ("traces", "metrics", "logs")
#: The workload of benchmarks/overhead.py's volume figures (issue text)
WORKLOAD = Workload(spans=40, outer=10, prefixes=5, tasks=4000)
#: Seconds between metric exports while measuring: a few exports per run
METRIC_INTERVAL_MS = 2000
#: Log records sent per run (WARNING, a short message and one attribute)
LOG_RECORDS = 200


class CountingProxy:
    """A TCP proxy on 127.0.0.1 to ``port`` that counts the bytes clients send"""

    def __init__(self, port: int):
        self.target = port
        self.sent = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(65536):
                if counted:
                    with self._lock:
                        self.sent += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


@dataclass
class Volume:
    """What one run sent, per signal (receiver's names: traces, metrics, logs)"""

    wire: dict[str, int] = field(default_factory=dict)
    request: dict[str, int] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    metric_exports: int = 0
    #: seconds the SDK's HTTP gzip (``gzip.GzipFile``, level 9) takes on the
    #: requests, best of 3 each: the CPU that gzip adds to an export thread
    gzip_seconds: dict[str, float] = field(default_factory=dict)
    #: bytes of the last metric request of each process, summed, and their gzip CPU
    last_export: int = 0
    last_export_gzip: float = 0.0


def gzip_seconds(data: bytes) -> float:
    """CPU seconds the SDK's OTLP/HTTP exporter spends compressing ``data``"""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="w") as stream:
            stream.write(data)
        best = min(best, time.thread_time() - start)
    return best


def _items(signal: str, request) -> int:
    if signal == "traces":
        return sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
    if signal == "logs":
        return sum(len(s.log_records) for r in request.resource_logs for s in r.scope_logs)
    return sum(len(getattr(m, m.WhichOneof("data")).data_points)
               for r in request.resource_metrics for s in r.scope_metrics for m in s.metrics)


def measure(protocol: str, compression: str, task_spans: bool,
            knob: dict[str, str] | None = None) -> Volume:
    """One cluster, one workload, all signals to the receiver through the proxies;
    ``knob``: ``OTEL_*`` variables and ``otel.*`` keys set on top"""
    knob = knob or {}
    with OTLPReceiver(protocol) as receiver:
        proxies = {signal: CountingProxy(receiver.port) for signal in SIGNALS}
        env = {k: v for k, v in receiver.env().items() if not k.endswith("_ENDPOINT")}
        for signal, proxy in proxies.items():
            path = f"/v1/{signal}" if protocol == "http/protobuf" else ""
            env[f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"] = f"http://127.0.0.1:{proxy.port}{path}"
        env["OTEL_METRIC_EXPORT_INTERVAL"] = str(METRIC_INTERVAL_MS)
        env.update({k: v for k, v in knob.items() if k.startswith("OTEL_")})
        if compression != "none":
            env["OTEL_EXPORTER_OTLP_COMPRESSION"] = compression
        saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
        for key in saved:
            del os.environ[key]
        os.environ.update(env)
        config = {"distributed.scheduler.preload": ["dask_otel"],
                  "otel.traces.exporter": "otlp", "otel.metrics.exporter": "otlp",
                  "otel.logs.exporter": "otlp", "otel.tasks.spans": task_spans,
                  **{k: v for k, v in knob.items() if k.startswith("otel.")}}
        try:
            with dask.config.set(config), LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address="127.0.0.1:0",
            ) as cluster, Client(cluster) as client:
                client.wait_for_workers(2)
                WORKLOAD.run(client)
                application = logging.getLogger("benchmarks.volume")
                application.addHandler(logging.NullHandler())  # exported, not printed
                for i in range(LOG_RECORDS):
                    application.warning("record %d of the volume benchmark", i, extra={"n": i})
                time.sleep(2.5 * METRIC_INTERVAL_MS / 1000)
        finally:
            for key in env:
                os.environ.pop(key, None)
            os.environ.update(saved)
        time.sleep(0.5)  # the last bytes through the proxies
        volume = Volume(wire={s: p.sent for s, p in proxies.items()})
        for proxy in proxies.values():
            proxy.close()
        for signal, request in receiver.raw_requests:
            volume.request[signal] = volume.request.get(signal, 0) + request.ByteSize()
            volume.items[signal] = volume.items.get(signal, 0) + _items(signal, request)
            volume.gzip_seconds[signal] = (volume.gzip_seconds.get(signal, 0)
                                           + gzip_seconds(request.SerializeToString()))
        volume.metric_exports = len({p.time for p in receiver.metric_points()
                                     if p.name == "dask.otel.span.mirrored"})
        # The last metric request of each process: one export of the cluster once
        # the workload's series exist (earlier exports have fewer)
        last = {}
        for signal, request in receiver.raw_requests:
            if signal == "metrics":
                last[_pid(request.resource_metrics)] = request
        volume.last_export = sum(r.ByteSize() for r in last.values())
        volume.last_export_gzip = sum(gzip_seconds(r.SerializeToString()) for r in last.values())
        return volume


def _pid(resources) -> int:
    return next(a.value.int_value for r in resources for a in r.resource.attributes
                if a.key == "process.pid")


def rows(protocol: str, compression: str) -> list[list[str]]:
    off = measure(protocol, compression, task_spans=False)
    on = measure(protocol, compression, task_spans=True)
    mirrored = off.items.get("traces", 0)  # Dask spans and TaskGroups
    tasks = WORKLOAD.n_tasks
    task_spans = on.items.get("traces", 0) - mirrored
    per = {
        "Dask or TaskGroup span": (off.wire["traces"] / max(mirrored, 1),
                                   off.request.get("traces", 0) / max(mirrored, 1)),
        "task span": ((on.wire["traces"] - off.wire["traces"]) / max(task_spans, 1),
                      (on.request.get("traces", 0) - off.request.get("traces", 0)) / max(task_spans, 1)),
        # wire: the metric wire bytes in proportion to the requests'
        "metric export (scheduler + 2 workers)": (
            off.wire["metrics"] * off.last_export / max(off.request.get("metrics", 0), 1),
            off.last_export),
        "log record": (off.wire["logs"] / max(off.items.get("logs", 0), 1),
                       off.request.get("logs", 0) / max(off.items.get("logs", 0), 1)),
    }
    cpu = {  # microseconds of gzip per item, on the raw requests
        "Dask or TaskGroup span": off.gzip_seconds.get("traces", 0) / max(mirrored, 1),
        "task span": (on.gzip_seconds.get("traces", 0) - off.gzip_seconds.get("traces", 0))
        / max(task_spans, 1),
        "metric export (scheduler + 2 workers)": off.last_export_gzip,
        "log record": off.gzip_seconds.get("logs", 0) / max(off.items.get("logs", 0), 1),
    }
    out = [[protocol, compression, what, f"{wire:,.0f}", f"{request:,.0f}", f"{cpu[what] * 1e6:,.1f}"]
           for what, (wire, request) in per.items()]
    # An hour of this cluster at the default intervals (a metric export every
    # 60 s), running the workload once a minute
    runs = 3600 / 60
    hour_off = runs * off.wire["traces"] + 60 * per["metric export (scheduler + 2 workers)"][0]
    hour_on = runs * on.wire["traces"] + 60 * per["metric export (scheduler + 2 workers)"][0]
    out.append([protocol, compression, "hour, one workload a minute, task spans off / on",
                f"{hour_off / 1e6:,.1f} MB / {hour_on / 1e6:,.1f} MB", "", ""])
    out.append([protocol, compression, "(items: mirrored spans, task spans, metric exports, log records)",
                f"{mirrored}, {task_spans}, {off.metric_exports}, {off.items.get('logs', 0)}", "", ""])
    return out


#: The knobs that cut volume, each on its own over the defaults (task spans on,
#: so that the task span knobs show): name -> settings
KNOBS = {
    "defaults, task spans on": {},
    "OTEL_TRACES_SAMPLER=traceidratio 0.25": {"OTEL_TRACES_SAMPLER": "traceidratio",
                                               "OTEL_TRACES_SAMPLER_ARG": "0.25"},
    "otel.tasks.sample-ratio: 0.1": {"otel.tasks.sample-ratio": 0.1},
    "otel.tasks.sample-ratio: 0, slower-than: 1s": {"otel.tasks.sample-ratio": 0.0,
                                                     "otel.tasks.slower-than": "1s"},
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=64": {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "64"},
    "otel.metrics.span-label: true (adds)": {"otel.metrics.span-label": True},
    "otel.metrics.dask: true (adds)": {"otel.metrics.dask": True},
    "otel.logs.level: ERROR": {"otel.logs.level": "ERROR"},
}


def knob_rows(protocol: str) -> list[list[str]]:
    """Bytes of each signal (OTLP requests, raw) for one workload, per knob"""
    out = []
    for name, knob in KNOBS.items():
        v = measure(protocol, "none", task_spans=True, knob=knob)
        out.append([name, f"{v.request.get('traces', 0):,}", f"{v.items.get('traces', 0):,}",
                    f"{v.last_export:,}",
                    f"{v.request.get('logs', 0):,}"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", nargs="+", default=["http/protobuf", "grpc"])
    parser.add_argument("--compression", nargs="+", default=["none", "gzip"])
    parser.add_argument("--knobs", action="store_true",
                        help="bytes per knob that cuts volume (OTLP/HTTP, raw requests)")
    args = parser.parse_args(argv)
    print_machine()
    if args.knobs:
        with quiet_logs():
            table = knob_rows(args.protocol[0])
        print_table(["knob", "span bytes", "spans", "metric bytes per export",
                     "log bytes"], table)
        return 0
    table = []
    with quiet_logs():
        for protocol in args.protocol:
            for compression in args.compression:
                table += rows(protocol, compression)
    print_table(["protocol", "compression", "bytes per", "wire", "OTLP request (raw)",
                 "gzip CPU (us)"], table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
