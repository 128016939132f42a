"""Helpers for tests/test_deploy.py: reading what deploy/ ships, and checking it
without the services it is for (no Docker engine, no Kubernetes, no Grafana here).

- Grafana: the PromQL of every dashboard panel, and the template variables
  substituted the way Grafana does it for Prometheus.
- PromQL: the metric names and vector selectors an expression uses.
- OpenTelemetry Collector: the Prometheus name its prometheus exporter gives an
  OTLP metric, to compare the push path with the pull path.
- Environment variables, Dask CLI arguments and container images named by the
  compose file and the Kubernetes manifests.
- A run of the compose workload, and every dashboard query and alert rule against
  the Prometheus that holds its metrics, however they got there (scraped from the
  Dask servers, from a Collector, or pushed over OTLP).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.support.processes import REPO

DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
#: Every OpenTelemetry Collector config deploy/ ships
COLLECTOR_CONFIGS = [DEPLOY / "compose" / "otel-collector.yaml",
                     DEPLOY / "kubernetes" / "collector" / "otel-collector.yaml"]


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load_workload() -> ModuleType:
    """deploy/compose/workload.py, imported as ``workload``. Dask pickles task
    functions by reference: run clusters with :func:`workload_pythonpath` so that
    the scheduler and workers import it too."""
    if "workload" not in sys.modules:
        spec = importlib.util.spec_from_file_location("workload", DEPLOY / "compose" / "workload.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["workload"] = module
        spec.loader.exec_module(module)
    return sys.modules["workload"]


def workload_pythonpath() -> dict[str, str]:
    """PYTHONPATH for dask_processes: the repository (as it sets by default) and the
    workload's directory"""
    parts = [str(REPO), str(DEPLOY / "compose"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in parts if p)}


# --- Grafana ----------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    #: the target as written in the JSON
    target: Mapping[str, Any]

    @property
    def datasource_type(self) -> str:
        return (self.target.get("datasource") or {}).get("type", "")

    @property
    def expr(self) -> str:
        return self.target.get("expr", "")

    @property
    def instant(self) -> bool:
        return bool(self.target.get("instant")) and not self.target.get("range")

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel}"


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows


def panel_queries(name: str, dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(name, panel.get("title", f"panel {panel.get('id')}"), target)
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


#: Grafana's global variables that the dashboards may use
GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                    "__range_ms", "__dashboard", "__from", "__to")
VARIABLE = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")


def variable_names(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(text)}


def prometheus_regex_escape(value: str) -> str:
    """What Grafana's Prometheus data source does to a variable value that goes into
    a regex matcher: regex metacharacters get a backslash, itself escaped for the
    PromQL string"""
    return re.sub(r"([$^*{}\[\]'+?.()|\\])", r"\\\\\1", value)


def substitute(text: str, values: Mapping[str, str | list[str]],
               variable_defs: Mapping[str, Mapping[str, Any]]) -> str:
    """``text`` with Grafana's variables replaced: a multi-value or include-all
    variable as a regex alternation of escaped values (or its allValue for "All"),
    others as their value. Unknown variables raise KeyError."""

    def replace(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        value = values[name]
        definition = variable_defs.get(name, {})
        if not (definition.get("multi") or definition.get("includeAll")):
            return value if isinstance(value, str) else value[0]
        if value == ["$__all"]:
            return definition.get("allValue") or ".*"
        items = [value] if isinstance(value, str) else value
        escaped = [prometheus_regex_escape(v) for v in items]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return VARIABLE.sub(replace, text)


LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+),\s*)?(\w+)\s*\)\s*$", re.S)


def label_values_query(variable: Mapping[str, Any]) -> tuple[str | None, str]:
    """``(selector or None, label)`` of a ``label_values(...)`` query variable"""
    query = variable.get("query")
    if isinstance(query, Mapping):
        query = query.get("query", "")
    match = LABEL_VALUES.match(query or "")
    if not match:
        raise ValueError(f"variable {variable['name']}: not a label_values() query: {query!r}")
    return match.group(1), match.group(2)


# --- PromQL ------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "and", "or", "unless", "inf", "nan", "Inf", "NaN", "atan2"}


