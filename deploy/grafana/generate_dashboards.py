"""Writes the Grafana dashboards of deploy/grafana/dashboards/ from the tables below.

    python deploy/grafana/generate_dashboards.py          # rewrite the JSON files
    python deploy/grafana/generate_dashboards.py --check  # exit 1 if they are stale

The JSON files are what users import or provision; this script is only how they
are kept consistent (ids, grid positions, one selector per dashboard). Edit here,
run it, commit both. tests/test_deploy.py runs every PromQL expression of the JSON
files against a Prometheus that scraped a real spilling cluster.

Metric and label names are the Prometheus names of the bridge's instruments
(docs/metrics.md): dots become underscores, units and ``_total`` are appended, by
the bridge's own Prometheus reader and by the Collector's prometheus exporter
alike. ``job`` is the cluster: the scrape job name in pull mode, service.name
through a collector.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DASHBOARDS = HERE / "dashboards"

PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}
TEMPO = {"type": "tempo", "uid": "${tempo}"}
JAEGER = {"type": "jaeger", "uid": "${jaeger}"}

#: Label selector of one worker's series on the spill dashboard
WORKER = 'job="$cluster", dask_worker_name=~"$worker"'
CLUSTER = 'job="$cluster"'
#: The export-health series of spans (dask.otel.export.*, with dask.otel.signal)
SPANS = ', dask_otel_signal="spans"'


# --- building blocks ------------------------------------------------------------


def datasource_variable(name: str, plugin: str, label: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "datasource", "query": plugin,
        "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [],
        "includeAll": False, "multi": False,
    }


def query_variable(name: str, label: str, query: str, *, multi: bool = False) -> dict[str, Any]:
    variable: dict[str, Any] = {
        "name": name, "label": label, "type": "query", "datasource": PROMETHEUS,
        "query": query, "definition": query, "current": {}, "hide": 0,
        "refresh": 2, "regex": "", "sort": 1, "options": [],
        "includeAll": multi, "multi": multi,
    }
    if multi:
        variable["allValue"] = ".*"
    return variable


def target(expr: str, legend: str = "", *, instant: bool = False,
           exemplar: bool = False) -> dict[str, Any]:
    out = {
        "datasource": PROMETHEUS, "expr": expr, "legendFormat": legend,
        "range": not instant, "instant": instant, "editorMode": "code",
    }
    if exemplar:  # dask.activity.* and dask.workflow.*: a dot links to the trace
        out["exemplar"] = True
    return out


def timeseries(title: str, description: str, unit: str, targets: list[dict],
               *, stack: bool = False, overrides: list | None = None,
               min_max: tuple | None = None, **extra: Any) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
        "showPoints": "never", "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if min_max:
        defaults["min"], defaults["max"] = min_max
    return {
        "type": "timeseries", "title": title, "description": description,
        "datasource": PROMETHEUS, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        **extra,
    }


def range_bars(title: str, description: str, expr: str, legend: str, unit: str,
               **defaults: Any) -> dict[str, Any]:
    """Horizontal bars of one instant query over the dashboard's time range"""
    return {
        "type": "bargauge", "title": title, "description": description,
        "datasource": PROMETHEUS, "targets": [target(expr, legend, instant=True)],
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
        "options": {"orientation": "horizontal", "displayMode": "basic",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def rate(metric: str, selector: str, window: str = "$__rate_interval") -> str:
    return f"rate({metric}{{{selector}}}[{window}])"


def increase_from_zero(selector: str, window: str) -> str:
    """Increase over ``window`` of counters that appear with their first event:
    a series younger than the window counts its whole value, which increase()
    alone would miss (it needs two samples; dask.workflow.*, dask.worker.removed)"""
    return f"(({selector} unless {selector} offset {window}) or increase({selector}[{window}]))"


def per_worker(metric: str, selector: str) -> str:
    return f"sum by (dask_worker_name) ({rate(metric, selector)})"


def layout(panels: list[tuple[dict, int, int]]) -> list[dict]:
    """Give panels ids and grid positions: (panel, width, height), left to right,
    wrapping at 24 columns; rows take a full line."""
    out, x, y, line_height = [], 0, 0, 0
    for number, (panel, width, height) in enumerate(panels, start=1):
        if panel["type"] == "row" or x + width > 24:
            x, y, line_height = 0, y + line_height, 0
        panel = {"id": number, "gridPos": {"h": height, "w": width, "x": x, "y": y}, **panel}
        out.append(panel)
        if panel["type"] == "row":
            y += height
        else:
            x, line_height = x + width, max(line_height, height)
    return out


def dashboard(uid: str, title: str, description: str, variables: list[dict],
              panels: list[tuple[dict, int, int]]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description,
        "tags": ["dask", "dask-otel"], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "links": [{
            "type": "dashboards", "tags": ["dask-otel"], "title": "Dask dashboards",
            "asDropdown": False, "includeVars": True, "keepTime": True,
        }],
        "templating": {"list": variables},
        "panels": layout(panels),
    }


# --- Dask spill --------------------------------------------------------------------


def spill_dashboard() -> dict[str, Any]:
    threshold_style = {
        "matcher": {"id": "byRegexp", "options": ".*threshold"},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.lineWidth", "value": 2},
        ],
    }
    memory_vs_disk = timeseries(
        "Memory vs disk: $worker",
        "Managed data of the worker: what is in memory, what is spilled (its size in "
        "memory, and the bytes it takes on disk), against the worker's target and "
        "spill thresholds. Dask spills when managed memory passes the target, and "
        "when the process memory (RSS, not drawn here) passes the spill threshold.",
        "bytes",
        [
            target(f"sum by (dask_worker_name) (dask_spill_memory_size_bytes{{{WORKER}}})", "in memory"),
            target(f"sum by (dask_worker_name) (dask_spill_disk_memory_size_bytes{{{WORKER}}})",
                   "spilled (size in memory)"),
            target(f"sum by (dask_worker_name) (dask_spill_disk_size_bytes{{{WORKER}}})", "on disk"),
            target(
                "max by (dask_worker_name, dask_threshold) "
                f'(dask_memory_threshold_bytes{{{WORKER}, dask_threshold=~"target|spill"}})',
                "{{dask_threshold}} threshold",
            ),
        ],
        overrides=[threshold_style],
        repeat="worker", repeatDirection="h", maxPerRow=2,
    )
    keys = timeseries(
        "Keys in memory and on disk",
        "Number of keys each worker holds in memory and has spilled to disk.",
        "short",
        [
            target(f"sum by (dask_worker_name) (dask_spill_memory_keys{{{WORKER}}})",
                   "{{dask_worker_name}} in memory"),
            target(f"sum by (dask_worker_name) (dask_spill_disk_keys{{{WORKER}}})",
                   "{{dask_worker_name}} on disk"),
        ],
    )
    spill_rate = timeseries(
        "Spill and unspill rate",
        "Bytes written to disk (spill) and read back from disk (unspill) per second.",
        "Bps",
        [
            target(per_worker("dask_spill_size_bytes_total", f'{WORKER}, dask_activity_name="disk-write"'),
                   "{{dask_worker_name}} spill"),
            target(per_worker("dask_spill_size_bytes_total", f'{WORKER}, dask_activity_name="disk-read"'),
                   "{{dask_worker_name}} unspill"),
        ],
    )
    keys_rate = timeseries(
        "Keys spilled and unspilled per second",
        "Keys written to disk and read back from disk per second.",
        "ops",
        [
            target(per_worker("dask_spill_count_total", f'{WORKER}, dask_activity_name="disk-write"'),
                   "{{dask_worker_name}} spilled"),
            target(per_worker("dask_spill_count_total", f'{WORKER}, dask_activity_name="disk-read"'),
                   "{{dask_worker_name}} unspilled"),
        ],
    )

    def per_key(activity: str, per: str) -> str:
        seconds = per_worker("dask_spill_time_seconds_total", f'{WORKER}, dask_activity_name="{activity}"')
        keys = per_worker("dask_spill_count_total", f'{WORKER}, dask_activity_name="{per}"')
        return f"{seconds} / {keys}"

    time_per_key = timeseries(
        "Time per key: serialize and disk",
        "Seconds per key spilled (serialize, disk write) and unspilled (disk read, "
        "deserialize). Empty where no key moved in the interval.",
        "s",
        [
            target(per_key("serialize", "disk-write"), "{{dask_worker_name}} serialize"),
            target(per_key("disk-write", "disk-write"), "{{dask_worker_name}} disk write"),
            target(per_key("disk-read", "disk-read"), "{{dask_worker_name}} disk read"),
            target(per_key("deserialize", "disk-read"), "{{dask_worker_name}} deserialize"),
        ],
    )

    def read_ratio(metric: str) -> str:
        from_memory = per_worker(metric, f'{WORKER}, dask_activity_name="memory-read"')
        read = per_worker(metric, f'{WORKER}, dask_activity_name=~"memory-read|disk-read"')
        return f"{from_memory} / {read}"

    memory_read_ratio = timeseries(
        "Memory-read ratio",
        "Share of the keys (and bytes) read from a worker's data that were in memory "
        "rather than on disk: Dask's cache hit ratio. Low means the worker keeps "
        "unspilling what it just spilled.",
        "percentunit",
        [
            target(read_ratio("dask_spill_count_total"), "{{dask_worker_name}} by keys"),
            target(read_ratio("dask_spill_size_bytes_total"), "{{dask_worker_name}} by bytes"),
        ],
        min_max=(0, 1),
    )
    return dashboard(
        "dask-otel-spill", "Dask spill",
        "SpillBuffer of every worker of a Dask cluster, exported by dask_otel",
        [
            datasource_variable("datasource", "prometheus", "Prometheus"),
            query_variable("cluster", "Cluster", "label_values(dask_memory_threshold_bytes, job)"),
            query_variable("worker", "Worker",
                           f"label_values(dask_memory_threshold_bytes{{{CLUSTER}}}, dask_worker_name)",
                           multi=True),
        ],
        [
            (row("Managed memory, per worker"), 24, 1),
            (memory_vs_disk, 12, 9),
            (row("Spilling"), 24, 1),
            (spill_rate, 12, 8), (keys_rate, 12, 8),
            (time_per_key, 12, 8), (memory_read_ratio, 12, 8),
            (keys, 24, 7),
        ],
    )


# --- Dask spans --------------------------------------------------------------------

SPAN_ID_HELP = """\
Paste a Dask span id into **span_id** above: the value bound by
`with distributed.span("name") as span_id:`, or the `dask.span.id` attribute of
any span the bridge exported. The two panels below find the trace that holds that
span in Tempo and in Jaeger; click its trace id to open it.

Every root Dask span is one trace, and its trace id is its span id without the
dashes, so a root span can also be opened directly: Tempo's or Jaeger's search by
trace id takes `${span_id}` with the `-` removed.
"""


def tempo_table(title: str, description: str, traceql: str) -> dict[str, Any]:
    return {
        "type": "table", "title": title, "description": description, "datasource": TEMPO,
        "targets": [{"datasource": TEMPO, "queryType": "traceql", "query": traceql,
                     "limit": 20, "tableType": "traces"}],
        "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True},
    }


def spans_dashboard() -> dict[str, Any]:
    execute = f'{CLUSTER}, dask_activity_context="execute", dask_task_prefix=~"$prefix"'
    by_prefix = timeseries(
        "Task execution time by prefix and activity",
        "Seconds per second that worker threads spent running tasks, by task prefix "
        "and activity (thread-cpu, thread-noncpu, executor, disk-read, "
        "deserialize...): Dask's fine performance metrics, summed over the cluster.",
        "s",
        [target(f"sum by (dask_task_prefix, dask_activity_name) "
                f"({rate('dask_activity_time_seconds_total', execute)})",
                "{{dask_task_prefix}} {{dask_activity_name}}", exemplar=True)],
        stack=True,
    )
    by_context = timeseries(
        "Time by context and activity",
        "All the time workers account for: running tasks (execute), fetching task "
        "inputs from other workers (gather-dep), serving them (get-data), P2P "
        "shuffles (p2p).",
        "s",
        [target(f"sum by (dask_activity_context, dask_activity_name) "
                f"({rate('dask_activity_time_seconds_total', CLUSTER)})",
                "{{dask_activity_context}} {{dask_activity_name}}", exemplar=True)],
        stack=True,
    )
    bytes_by_context = timeseries(
        "Bytes by context and activity",
        "Bytes workers read from memory or disk, wrote to disk, or sent over the "
        "network, per second.",
        "Bps",
        [target(f"sum by (dask_activity_context, dask_activity_name) "
                f"({rate('dask_activity_size_bytes_total', CLUSTER)})",
                "{{dask_activity_context}} {{dask_activity_name}}", exemplar=True)],
        stack=True,
    )
    operations_by_context = timeseries(
        "Operations by context and activity",
        "Keys read from memory or disk, keys written to disk, transfers..., per second.",
        "ops",
        [target(f"sum by (dask_activity_context, dask_activity_name) "
                f"({rate('dask_activity_count_total', CLUSTER)})",
                "{{dask_activity_context}} {{dask_activity_name}}", exemplar=True)],
        stack=True,
    )
    top_prefixes = range_bars(
        "Task prefixes by time spent (whole range)",
        "Thread seconds per task prefix over the dashboard's time range.",
        "sort_desc(sum by (dask_task_prefix) "
        f"(increase(dask_activity_time_seconds_total{{{execute}}}[$__range])))",
        "{{dask_task_prefix}}", "s",
    )
    export_rates = timeseries(
        "Spans mirrored, sampled out, exported, dropped",
        "Per second: Dask spans and TaskGroups the bridge handed to the OpenTelemetry "
        "SDK, those the sampler dropped (OTEL_TRACES_SAMPLER), spans each exporter "
        "delivered, spans lost after the SDK's retries (or before the SDK: queue_full, "
        "a poll finished more than the bridge's builder queue holds), and failed export "
        "requests.",
        "ops",
        [
            target(f"sum({rate('dask_otel_span_mirrored_total', CLUSTER)})", "mirrored"),
            target(f"sum({rate('dask_otel_span_sampled_out_total', CLUSTER)})", "sampled out"),
            target(f"sum by (dask_otel_exporter) "
                   f"({rate('dask_otel_export_items_total', CLUSTER + SPANS)})",
                   "exported by {{dask_otel_exporter}}"),
            target(f"sum by (dask_otel_exporter, error_type) "
                   f"({rate('dask_otel_export_dropped_total', CLUSTER + SPANS)})",
                   "dropped by {{dask_otel_exporter}}{{error_type}}"),
            target(f"sum by (dask_otel_exporter) ({rate('dask_otel_export_failures_total', CLUSTER)})",
                   "failed requests of {{dask_otel_exporter}}"),
        ],
    )
    undelivered = timeseries(
        "Spans not yet delivered",
        "Spans handed to the SDK that an exporter has neither delivered nor given up "
        "on: queued in the batch processor, or dropped because its queue was full.",
        "short",
        # the scheduler's process only (on its instance): the workers' task spans
        # pass their own exporters
        [target(
            f"sum by (dask_otel_exporter) (sum by (instance) (dask_otel_span_mirrored_total{{{CLUSTER}}})"
            f" - on (instance) group_right sum by (instance, dask_otel_exporter)"
            f" (dask_otel_export_items_total{{{CLUSTER + SPANS}}})"
            f" - on (instance, dask_otel_exporter) sum by (instance, dask_otel_exporter)"
            f" (dask_otel_export_dropped_total{{{CLUSTER + SPANS}}}))",
            "{{dask_otel_exporter}}")],
    )
    volume = timeseries(
        "Export volume",
        "Per second, by signal: bytes of the OTLP requests the collector accepted "
        "(before compression), and the spans, metric points and log records in them, "
        "of every exporter of every process of the cluster (docs/deploy.md, Volume).",
        "Bps",
        [target(f"sum by (dask_otel_signal) ({rate('dask_otel_export_size_bytes_total', CLUSTER)})",
                "{{dask_otel_signal}} bytes"),
         target(f"sum by (dask_otel_signal) ({rate('dask_otel_export_items_total', CLUSTER)})",
                "{{dask_otel_signal}} items")],
    )
    help_text = {
        "type": "text", "title": "From a Dask span id to its trace",
        "options": {"mode": "markdown", "content": SPAN_ID_HELP},
    }
    jaeger_search = {
        "type": "table", "title": "Trace of Dask span $span_id (Jaeger)",
        "description": "Jaeger's search for spans of service $cluster whose "
                       "dask.span.id is the pasted id.",
        "datasource": JAEGER,
        "targets": [{"datasource": JAEGER, "queryType": "search", "service": "$cluster",
                     "tags": 'dask.span.id="$span_id"', "limit": 20}],
        "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True},
    }
    return dashboard(
        "dask-otel-spans", "Dask spans",
        "Fine performance metrics, span export health, and links from Dask spans to "
        "their traces, exported by dask_otel",
        [
            datasource_variable("datasource", "prometheus", "Prometheus"),
            query_variable("cluster", "Cluster",
                           "label_values(dask_activity_time_seconds_total, job)"),
            query_variable(
                "prefix", "Task prefix",
                f'label_values(dask_activity_time_seconds_total{{{CLUSTER}, '
                f'dask_activity_context="execute"}}, dask_task_prefix)',
                multi=True),
            datasource_variable("tempo", "tempo", "Tempo"),
            datasource_variable("jaeger", "jaeger", "Jaeger"),
            {"name": "span_id", "label": "Dask span id", "type": "textbox",
             "query": "", "current": {"text": "", "value": ""}, "hide": 0,
             "options": []},
        ],
        [
            (row("Fine performance metrics"), 24, 1),
            (by_prefix, 24, 9),
            (by_context, 12, 8), (bytes_by_context, 12, 8),
            (operations_by_context, 12, 8), (top_prefixes, 12, 8),
            (row("Span export"), 24, 1),
            (export_rates, 12, 8), (undelivered, 12, 8),
            (volume, 24, 8),
            (row("Traces"), 24, 1),
            (help_text, 8, 9),
            (tempo_table("Recent traces of $cluster (Tempo)",
                         "Traces whose spans come from service $cluster.",
                         '{ resource.service.name = "$cluster" }'), 16, 9),
            (tempo_table("Trace of Dask span $span_id (Tempo)",
                         "The trace holding the span whose dask.span.id is the pasted id.",
                         '{ span.dask.span.id = "$span_id" }'), 12, 8),
            (jaeger_search, 12, 8),
        ],
    )


# --- Dask workflows -------------------------------------------------------------

#: Runs of the chosen workflows (dask.workflow.*: one point per run of a root
#: Dask span, recorded by the scheduler; names not declared bounded are `other`)
WORKFLOW = 'job="$cluster", dask_workflow_name=~"$workflow"'
#: Window of the duration percentiles: workflows run seldom, a percentile needs
#: the runs of a while
DURATION_WINDOW = "1h"


def workflows_dashboard() -> dict[str, Any]:
    active = timeseries(
        "Runs open now",
        "Runs of each workflow open now: from their first graph until their root span "
        "is finished (the export delay after their last task). A run's trace opens from "
        "its \"run started\" log record before its root span arrives.",
        "short",
        [target(f"sum by (dask_workflow_name) (dask_workflow_active{{{WORKFLOW}}})",
                "{{dask_workflow_name}}")],
        stack=True,
    )
    tasks = timeseries(
        "Tasks of the open runs, by state",
        "Dask's progress bar per workflow: the tasks of its open runs in each state "
        "(waiting, queued, processing, memory, erred, released, forgotten...), as Dask's "
        "Span.states counts them over each run's span tree.",
        "short",
        [target(f"sum by (dask_workflow_name, dask_task_state) (dask_workflow_tasks{{{WORKFLOW}}})",
                "{{dask_workflow_name}} {{dask_task_state}}")],
        stack=True,
    )
    runs = timeseries(
        "Runs by result",
        "Runs of each workflow that ended in each interval, by result: ok, erred, "
        "cancelled.",
        "short",
        [target(f"sum by (dask_workflow_name, dask_workflow_result) "
                f"{increase_from_zero(f'dask_workflow_runs_total{{{WORKFLOW}}}', '$__rate_interval')}",
                "{{dask_workflow_name}} {{dask_workflow_result}}")],
        stack=True,
    )
    runs_in_range = range_bars(
        "Runs in the time range, by result",
        "Runs of each workflow over the dashboard's time range.",
        "sort_desc(sum by (dask_workflow_name, dask_workflow_result) "
        f"{increase_from_zero(f'dask_workflow_runs_total{{{WORKFLOW}}}', '$__range')})",
        "{{dask_workflow_name}} {{dask_workflow_result}}", "short", decimals=0,
    )

    def quantile(q: float) -> dict[str, Any]:
        selector = f'dask_workflow_duration_seconds_bucket{{{WORKFLOW}, dask_workflow_result="ok"}}'
        buckets = f"sum by (dask_workflow_name, le) {increase_from_zero(selector, DURATION_WINDOW)}"
        return target(f"histogram_quantile({q}, {buckets})",
                      f"{{{{dask_workflow_name}}}} p{round(q * 100)}", exemplar=True)

    durations = timeseries(
        "Duration of ok runs: percentiles",
        f"Median, 90th and 99th percentile of the ok runs that ended in the "
        f"{DURATION_WINDOW} before each point, within the histogram's buckets. The "
        "dots are exemplars: one run each, linked to its trace.",
        "s",
        [quantile(0.5), quantile(0.9), quantile(0.99)],
    )
    mean_duration = timeseries(
        "Mean duration by result",
        f"Mean duration of the runs that ended in the {DURATION_WINDOW} before each "
        "point, ok and erred apart: an erred run that failed early is fast.",
        "s",
        [target(
            f"sum by (dask_workflow_name, dask_workflow_result) "
            f"{increase_from_zero(f'dask_workflow_duration_seconds_sum{{{WORKFLOW}}}', DURATION_WINDOW)}"
            f" / sum by (dask_workflow_name, dask_workflow_result) "
            f"{increase_from_zero(f'dask_workflow_duration_seconds_count{{{WORKFLOW}}}', DURATION_WINDOW)}",
            "{{dask_workflow_name}} {{dask_workflow_result}}")],
    )
    removed = timeseries(
        "Workers removed, by reason",
        "Workers that left the cluster in each interval: restarted by their nanny "
        "for memory (memory_restart), failed hard (fail_hard), retired or scaled "
        "down (retired), closed (closed), or lost without a word (lost).",
        "short",
        [target(f"sum by (dask_worker_removed_reason) "
                f"{increase_from_zero(f'dask_worker_removed_total{{{CLUSTER}}}', '$__rate_interval')}",
                "{{dask_worker_removed_reason}}")],
        stack=True,
    )
    removed_in_range = range_bars(
        "Workers removed in the time range, by reason",
        "Workers that left the cluster over the dashboard's time range.",
        "sort_desc(sum by (dask_worker_removed_reason) "
        f"{increase_from_zero(f'dask_worker_removed_total{{{CLUSTER}}}', '$__range')})",
        "{{dask_worker_removed_reason}}", "short", decimals=0,
    )
    return dashboard(
        "dask-otel-workflows", "Dask workflows",
        "What runs now, did each workflow run, did it fail, is it slow, and which "
        "workers left: recorded by dask_otel while a run is open and once it ends",
        [
            datasource_variable("datasource", "prometheus", "Prometheus"),
            # The scheduler's own series: every cluster with the bridge has them,
            # whether or not a workflow ran
            query_variable("cluster", "Cluster", "label_values(dask_otel_span_mirrored_total, job)"),
            query_variable("workflow", "Workflow",
                           f"label_values(dask_workflow_runs_total{{{CLUSTER}}}, dask_workflow_name)",
                           multi=True),
        ],
        [
            (row("Running now"), 24, 1),
            (active, 8, 8), (tasks, 16, 8),
            (row("Runs"), 24, 1),
            (runs, 16, 8), (runs_in_range, 8, 8),
            (durations, 12, 8), (mean_duration, 12, 8),
            (row("Workers"), 24, 1),
            (removed, 16, 8), (removed_in_range, 8, 8),
        ],
    )


def render() -> dict[str, str]:
    return {
        "dask-spill.json": json.dumps(spill_dashboard(), indent=2) + "\n",
        "dask-spans.json": json.dumps(spans_dashboard(), indent=2) + "\n",
        "dask-workflows.json": json.dumps(workflows_dashboard(), indent=2) + "\n",
    }


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, text in render().items():
        path = DASHBOARDS / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    if check and stale:
        print(f"stale: {', '.join(stale)}; run python {Path(__file__).as_posix()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
