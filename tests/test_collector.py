"""The OpenTelemetry Collector users copy from deploy/, run for real (docs/deploy.md).

- Every Collector config in deploy/ is read by the real Collector (``otelcol
  validate``), built by .ci/install-backends from .ci/otelcol-builder.yaml with
  exactly the components those configs name.
- The compose stack's pipeline, its endpoints moved to 127.0.0.1: ``dask
  scheduler``/``dask worker`` processes push OTLP to the Collector, which sends the
  traces to Jaeger (and to the harness receiver in Tempo's place) and serves the
  metrics on its ``prometheus`` exporter, in OpenMetrics; Prometheus 3 scrapes it
  with deploy/prometheus/collector.yml, the compose stack's flags and the shipped
  rules. Every dashboard query returns data, every alert rule evaluates and stays
  quiet, and the exemplars the panels ask for lead to traces Jaeger holds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.support.backends import (
    BackendError,
    CollectorServer,
    JaegerServer,
    PrometheusServer,
    collector_validate,
    require_backend,
)
from tests.support.deploy_checks import (
    COLLECTOR_CONFIGS,
    COMPOSE,
    DEPLOY,
    SCRAPE_INTERVAL,
    SPILL_ENV,
    WORKER_ARGS,
    ScrapedRun,
    dashboards,
    every_dashboard_problem,
    exemplar_problems,
    load_workload,
    resolve_variables,
    rule_problems,
    run_workload,
    shipped_scrape_config,
    workload_pythonpath,
)
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.span_tree import assert_span_tree

COMPOSE_COLLECTOR = DEPLOY / "compose" / "otel-collector.yaml"
KINDS = ("receivers", "processors", "exporters", "extensions", "connectors")


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_real_collector_accepts_every_config_in_deploy(path):
    collector_validate(path)


def test_the_real_collector_rejects_a_setting_it_does_not_know(tmp_path):
    """What the check above catches, and a schema of our own would not: a misspelt
    setting of the prometheus exporter"""
    config = yaml.safe_load(COMPOSE_COLLECTOR.read_text())
    config["exporters"]["prometheus"]["add_metric_suffix"] = True
    path = tmp_path / "misspelt.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(BackendError, match="add_metric_suffix"):
        collector_validate(path)


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_collector_runs_every_config_without_a_deprecation(path):
    """A config users copy names each component by its current name: the Collector
    warns at start about a deprecated one (the ``otlp`` exporter became ``otlp_grpc``
    after core v0.140), which a later release removes"""
    exporters = [name for name, exporter in yaml.safe_load(path.read_text())["exporters"].items()
                 if not exporter["endpoint"].startswith("0.0.0.0:")]  # the ones that send
    assert exporters
    with OTLPReceiver("grpc") as backend, CollectorServer(
        path, {name: backend.endpoint for name in exporters}
    ) as collector:
        log = collector.log()
    assert "Everything is ready" in log
    assert [line for line in log.splitlines() if "deprecated" in line.lower()] == []


def test_the_collector_is_built_with_exactly_the_components_deploy_names():
    out = subprocess.run([require_backend("otelcol-dask"), "components"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    built = {kind: {c["name"] for c in yaml.safe_load(out).get(kind) or []} for kind in KINDS}
    named: dict[str, set[str]] = {kind: set() for kind in KINDS}
    for path in COLLECTOR_CONFIGS:
        config = yaml.safe_load(path.read_text())
        for kind in KINDS:
            named[kind] |= {name.split("/")[0] for name in config.get(kind) or {}}
    assert built == named


# =============================================================================
# The compose pipeline: bridge > Collector > Jaeger, and > Prometheus 3
# =============================================================================

#: The tests of the one pipeline run, in one test process (pytest-xdist)
ON_THE_PIPELINE = pytest.mark.xdist_group("collector-pipeline")


class PipelineRun(ScrapedRun):
    jaeger: JaegerServer
    collector: CollectorServer
    roots: list[str]


def compose_prometheus_flags() -> list[str]:
    command = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["command"]
    return [arg for arg in command if arg.startswith("--enable-feature=")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Iterator[PipelineRun]:
    with JaegerServer() as jaeger, OTLPReceiver("grpc") as tempo, CollectorServer(
        COMPOSE_COLLECTOR, {"otlp_grpc/jaeger": jaeger.otlp_grpc_endpoint, "otlp_grpc/tempo": tempo.endpoint}
    ) as collector:
        prometheus = PrometheusServer([], binary=require_backend("prometheus"),
                                      extra_args=compose_prometheus_flags())
        prometheus.config = shipped_scrape_config(
            "collector.yml", tmp_path_factory.mktemp("rules"), [collector.prometheus_exporter])
        # What the compose stack's Dask services get, with the Collector's address here.
        # The Collector's prometheus exporter serves a histogram point's exemplars
        # only until that series' next export, so Prometheus must scrape at least as
        # often as the SDK exports (docs/deploy.md, "Exemplars"): the compose stack's
        # one to one. With the fast tests' 0.5 s against a 1 s scrape, each exemplar
        # had even odds of being missed
        env = {"OTEL_SERVICE_NAME": "dask", "OTEL_EXPORTER_OTLP_ENDPOINT": collector.otlp_grpc_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_METRIC_EXPORT_INTERVAL": str(round(1000 * SCRAPE_INTERVAL)),
               **SPILL_ENV, **workload_pythonpath()}
        with prometheus, dask_processes(env, worker_args=WORKER_ARGS) as cluster, \
                cluster.client() as client:
            prometheus.wait_for_targets_up(timeout=30)
            time.sleep(2 * SCRAPE_INTERVAL)
            start = time.time()
            roots = run_workload(cluster, client)
            info = client.scheduler_info()
            run = PipelineRun(prometheus, job="dask", start=start, end=time.time(), receiver=tempo,
                              workers=sorted(w["name"] for w in info["workers"].values()))
            run.jaeger, run.collector, run.roots = jaeger, collector, roots
            yield run


@ON_THE_PIPELINE
def test_every_dashboard_query_returns_data_through_the_collector(pipeline):
    problems = every_dashboard_problem(pipeline)
    assert not problems, "\n".join(problems)
    assert resolve_variables(pipeline, dashboards()["dask-spill.json"])["worker"] == pipeline.workers


@ON_THE_PIPELINE
def test_alert_rules_evaluate_and_stay_quiet_through_the_collector(pipeline):
    problems = rule_problems(pipeline)
    assert not problems, "\n".join(problems)


@ON_THE_PIPELINE
def test_exemplars_the_panels_ask_for_lead_to_traces_in_jaeger(pipeline):
    """The Collector serves exemplars in OpenMetrics, Prometheus 3 (the compose
    stack's flags) stores them, and each panel that asks for them gets some, whose
    trace Jaeger holds"""
    problems = exemplar_problems(pipeline, lambda trace_id: bool(pipeline.jaeger.trace(trace_id)))
    assert not problems, "\n".join(problems)


@ON_THE_PIPELINE
def test_each_rounds_trace_reaches_both_trace_stores_through_the_collector(pipeline):
    """Each round is one whole trace in Jaeger, and the otlp_grpc/tempo exporter got
    the same spans"""
    workload = load_workload()
    names = set(workload.SPAN_TREE) | {f"taskgroup/{group}" for group in workload.TASK_GROUPS}
    for root_id in pipeline.roots:
        trace_id = root_id.replace("-", "")
        spans = pipeline.jaeger.wait_for_trace(trace_id, count=len(names), timeout=30)
        assert_span_tree(spans, one_trace=True)
        assert sorted(s["name"] for s in spans) == sorted(names)

        def same_in_both(r: OTLPReceiver):
            tempo = sorted(s.span_id for s in r.spans() if s.trace_id == trace_id)
            return tempo == sorted(s["span_id"] for s in pipeline.jaeger.trace(trace_id))

        pipeline.receiver.wait_for(same_in_both, timeout=30)