def metric_names(expr: str) -> list[str]:
    """Metric names an expression selects: identifiers that are not functions,
    aggregations, keywords, label names or inside strings"""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = []
    for match in _IDENTIFIER.finditer(text):
        name = match.group(1)
        if name in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.append(name)
    return names


def vector_selectors(expr: str) -> list[str]:
    """The vector selectors (``name{matchers}``) of an expression, each a valid
    query on its own"""
    out = []
    for name in dict.fromkeys(metric_names(expr)):
        for match in re.finditer(rf"(?<![\w:]){re.escape(name)}\s*(\{{[^}}]*\}})?", expr):
            out.append(name + (match.group(1) or ""))
    return list(dict.fromkeys(out))


# --- the Collector's prometheus exporter ------------------------------------------

#: OTLP units -> Prometheus unit words, as the Collector's translator maps them
#: (opentelemetry-collector-contrib pkg/translator/prometheus, normalize_name.go)
COLLECTOR_UNITS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
    "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tibibytes", "KBy": "kilobytes",
    "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes", "m": "meters",
    "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
COLLECTOR_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day",
                       "w": "week", "mo": "month", "y": "year"}


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^0-9A-Za-z]+", text) if t]


def collector_prometheus_name(name: str, unit: str, kind: str, monotonic: bool | None) -> str:
    """The name the Collector's prometheus exporter gives an OTLP metric with
    ``add_metric_suffixes: true`` (its default), following the Collector's
    ``normalizeName``: name tokens, the unit word unless the unit is an annotation
    in braces or already in the name, ``per_<unit>``, ``_total`` for monotonic
    sums, ``_ratio`` for gauges of unit 1."""
    tokens = _tokens(name)
    main, _, per = unit.partition("/")
    main = main.strip()
    if main and not re.search("[{}]", main):
        word = "_".join(_tokens(COLLECTOR_UNITS.get(main, main)))
        if word and word not in tokens:
            tokens.append(word)
    per = per.strip()
    if per and not re.search("[{}]", per):
        word = "_".join(_tokens(COLLECTOR_PER_UNITS.get(per, per)))
        if word and word not in tokens:
            tokens += ["per", word]
    if kind == "sum" and monotonic:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and kind == "gauge":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    out = "_".join(tokens)
    return "_" + out if out[:1].isdigit() else out


def prometheus_label(attribute: str) -> str:
    """An attribute key as a Prometheus label name (both exporters)"""
    label = re.sub(r"[^a-zA-Z0-9_]", "_", attribute)
    return "key_" + label if label[:1].isdigit() else label


# --- images, environment variables, CLI arguments -----------------------------------

#: An image reference with an explicit version tag: name:tag where the tag has a
#: digit and is not "latest"-like, optionally followed by @sha256 digest
PINNED_IMAGE = re.compile(r"^[a-z0-9./_-]+(:\d+)?(/[a-z0-9._-]+)*:(v?\d[\w.-]*)(@sha256:[0-9a-f]{64})?$")


def image_is_pinned(image: str) -> bool:
    return bool(PINNED_IMAGE.match(image)) and "latest" not in image.rsplit(":", 1)[-1]


def known_otel_variables() -> set[str]:
    """Every OTEL_* variable the OpenTelemetry Python SDK, API and exporters name"""
    import opentelemetry.environment_variables as api
    import opentelemetry.sdk.environment_variables as sdk

    return {
        value for module in (api, sdk) for key, value in vars(module).items()
        if key.startswith("OTEL_") and isinstance(value, str)
    }


def dask_config_key(variable: str) -> str | None:
    """The dask config key a DASK_* variable sets (``DASK_A__B_C`` -> ``a.b_c``)"""
    import dask.config

    if not variable.startswith("DASK_"):
        return None
    nested = dask.config.collect_env({variable: "x"})
    parts = []
    while isinstance(nested, dict) and nested:
        (key, nested), = nested.items()
        parts.append(key)
    return ".".join(parts)


def dask_config_key_exists(key: str) -> bool:
    import dask.config
    import distributed  # noqa: F401  (its defaults)

    import dask_otel  # noqa: F401  (the otel: defaults)

    try:
        dask.config.get(key, config=dask.config.merge(*dask.config.defaults))
    except KeyError:
        return False
    return True


