"""Prometheus 3, pushed to directly: the bridge's OTLP metrics straight to its OTLP
receiver, no Collector (docs/deploy.md "Prometheus 3, pushed to directly").

``dask scheduler``/``dask worker`` processes run the compose workload and push their
metrics over OTLP/HTTP to a real Prometheus 3 (built by .ci/install-backends) run with
the settings docs/deploy.md gives (``PROMETHEUS3_OTLP_ARGS``, the ``otlp:`` section
``PROMETHEUS3_OTLP``) and the shipped alert rules, their traces over OTLP/gRPC to
Jaeger, as a user of this path sends them. Every dashboard query returns data as
written, every rule evaluates and stays quiet, and the exemplars the panels ask for
lead to traces in Jaeger.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from distributed import Event, span

from tests.support.backends import (
    PROMETHEUS3_OTLP,
    PROMETHEUS3_OTLP_ARGS,
    JaegerServer,
    PrometheusServer,
    require_backend,
)
from tests.support.deploy_checks import (
    SCRAPE_INTERVAL,
    SPILL_ENV,
    WORKER_ARGS,
    ScrapedRun,
    dashboards,
    every_dashboard_problem,
    exemplar_problems,
    panel_queries,
    resolve_variables,
    rule_problems,
    run_workload,
    shipped_scrape_config,
    substitute,
    variables,
    workload_pythonpath,
)
from tests.support.processes import dask_processes
from tests.support.tasks import wait_for_event

ON_THE_PUSHED_RUN = pytest.mark.xdist_group("prometheus3-pushed-run")


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory) -> Iterator[ScrapedRun]:
    prometheus = PrometheusServer([], binary=require_backend("prometheus"),
                                  otlp=PROMETHEUS3_OTLP, extra_args=PROMETHEUS3_OTLP_ARGS)
    # The shipped rules; nothing to scrape
    otlp, storage = prometheus.config["otlp"], prometheus.config["storage"]
    prometheus.config = shipped_scrape_config("collector.yml", tmp_path_factory.mktemp("rules"))
    prometheus.config.update(otlp=otlp, storage=storage)
    with prometheus, JaegerServer() as jaeger:
        # Metrics to Prometheus (OTLP/HTTP only), traces to Jaeger
        env = {"OTEL_SERVICE_NAME": "dask",
               "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_grpc_endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": prometheus.otlp_endpoint + "/v1/metrics",
               "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
               **SPILL_ENV, **workload_pythonpath()}
        with dask_processes(env, worker_args=WORKER_ARGS) as cluster, cluster.client() as client:
            prometheus.wait_for_query('count(dask_spill_memory_keys{job="dask"})', timeout=60)
            start = time.time() - 2 * SCRAPE_INTERVAL
            run_workload(cluster, client)
            info = client.scheduler_info()
            run = ScrapedRun(prometheus, job="dask", start=start, end=time.time(),
                             workers=sorted(w["name"] for w in info["workers"].values()))
            run.jaeger, run.client = jaeger, client
            yield run


@ON_THE_PUSHED_RUN
def test_every_dashboard_query_returns_data_pushed_over_otlp(pushed_run):
    problems = every_dashboard_problem(pushed_run)
    assert not problems, "\n".join(problems)
    assert resolve_variables(pushed_run, dashboards()["dask-spill.json"])["worker"] == pushed_run.workers


@ON_THE_PUSHED_RUN
def test_alert_rules_evaluate_and_stay_quiet_on_pushed_metrics(pushed_run):
    problems = rule_problems(pushed_run)
    assert not problems, "\n".join(problems)


@ON_THE_PUSHED_RUN
def test_job_and_instance_come_from_the_resource_as_through_a_collector(pushed_run):
    """service.name is `job` (the dashboards' $cluster), service.instance.id is
    `instance`, one per Dask process; the rest of the resource is on target_info"""
    prom = pushed_run.prometheus
    instances = prom.query('count by (instance) (dask_spill_memory_keys{job="dask"})',
                           time=pushed_run.end)
    assert len(instances) == len(pushed_run.workers)
    info = prom.query('target_info{job="dask"}', time=pushed_run.end)
    assert {r["metric"]["instance"] for r in instances} <= {r["metric"]["instance"] for r in info}
    assert all("dask_scheduler_address" in r["metric"] for r in info)


@ON_THE_PUSHED_RUN
def test_exemplars_pushed_over_otlp_lead_to_traces_in_jaeger(pushed_run):
    problems = exemplar_problems(pushed_run, lambda t: bool(pushed_run.jaeger.trace(t)))
    assert not problems, "\n".join(problems)


#: The panels of a run that is open now (issue 39)
RUNNING_NOW = ("Runs open now", "Tasks of the open runs, by state")


@ON_THE_PUSHED_RUN
def test_the_running_now_panels_show_a_run_while_it_is_open(pushed_run):
    """A run held open by a task blocked on a distributed.Event: each query of the
    "Running now" panels (every variable "All") returns a series with a non-zero value
    at a moment while it is open, its workflow among them, and the open run counted"""
    board = dashboards()["dask-workflows.json"]
    queries = [q for q in panel_queries("dask-workflows.json", board) if q.panel in RUNNING_NOW]
    assert len(queries) == len(RUNNING_NOW)
    setting = {"cluster": ["dask"], "workflow": ["$__all"], **pushed_run.builtins()}
    client, prom = pushed_run.client, pushed_run.prometheus
    with span("held run"):  # no name declared bounded: the workflow "other"
        held = client.submit(wait_for_event, "prometheus3-held", pure=False)
        for query in queries:
            expr = substitute(query.expr, setting, variables(board))
            result = prom.wait_for_query(expr, lambda r: any(
                float(s["value"][1]) > 0 and s["metric"].get("dask_workflow_name") == "other"
                for s in r), timeout=60)
            assert result, (str(query), expr)
        assert held.status == "pending"  # the run was open all along
        (active,) = prom.query('sum(dask_workflow_active{job="dask"})')
        assert float(active["value"][1]) >= 1
        Event("prometheus3-held", client=client).set()
        held.result()
