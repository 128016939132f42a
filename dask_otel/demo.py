"""``dask-otel demo``: a nested-span workflow on a LocalCluster, shown as a waterfall.

The bridge is switched on exactly as a user would, with the preload key. Spans go
to an in-memory exporter on the scheduler (LocalCluster runs it in this process),
so no collector is needed; with ``--endpoint`` they also go over OTLP, and with
``--metrics`` the cluster's metrics too (the demo shows traces: a traces-only
backend such as Phoenix or Jaeger is sent only what it takes). README.md, "Set up".
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

BAR_WIDTH = 40


def load_partition(i: int) -> list[float]:
    rng = random.Random(i)
    time.sleep(0.05)
    return [rng.random() for _ in range(20_000)]


def fit(part: list[float]) -> float:
    return sum(part) / len(part)


def evaluate(models: list[float]) -> float:
    time.sleep(0.05)
    return sum(models) / len(models)


def run_workflow(client: Any) -> str:
    """Alice's workflow: a root span, two stages, a third level under "train"; each
    stage has its own task prefixes (a TaskGroup goes to the span of its first task)"""
    import dask
    from distributed import span, wait

    with span("Alice's workflow") as sid:
        with span("data load"):
            parts = client.persist([dask.delayed(load_partition)(i) for i in range(8)])
            wait(parts)
        with span("train"):
            models = [dask.delayed(fit)(p) for p in parts]
            with span("evaluate"):
                dask.delayed(evaluate)(models).compute()
    return sid


def waterfall(spans: Sequence[Any], trace_id: int) -> str:
    """The spans of one trace as an indented tree with a time bar each"""
    spans = [s for s in spans if s.context.trace_id == trace_id]
    if not spans:
        return "(no spans)"
    t0 = min(s.start_time for s in spans)
    scale = BAR_WIDTH / max(max(s.end_time for s in spans) - t0, 1)
    children = defaultdict(list)
    ids = {s.context.span_id for s in spans}
    for s in spans:
        parent = s.parent.span_id if s.parent and s.parent.span_id in ids else None
        children[parent].append(s)

    lines = [f"trace {trace_id:032x}"]
    name_width = 34

    def show(parent: int | None, depth: int) -> None:
        for s in sorted(children[parent], key=lambda s: (s.start_time, s.name)):
            a = int((s.start_time - t0) * scale)
            b = max(a + 1, int((s.end_time - t0) * scale))
            bar = " " * a + "█" * (b - a) + " " * (BAR_WIDTH - b)
            label = ("  " * depth + s.name)[:name_width].ljust(name_width)
            ms = (s.end_time - s.start_time) / 1e6
            lines.append(f"{label} {ms:8.1f} ms |{bar}| {_key_metrics(s)}")
            show(s.context.span_id, depth + 1)

    show(None, 0)
    return "\n".join(lines)


def _key_metrics(s: Any) -> str:
    attrs = s.attributes or {}
    tasks = attrs.get("dask.tasks.total", 0)
    cpu = attrs.get("dask.metrics.execute.thread_cpu.seconds", 0.0)
    out = f"tasks={tasks} cpu={cpu * 1000:.0f}ms out={attrs.get('dask.output.bytes', 0)}B"
    if s.status.status_code.name == "ERROR":
        out += f" ERROR: {s.status.description}"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dask-otel demo", description=__doc__)
    parser.add_argument("--endpoint", help="also send to this OTLP collector (http://host:4317)")
    parser.add_argument("--protocol", choices=["grpc", "http/protobuf"], default="grpc",
                        help="OTLP protocol for --endpoint (default: grpc)")
    parser.add_argument("--metrics", action="store_true",
                        help="also send the cluster's metrics to --endpoint (default: traces only)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.metrics and not args.endpoint:
        parser.error("--metrics needs --endpoint")

    import dask
    from distributed import Client, LocalCluster

    exporters = ["memory"]
    if args.endpoint:
        # The SDK's exporters read these, like any OTEL_* setting
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.endpoint
        os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = args.protocol
        exporters.append("otlp")

    with dask.config.set({
        "distributed.scheduler.preload": ["dask_otel"],
        "otel.traces.exporter": exporters,
        "otel.metrics.exporter": "otlp" if args.endpoint and args.metrics else "none",
        "otel.spans.export-delay": "500ms",
    }):
        with LocalCluster(
            n_workers=args.workers, threads_per_worker=2, dashboard_address=":0", host="127.0.0.1"
        ) as cluster, Client(cluster) as client:
            print(f"LocalCluster {cluster.scheduler_address}, {args.workers} workers")
            sid = run_workflow(client)
            trace_id = int(sid.replace("-", ""), 16)
            plugin = cluster.scheduler.plugins["dask-otel"]
            memory = plugin.telemetry.span_exporters[0]
            deadline = time.monotonic() + 30
            root_id = trace_id & ((1 << 64) - 1)
            while not any(s.context.span_id == root_id for s in memory.get_finished_spans()):
                if time.monotonic() > deadline:
                    print("the root span was not exported within 30 s")
                    return 1
                time.sleep(0.2)
            print(f"Dask span id {sid} -> OTel trace id {sid.replace('-', '')}\n")
            print(waterfall(memory.get_finished_spans(), trace_id))
            if args.endpoint:
                what = "traces and metrics" if args.metrics else "traces"
                print(f"\n{what} sent to {args.endpoint} ({args.protocol})")
    return 0