@dataclass(frozen=True)
class ContainerEnv:
    """The environment one container of a deploy file gets"""

    where: str
    #: name -> literal value, or None when set from a valueFrom reference
    values: Mapping[str, str | None]
    #: names the container sets from valueFrom (the downward API...)
    from_references: frozenset[str] = frozenset()


def k8s_env(where: str, env: Iterable[Mapping[str, Any]] | None) -> ContainerEnv:
    values: dict[str, str | None] = {}
    refs = set()
    for item in env or []:
        if "valueFrom" in item:
            values[item["name"]] = None
            refs.add(item["name"])
        else:
            values[item["name"]] = str(item.get("value", ""))
    return ContainerEnv(where, values, frozenset(refs))


REFERENCE = re.compile(r"\$\((\w+)\)")


def resolved_env(env: ContainerEnv) -> dict[str, str]:
    """Literal values with Kubernetes' ``$(VAR)`` references to other variables
    replaced, and variables set from references given a placeholder"""
    out = {name: value if value is not None else f"<{name}>" for name, value in env.values.items()}
    return {name: REFERENCE.sub(lambda m: out.get(m.group(1), m.group(0)), value)
            for name, value in out.items()}


def check_dask_cli(args: list[str]) -> None:
    """Parse ``dask scheduler ...`` / ``dask worker ...`` (or the old dask-scheduler /
    dask-worker spelling) with distributed's own click commands, without running
    them. Raises click's UsageError/BadParameter on an unknown or bad option."""
    from distributed.cli import dask_scheduler, dask_worker

    if args[:2] in (["dask", "scheduler"], ["dask", "worker"]):
        command, rest = args[1], args[2:]
    elif args[0] in ("dask-scheduler", "dask-worker"):
        command, rest = args[0].removeprefix("dask-"), args[1:]
    else:
        raise ValueError(f"not a dask scheduler/worker command: {shlex.join(args)}")
    main = dask_scheduler.main if command == "scheduler" else dask_worker.main
    main.make_context(f"dask {command}", list(rest))


def dotted(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: what dask.config.set takes without
    replacing whole subtrees"""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, Mapping):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextlib.contextmanager
def otel_environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ with ``env``'s OTEL_* variables instead of the test process's
    (dask_otel.config.read_config reads the OTLP protocol from the environment)"""
    saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("OTEL_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[key]
        os.environ.update(saved)


# --- a run of the workload, and every dashboard query against it --------------------

#: How often the test Prometheus scrapes and evaluates rules, and the step of the
#: dashboards' range queries
SCRAPE_INTERVAL = 1.0
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
#: Workers that spill: 10 MB of managed memory each (2% of 500 MB), and a workload
#: of 20 x 4 MB chunks per round, so that even a worker that gets a third of them
#: spills. The spill and pause thresholds stay at their defaults (of process memory),
#: so that the dashboards' threshold lines exist.
SPILL_ENV = {"DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.02"}
WORKER_ARGS = ("--memory-limit", "500MB")
ROUNDS = 3
#: Metrics that stay at 0 in a healthy run: panels with them need data, not a
#: non-zero value
ZERO_WHEN_HEALTHY = {"dask_otel_export_dropped_total", "dask_otel_export_failures_total",
                     # zero unless OTEL_TRACES_SAMPLER drops traces; the run keeps all
                     "dask_otel_span_sampled_out_total"}


def shipped_scrape_config(name: str, rules: Path, targets: list[str] | None = None
                          ) -> dict[str, Any]:
    """deploy/prometheus/``name`` with a 1 s scrape interval, its one job's targets
    replaced by ``targets`` (None: no scrape job, for a Prometheus pushed to), and
    the shipped rule files, copied to ``rules`` with every group evaluated every
    second: a group that states a longer interval (days-long windows) would not be
    evaluated once during the run"""
    config = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_INTERVAL:g}s",
                            evaluation_interval=f"{SCRAPE_INTERVAL:g}s")
    for path in RULE_FILES:
        rule_file = yaml.safe_load(path.read_text())
        for group in rule_file["groups"]:
            group.pop("interval", None)
        (rules / path.name).write_text(yaml.safe_dump(rule_file))
    config["rule_files"] = [str(rules / Path(pattern).name) for pattern in config["rule_files"]]
    (job,) = config["scrape_configs"]
    if targets is None:
        config["scrape_configs"] = []
    else:
        job["static_configs"] = [{"targets": targets}]
    return config


