"""Every PromQL expression of the documents returns a series from a real Prometheus
that holds a real cluster's metrics.

The expressions are read from the README and docs/*.md: each fenced block marked
``promql`` holds one expression, or several, each after a ``#`` comment line (or a
blank line). A query added to the documents is tested without editing this file,
and one written as inline code instead fails
:func:`test_promql_is_written_in_promql_blocks`.

The cluster (``dask scheduler``/``dask worker`` processes) pushes its metrics over
OTLP to Prometheus 3 (docs/deploy.md "Prometheus 3, pushed to directly"; workers
restart, so they cannot be scrape targets) and does what the queries are about: the
compose workload's rounds (spills and unspills; a worker retired), a named workflow
that errs once, the scheduler's event loop blocked, a worker restarted by its nanny
past its memory limit, and a worker whose span queue overflows, its collector hung
(the SDK's own metrics on). An alert condition ending in ``> 0`` is run as ``> bool
0``: its series must exist before the first loss. Each expression must give a finite
value, not only zeros (but of a metric that stays 0 when healthy), and carry the
labels it groups by.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from distributed import KilledWorker, span, wait
from packaging.version import Version

import dask_otel
from tests.support.backends import (
    PROMETHEUS3_OTLP,
    PROMETHEUS3_OTLP_ARGS,
    JaegerServer,
    PrometheusServer,
    require_backend,
)
from tests.support.deploy_checks import (
    SPILL_ENV,
    WORKER_ARGS,
    ZERO_WHEN_HEALTHY,
    metric_names,
    run_workload,
    workload_pythonpath,
)
from tests.support.otlp_receiver import BlackHole
from tests.support.processes import dask_processes
from tests.support.tasks import allocate_past, fail, inc

#: The queries share one run: in one test process (pytest-xdist's loadgroup)
ON_THE_RUN = pytest.mark.xdist_group("doc-queries-run")
ROOT = Path(__file__).parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```promql\n(.*?)^```", re.S | re.M)


#: A query's comment that says it is 0 on a healthy cluster (the run is one)
HEALTHY_ZERO = "0 when healthy"


def documented_queries() -> list[tuple[str, str, bool]]:
    """``(document, expression, whether its comment says it is 0 when healthy)`` of
    every expression in a ``promql`` block"""
    queries = []
    for doc in DOCUMENTS:
        for block in BLOCK.findall(doc.read_text()):
            lines: list[str] = []
            comment = ""
            for line in [*block.splitlines(), ""]:
                if line.strip() and not line.lstrip().startswith("#"):
                    lines.append(line)
                    continue
                if lines:
                    queries.append((doc.name, "\n".join(lines), HEALTHY_ZERO in comment))
                    lines, comment = [], ""
                comment += line
    return queries


#: Inline code that reads as PromQL: a function over a range of a metric
INLINE_PROMQL = re.compile(r"`[^`\n]*\b[a-z_]+\([^`\n]*[a-z]+_[a-z_]+[^`\n]*\[\d+[smhdw]\][^`\n]*`")


def test_promql_is_written_in_promql_blocks():
    """The test below reads only ``promql`` blocks: no query hides in inline code"""
    inline = [f"{doc.name}: {m.group(0)}" for doc in DOCUMENTS
              for m in INLINE_PROMQL.finditer(BLOCK.sub("", doc.read_text()))]
    assert not inline, inline
    assert len(documented_queries()) >= 10


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[PrometheusServer]:
    prom = PrometheusServer([], binary=require_backend("prometheus"),
                            otlp=PROMETHEUS3_OTLP, extra_args=PROMETHEUS3_OTLP_ARGS)
    prom.config["scrape_configs"] = []
    with prom, JaegerServer() as jaeger, BlackHole() as hole:
        env = {"OTEL_SERVICE_NAME": "dask",
               "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_grpc_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": prom.otlp_endpoint + "/v1/metrics",
               "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
               "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true",
               # a 1.5 s block of the scheduler's loop is a blocked loop
               "DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": "1s",
               "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
               "DASK_OTEL__METRICS__LABELS": "team",
               **SPILL_ENV, **workload_pythonpath()}
        with dask_processes(env, worker_args=WORKER_ARGS) as cluster, cluster.client() as client:
            # spills and unspills, round after round (a rate needs work after a
            # series' first sample), and a worker retired
            run_workload(cluster, client)
            # a named workflow's run that erred, labelled (its team on the metrics)
            with dask_otel.span("nightly-etl", workflow=True, attributes={"team": "data"}):
                wait(client.submit(fail, 1))
            # the scheduler's event loop blocked
            client.run_on_scheduler(time.sleep, 1.5)
            # a worker its nanny restarts past its memory limit (500 MB)
            cluster.add_worker("restarted", nanny=True)
            # a worker whose span queue of 1 overflows: task spans to a hung collector
            cluster.add_worker("overflowing", env={
                "DASK_OTEL__TASKS__SPANS": "true", "OTEL_BSP_MAX_QUEUE_SIZE": "1",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": hole.endpoint})
            client.wait_for_workers(4, timeout=60)
            with span("overflow"):  # task spans are of tasks in a Dask span
                client.gather(client.map(inc, range(50), workers=["overflowing"],
                                         allow_other_workers=False))
            with pytest.raises(KilledWorker):
                client.submit(allocate_past, 500_000_000, workers=["restarted"],
                              allow_other_workers=False).result(timeout=120)
            yield prom


def alert_as_series(expr: str) -> str:
    """An alert condition ``... > 0`` as ``... > bool 0``: 0 or 1 for each series"""
    return re.sub(r"\s*>\s*0\s*$", " > bool 0", expr)


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
            for label in group.split(",")} - {"le", ""}


def problem(result: list[dict], expr: str, healthy_zero: bool = False) -> str | None:
    values = [float(r["value"][1]) for r in result]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return f"no series with a finite value: {result}"
    if not any(finite) and not healthy_zero and not ZERO_WHEN_HEALTHY & set(metric_names(expr)):
        return f"only zeros: {result}"
    missing = {label for r in result for label in grouping_labels(expr) - set(r["metric"])}
    return f"series without the labels grouped by: {missing}" if missing else None


@ON_THE_RUN
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "doc, expr, healthy_zero",
    documented_queries(),
    ids=[f"{doc}:{i}" for i, (doc, *_) in enumerate(documented_queries())],
)
def test_every_documented_query_returns_a_series(prometheus, doc, expr, healthy_zero):
    if "memory_restart" in expr and Version(version("distributed")) < Version("2024.4.2"):
        pytest.skip("distributed < 2024.4.2 sends no worker-restart-memory event (docs/events.md)")
    query = alert_as_series(expr)
    deadline = time.monotonic() + 60
    while (found := problem(prometheus.query(query), query, healthy_zero)) and time.monotonic() < deadline:
        time.sleep(1)
    assert found is None, f"{doc}: {query}\n{found}"