def run_workload(cluster: Any, client: Any, settle: float = 3 * SCRAPE_INTERVAL) -> list[str]:
    """The compose workload, ROUNDS times, holding each round's chunks across
    scrapes (the gauges of keys on disk are sampled), each round's tasks forgotten
    before the next; then a worker retired, for the
    workflows dashboard's workers removed by reason (without the bridge in it, it
    has no worker series of its own); then ``settle`` seconds for the last export.
    Returns the rounds' root Dask span ids (their trace ids without dashes)."""
    workload = load_workload()
    n = len(client.scheduler_info()["workers"])
    roots = []
    for i in range(ROUNDS):
        roots.append(workload.run_round(client, chunks=20, chunk_bytes=4_000_000, seed=100 * i,
                                        hold=3 * SCRAPE_INTERVAL))
        # As the compose stack's rounds, 15 s apart: the round's tasks are forgotten
        # before the next one's arrive, else those join its TaskGroups, and its trace
        # (Dask attaches a TaskGroup to the span it was first submitted under)
        deadline = time.monotonic() + 30
        while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
            assert time.monotonic() < deadline, "the round's tasks were not forgotten"
            time.sleep(0.1)
    cluster.add_worker("retired", without_dask_otel=True)
    client.wait_for_workers(n + 1, timeout=60)
    client.retire_workers(names=["retired"])
    time.sleep(settle)
    return roots


@dataclass
class ScrapedRun:
    """What one run left behind: the Prometheus that holds its metrics, the
    ``job`` they carry (the dashboards' $cluster), the workers, and when it ran"""

    prometheus: Any
    job: str
    workers: list[str]
    start: float
    end: float
    #: what arrived over OTLP, where the run also sent it to the harness receiver
    receiver: Any = None

    def range_query(self, expr: str) -> list[dict[str, Any]]:
        return self.prometheus.query_range(expr, self.start, self.end, step=SCRAPE_INTERVAL)

    def builtins(self) -> dict[str, str]:
        seconds = math.ceil(self.end - self.start)
        return {
            # Grafana: max(4 x scrape interval, interval + scrape interval)
            "__rate_interval": f"{4 * SCRAPE_INTERVAL:g}s",
            "__interval": f"{SCRAPE_INTERVAL:g}s",
            "__interval_ms": str(int(SCRAPE_INTERVAL * 1000)),
            "__range": f"{seconds}s", "__range_s": str(seconds), "__range_ms": str(seconds * 1000),
        }

    def label_values(self, selector: str | None, label: str) -> list[str]:
        from tests.support.backends import http_get_json

        params: dict[str, Any] = {"start": self.start, "end": time.time()}
        if selector:
            params["match[]"] = selector
        body = http_get_json(f"{self.prometheus.url}/api/v1/label/{label}/values", params)
        return body["data"]


def resolve_variables(run: ScrapedRun, board: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every value Grafana would offer for each query variable, from the same
    Prometheus API calls Grafana makes; datasource variables are not needed"""
    values: dict[str, list[str]] = {}
    first = {**run.builtins()}
    for name, variable in variables(board).items():
        if variable["type"] != "query":
            continue
        selector, label = label_values_query(variable)
        if selector:
            selector = substitute(selector, {**first, **{k: v[0] for k, v in values.items()}},
                                  variables(board))
        found = run.label_values(selector, label)
        assert found, f"variable {name}: label_values({selector}, {label}) is empty"
        values[name] = found
    return values


def _finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = []
    for series in result:
        for sample in series.get("values") or [series.get("value")]:
            if sample and math.isfinite(float(sample[1])):
                values.append(float(sample[1]))
    return values


def evaluate_dashboard(run: ScrapedRun, name: str,
                       rewrite: Callable[[str], str] = lambda expr: expr) -> list[str]:
    """Problems of one dashboard's PromQL against the run, for every single value of
    each multi-value variable and for "All": an expression with no finite sample
    (with "All": no non-zero one, so that the panel shows the workload), or a
    selector in it that selects nothing. ``rewrite``: what a path that cannot use a
    query as written runs instead (docs/deploy.md says which)."""
    board = dashboards()[name]
    defs = variables(board)
    values = resolve_variables(run, board)
    assert values.get("cluster") == [run.job]
    settings = [{k: [v[0]] if not defs[k].get("multi") else ["$__all"] for k, v in values.items()}]
    for variable, options in values.items():
        if defs[variable].get("multi"):
            settings += [{**settings[0], variable: [option]} for option in options]
    problems, seen = [], set()
    for query in panel_queries(name, board):
        if query.datasource_type != "prometheus":
            continue
        may_be_zero = bool(ZERO_WHEN_HEALTHY & set(metric_names(query.expr)))
        for setting in settings:
            expr = rewrite(substitute(query.expr, {**run.builtins(), **setting}, defs))
            if expr in seen:
                continue
            seen.add(expr)
            result = (run.prometheus.query(expr, time=run.end) if query.instant
                      else run.range_query(expr))
            values = _finite_values(result)
            if not values:
                problems.append(f"{query}: no data from {expr}")
            elif setting is settings[0] and not may_be_zero and not any(values):
                problems.append(f"{query}: only zeros from {expr}")
            for selector in vector_selectors(expr):
                if not run.range_query(selector):
                    problems.append(f"{query}: {selector} selects nothing")
    return problems


def every_dashboard_problem(run: ScrapedRun, timeout: float = 30,
                            rewrite: Callable[[str], str] = lambda expr: expr) -> list[str]:
    """:func:`evaluate_dashboard` over every dashboard, again until no problem is left
    or ``timeout`` passed (the last export of the run may still be on its way)"""
    deadline = time.monotonic() + timeout
    while True:
        run.end = time.time()
        problems = [p for name in dashboards() for p in evaluate_dashboard(run, name, rewrite)]
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(2)


def rule_problems(run: ScrapedRun) -> list[str]:
    """Every shipped rule loaded, evaluated without error, and quiet on a healthy
    run (not even pending for the loss alerts)"""
    rules = [rule for group in run.prometheus.rules() for rule in group["rules"]]
    shipped = sum(len(g["rules"]) for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"])
    problems = [] if len(rules) == shipped else [f"{len(rules)} rules loaded of {shipped}"]
    problems += [f"{rule['name']}: {rule['health']} {rule.get('lastError')}" for rule in rules
                 if rule["health"] != "ok"]
    alerts = run.prometheus.alerts()
    problems += [f"firing: {a['labels']}" for a in alerts if a["state"] == "firing"]
    problems += [f"pending: {a['labels']}" for a in alerts if a["labels"]["alertname"] in
                 {"DaskOtelSpansDropped", "DaskOtelSpanExportFailing"}]
    return problems


def exemplar_problems(run: ScrapedRun, has_trace: Callable[[str], bool]) -> list[str]:
    """Each panel that asks for exemplars (``"exemplar": true``) gets some from
    Prometheus (``/api/v1/query_exemplars``, what Grafana calls, with "All" for each
    variable), and each one's ``trace_id`` (the label Grafana's data source links to
    the trace store) is a trace ``has_trace`` finds"""
    from tests.support.backends import http_get_json

    problems, asked = [], 0
    for name, board in dashboards().items():
        defs = variables(board)
        values = resolve_variables(run, board)
        setting = {k: ["$__all"] if defs[k].get("multi") else [v[0]] for k, v in values.items()}
        for query in panel_queries(name, board):
            if not query.target.get("exemplar"):
                continue
            asked += 1
            expr = substitute(query.expr, {**run.builtins(), **setting}, defs)
            found = http_get_json(f"{run.prometheus.url}/api/v1/query_exemplars", {
                "query": expr, "start": run.start, "end": time.time()})["data"]
            trace_ids = {e["labels"].get("trace_id") for s in found for e in s["exemplars"]}
            if not trace_ids:
                problems.append(f"{query}: no exemplar for {expr}")
            problems += [f"{query}: exemplar trace {t} not in the trace store"
                         for t in trace_ids if not (t and has_trace(t))]
    return problems if asked else ["no panel asks for exemplars"]
