"""What deploy/ ships matches what the bridge emits, checked against real backends.

- Every PromQL expression of every Grafana dashboard runs against a real Prometheus
  that scraped a real ``dask scheduler`` + ``dask worker`` cluster during a spilling,
  nested-span workload (scraped with deploy/prometheus/prometheus.yml, its alert
  rules loaded), and returns data for every value of the dashboards' variables.
  The same through a real Collector: tests/test_collector.py; pushed straight to
  Prometheus 3: tests/test_prometheus3.py.
- The workload's span tree reaches a real trace store (Jaeger) intact.
- The compose file, the Kubernetes manifests, the Helm values and the Collector,
  Tempo, Grafana and Prometheus configs parse, validate against their schemas,
  name only pinned images, and name only environment variables, dask config keys
  and Dask CLI options that exist. The Docker engine, Kubernetes, Grafana and Tempo
  cannot run here: what is checked of them is what can be without them.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.version import Version

import dask_otel.config
from tests.support.backends import (
    JaegerServer,
    PrometheusServer,
    free_port,
    http_get_json,
    promtool_check_config,
    promtool_check_rules,
    require_backend,
    wait_until,
)
from tests.support.deploy_checks import (
    COLLECTOR_CONFIGS,
    COMPOSE,
    DASHBOARDS,
    DEPLOY,
    GRAFANA_BUILTINS,
    PROMETHEUS_DIR,
    REFERENCE,
    RULE_FILES,
    SCRAPE_INTERVAL,
    SPILL_ENV,
    WORKER_ARGS,
    ContainerEnv,
    ScrapedRun,
    check_dask_cli,
    collector_prometheus_name,
    dashboards,
    dask_config_key,
    dask_config_key_exists,
    dotted,
    every_dashboard_problem,
    image_is_pinned,
    k8s_env,
    known_otel_variables,
    load_workload,
    workload_pythonpath,
    load_yaml_documents,
    metric_names,
    otel_environ,
    panel_queries,
    panels,
    prometheus_label,
    resolve_variables,
    resolved_env,
    rule_problems,
    run_workload,
    shipped_scrape_config,
    variable_names,
    variables,
)
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import REPO, dask_processes
from tests.support.span_tree import assert_span_tree

KUBERNETES = DEPLOY / "kubernetes"
DASK_CLUSTER = KUBERNETES / "operator" / "daskcluster.yaml"
HELM_VALUES = KUBERNETES / "helm" / "dask-values.yaml"
#: Kubernetes version the manifests are validated against
KUBERNETES_VERSION = "1.30"


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


# =============================================================================
# Prometheus: promtool
# =============================================================================


@pytest.mark.parametrize("config", ["prometheus.yml", "collector.yml"])
def test_prometheus_config_passes_promtool(config):
    output = promtool_check_config(PROMETHEUS_DIR / config)
    # It also checks the rule files the config names: they must be found
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in output


def test_rules_pass_promtool():
    assert RULE_FILES
    promtool_check_rules(*RULE_FILES)


def test_podmonitor_relabelings_are_valid_prometheus_relabel_configs(tmp_path):
    """The Prometheus Operator turns a PodMonitor's relabelings into a scrape
    job's relabel_configs: promtool checks them as such"""
    jobs = []
    for monitor in load_yaml_documents(KUBERNETES / "monitoring" / "podmonitors.yaml"):
        assert monitor["kind"] == "PodMonitor"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            relabel = [
                {re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), k): v for k, v in r.items()}
                for r in endpoint.get("relabelings", [])
            ]
            jobs.append({"job_name": monitor["metadata"]["name"],
                         "honor_labels": endpoint.get("honorLabels", False),
                         "static_configs": [{"targets": ["127.0.0.1:1"]}],
                         "relabel_configs": relabel})
    config = tmp_path / "podmonitors.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": jobs}))
    promtool_check_config(config)


# =============================================================================
# Grafana: dashboards and provisioning
# =============================================================================


def test_dashboards_are_what_the_generator_writes():
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "grafana" / "generate_dashboards.py"), "--check"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_there_are_a_spill_a_spans_and_a_workflows_dashboard_with_cluster_variables():
    boards = dashboards()
    assert {"dask-spill.json", "dask-spans.json", "dask-workflows.json"} <= set(boards)
    assert boards["dask-spill.json"]["title"] == "Dask spill"
    assert boards["dask-spans.json"]["title"] == "Dask spans"
    assert boards["dask-workflows.json"]["title"] == "Dask workflows"
    for board in boards.values():
        assert "cluster" in variables(board)
    assert variables(boards["dask-spill.json"])["worker"]["multi"]
    assert variables(boards["dask-workflows.json"])["workflow"]["multi"]


def test_the_workflows_dashboard_shows_runs_by_result_durations_and_removed_workers():
    """Issue 26's questions, one panel each: did it run and did it fail (runs by
    result), is it slow (duration percentiles of ok runs), which workers left and
    why (removed by reason)"""
    board = dashboards()["dask-workflows.json"]
    exprs = {panel["title"]: [t["expr"] for t in panel.get("targets", [])]
             for panel in panels(board)}
    (runs,) = exprs["Runs by result"]
    assert "dask_workflow_runs_total" in runs and "by (dask_workflow_name, dask_workflow_result)" in runs
    quantiles = exprs["Duration of ok runs: percentiles"]
    assert [re.match(r"histogram_quantile\((0\.\d+),", q).group(1) for q in quantiles] == \
        ["0.5", "0.9", "0.99"]
    assert all('dask_workflow_duration_seconds_bucket{' in q and 'dask_workflow_result="ok"' in q
               for q in quantiles)
    (removed,) = exprs["Workers removed, by reason"]
    assert "by (dask_worker_removed_reason)" in removed
    # Issue 39: what runs now, and its tasks by state, per workflow
    (active,) = exprs["Runs open now"]
    assert "by (dask_workflow_name) (dask_workflow_active{" in active
    (tasks,) = exprs["Tasks of the open runs, by state"]
    assert "by (dask_workflow_name, dask_task_state) (dask_workflow_tasks{" in tasks


@pytest.mark.parametrize("name", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_dashboard_is_self_consistent(name):
    """Unique panel ids on a 24-column grid; every data source is picked by a
    variable of the right type (so the dashboard works in any Grafana); every
    variable a panel uses is defined"""
    board = dashboards()[name]
    defined = variables(board)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for thing in [panel, *panel.get("targets", [])]:
            source = thing.get("datasource")
            if source:
                (variable,) = variable_names(source["uid"])
                assert defined[variable]["type"] == "datasource"
                assert defined[variable]["query"] == source["type"]
        text = json.dumps({k: panel.get(k) for k in ("title", "targets", "options")})
        undefined = variable_names(text) - set(defined) - set(GRAFANA_BUILTINS)
        assert not undefined, f"{panel['title']}: undefined variables {undefined}"
        if "repeat" in panel:
            assert defined[panel["repeat"]]["multi"]


def test_grafana_provisioning_matches_the_compose_stack():
    services = compose()["services"]
    mounts = dict(reversed(v.split(":")[:2]) for v in services["grafana"]["volumes"])
    (datasources,) = load_yaml_documents(
        DEPLOY / "grafana" / "provisioning" / "datasources" / "dask-otel.yaml")
    for source in datasources["datasources"]:
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"]).groups()
        assert host in services, source["name"]
    by_type = {s["type"]: s for s in datasources["datasources"]}
    assert set(by_type) == {"prometheus", "tempo", "jaeger"}
    # $__rate_interval is computed from the scrape interval the data source states
    collector_scrape = yaml.safe_load((PROMETHEUS_DIR / "collector.yml").read_text())
    assert by_type["prometheus"]["jsonData"]["timeInterval"] == \
        collector_scrape["global"]["scrape_interval"]
    (providers,) = load_yaml_documents(
        DEPLOY / "grafana" / "provisioning" / "dashboards" / "dask-otel.yaml")
    (provider,) = providers["providers"]
    assert mounts[provider["options"]["path"]] == "../grafana/dashboards"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name in {p.name for p in DASHBOARDS.glob("*.json")}


def test_exemplars_are_stored_and_linked_to_the_trace_store():
    """The path of an exemplar of dask.activity.* (docs/metrics.md#exemplars):
    the collector serves it (OpenMetrics only), Prometheus stores it, Grafana's
    Prometheus data source links its trace_id to Tempo, and the activity panels
    ask for exemplars"""
    for path in COLLECTOR_CONFIGS:
        config = yaml.safe_load(path.read_text())
        assert config["exporters"]["prometheus"]["enable_open_metrics"] is True, path
    command = compose()["services"]["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    (datasources,) = load_yaml_documents(
        DEPLOY / "grafana" / "provisioning" / "datasources" / "dask-otel.yaml")
    by_type = {s["type"]: s for s in datasources["datasources"]}
    (link,) = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    # the label the collector's prometheus exporter gives an exemplar's trace id
    assert link == {"name": "trace_id", "datasourceUid": by_type["tempo"]["uid"]}
    spans = json.loads((DASHBOARDS / "dask-spans.json").read_text())
    activity = [
        t for panel in spans["panels"] for t in panel.get("targets", [])
        if "dask_activity_" in t.get("expr", "") and t.get("range")
    ]
    assert activity and all(t.get("exemplar") is True for t in activity)
    # dask.workflow.duration: an exemplar per run, its root trace, on the buckets
    # (where Prometheus keeps a histogram's exemplars)
    workflows = json.loads((DASHBOARDS / "dask-workflows.json").read_text())
    buckets = [
        t for panel in workflows["panels"] for t in panel.get("targets", [])
        if "dask_workflow_duration_seconds_bucket" in t.get("expr", "")
    ]
    assert len(buckets) == 3 and all(t.get("exemplar") is True for t in buckets)


def test_prometheus_with_the_stacks_flags_keeps_an_exemplar_and_serves_its_trace_id():
    """Step 2 of the exemplar path (docs/deploy.md): a Prometheus run with the
    compose stack's feature flags scrapes a histogram served in OpenMetrics with an
    exemplar on a bucket, as the collector's prometheus exporter serves
    dask.workflow.duration (prometheus_client serves the same exposition format;
    tests/test_collector.py runs the real Collector), and /api/v1/query_exemplars
    returns it,
    under the label Grafana's data source links to Tempo, with the trace id of a
    span of the OpenTelemetry SDK"""
    import prometheus_client
    from opentelemetry.sdk.trace import TracerProvider

    flags = [arg for arg in compose()["services"]["prometheus"]["command"]
             if arg.startswith("--enable-feature=")]
    with TracerProvider().get_tracer("test").start_as_current_span("nightly-etl") as span:
        context = span.get_span_context()
    trace_id, span_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"
    registry = prometheus_client.CollectorRegistry()
    histogram = prometheus_client.Histogram(
        "dask_workflow_duration_seconds", "Duration of workflow runs",
        ["dask_workflow_name", "dask_workflow_result"], registry=registry,
        buckets=(5, 10, 60))
    histogram.labels("nightly-etl", "ok").observe(8.0, exemplar={"trace_id": trace_id,
                                                                 "span_id": span_id})
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with PrometheusServer([f"127.0.0.1:{port}"], extra_args=flags,
                              binary=require_backend("prometheus")) as prometheus:
            def exemplars():
                return http_get_json(f"{prometheus.url}/api/v1/query_exemplars", {
                    "query": "dask_workflow_duration_seconds_bucket",
                    "start": time.time() - 60, "end": time.time() + 60})["data"]

            (series,) = wait_until(exemplars, timeout=30, message="a stored exemplar")
    finally:
        server.shutdown()
        thread.join(timeout=5)
    assert series["seriesLabels"]["le"] == "10.0"
    (exemplar,) = series["exemplars"]
    (datasources,) = load_yaml_documents(
        DEPLOY / "grafana" / "provisioning" / "datasources" / "dask-otel.yaml")
    (prometheus_source,) = [s for s in datasources["datasources"] if s["type"] == "prometheus"]
    (link,) = prometheus_source["jsonData"]["exemplarTraceIdDestinations"]
    assert exemplar["labels"][link["name"]] == trace_id
    assert float(exemplar["value"]) == 8.0


# =============================================================================
# Compose
# =============================================================================


def test_compose_file_matches_the_compose_specification():
    schema = json.loads(
        (importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
         / "compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker client here has no compose plugin; the schema check stands in",
)
def test_docker_compose_config_accepts_the_file():
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compose_files_it_names_exist():
    """Bind mounts, the build context and the Dockerfile, and what it copies"""
    base = COMPOSE.parent
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (base / source).exists(), f"{name}: {source}"
        if "build" in service:
            context = base / service["build"]["context"]
            dockerfile = context / service["build"]["dockerfile"]
            assert dockerfile.exists()
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for source in line.split()[1:-1]:
                        assert (context / source).exists(), f"Dockerfile: COPY {source}"


def test_files_named_in_deploy_comments_exist():
    """A YAML file a comment in deploy/ names (relative to its own directory, the
    repository or deploy/) exists"""
    missing = []
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix not in (".yml", ".yaml", ".py") and path.name != "Dockerfile":
            continue
        for line in path.read_text().splitlines():
            comment = line.partition("#")[2]
            for name in re.findall(r"[\w./-]+\.ya?ml\b", comment):
                if not any((base / name).exists() for base in (path.parent, REPO, DEPLOY)):
                    missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_no_secrets_in_deploy_files():
    """No password, token or key is written in a file we ship (Grafana runs with
    anonymous access on 127.0.0.1 instead of an admin password)"""
    secret = re.compile(r"(?i)(password|passwd|secret|token|api[_-]?key)\w*\s*[:=]\s*\S")
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".json", ".py", ""}:
            assert not secret.search(path.read_text()), path


def test_compose_publishes_ports_on_localhost_only():
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def test_compose_services_reach_each_other_at_ports_they_listen_on():
    """The collector's exporters, Prometheus' scrape target and the Dask
    processes' OTLP endpoint name services of the stack"""
    services = compose()["services"]
    collector = yaml.safe_load((DEPLOY / "compose" / "otel-collector.yaml").read_text())
    for name, exporter in collector["exporters"].items():
        if name.startswith("otlp_grpc/"):
            host, port = exporter["endpoint"].split(":")
            assert host in services and port == "4317", name
    tempo = yaml.safe_load((DEPLOY / "compose" / "tempo.yaml").read_text())
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] \
        .endswith(":4317")
    scrape = yaml.safe_load((PROMETHEUS_DIR / "collector.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["honor_labels"] is True  # keeps job = service.name
    (target,) = job["static_configs"][0]["targets"]
    assert target == "otel-collector:" + collector["exporters"]["prometheus"]["endpoint"].split(":")[1]
    for name in ("scheduler", "worker-1", "worker-2"):
        endpoint = services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == "http://otel-collector:4317"
    assert services["prometheus"]["command"][0] == \
        "--config.file=/etc/prometheus/dask-otel/collector.yml"


# =============================================================================
# Images, environment variables, Dask command lines (compose and Kubernetes)
# =============================================================================


def shipped_images() -> list[tuple[str, str]]:
    images = [(f"compose {name}", s["image"]) for name, s in compose()["services"].items()]
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        for doc in load_yaml_documents(path):
            for match in re.finditer(r"^\s*-?\s*image: (\S+)$", yaml.safe_dump(doc), re.M):
                images.append((str(path.relative_to(DEPLOY)), match.group(1).strip("'\"")))
    values = yaml.safe_load(HELM_VALUES.read_text())
    for part in ("scheduler", "worker"):
        image = values[part]["image"]
        images.append((f"helm {part}", f"{image['repository']}:{image['tag']}"))
    for line in (DEPLOY / "image" / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            images.append(("Dockerfile", line.split()[1]))
    return images


def test_every_image_is_pinned_to_a_version():
    images = shipped_images()
    assert len(images) >= 12
    unpinned = [(where, image) for where, image in images if not image_is_pinned(image)]
    assert not unpinned


def built_backend_images() -> dict[str, str]:
    """The image of each backend .ci/install-backends builds, at the version it builds
    (read from its pins and the Collector's builder manifest)"""
    script = (REPO / ".ci" / "install-backends").read_text()
    jaeger = re.search(r"^JAEGER_VERSION=v(\S+)$", script, re.M).group(1)
    minor, patch = re.search(r"^PROMETHEUS_MODULE_VERSION=v0\.3(\d\d)\.(\d+)$", script, re.M).groups()
    manifest = yaml.safe_load((REPO / ".ci" / "otelcol-builder.yaml").read_text())
    (contrib,) = {line["gomod"].split()[1] for kind in ("receivers", "processors", "exporters",
                                                        "extensions")
                  for line in manifest.get(kind, []) if "collector-contrib" in line["gomod"]}
    return {"jaegertracing/jaeger": jaeger, "prom/prometheus": f"v3.{int(minor)}.{patch}",
            "otel/opentelemetry-collector-contrib": contrib.removeprefix("v")}


def test_backend_images_are_the_versions_ci_builds_and_tests():
    """What deploy/ ships is what the tests run: the Jaeger, Collector and Prometheus
    images are pinned to the versions .ci/install-backends builds"""
    built = built_backend_images()
    shipped = [(where, image.rsplit(":", 1)) for where, image in shipped_images()]
    pinned = [(where, name, tag) for where, (name, tag) in shipped if name in built]
    assert {name for _, name, _ in pinned} == set(built)
    assert [(where, name, tag) for where, name, tag in pinned if tag != built[name]] == []


def test_the_dask_image_is_the_one_compose_builds():
    built = {s["image"] for s in compose()["services"].values() if "build" in s}
    assert built == {"dask-otel:0.1.0"}
    kubernetes = {image for where, image in shipped_images()
                  if where.startswith(("kubernetes/operator", "helm"))}
    assert kubernetes == built


def container_envs() -> list[ContainerEnv]:
    """The environment of every Dask container the deploy files define"""
    envs = []
    for name, service in compose()["services"].items():
        if "build" in service:
            values = {k: str(v) for k, v in (service.get("environment") or {}).items()}
            envs.append(ContainerEnv(f"compose {name}", values))
    (cluster,) = load_yaml_documents(DASK_CLUSTER)
    for part in ("scheduler", "worker"):
        for container in cluster["spec"][part]["spec"]["containers"]:
            envs.append(k8s_env(f"DaskCluster {part}", container.get("env")))
    values = yaml.safe_load(HELM_VALUES.read_text())
    for part in ("scheduler", "worker"):
        envs.append(k8s_env(f"helm {part}", values[part].get("env")))
    return envs


@pytest.mark.parametrize("env", container_envs(), ids=lambda e: e.where)
def test_environment_names_only_variables_that_exist(env):
    """OTEL_* the OpenTelemetry SDK reads, DASK_* that map onto an existing dask
    config key (distributed's or dask_otel's), and Kubernetes helpers that are set
    from the downward API and used in another variable's $(...)"""
    otel = known_otel_variables()
    used_in_references = {
        ref for value in env.values.values() if value for ref in REFERENCE.findall(value)
    }
    for name in env.values:
        if name.startswith("OTEL_"):
            assert name in otel, f"{env.where}: {name} is not read by the OpenTelemetry SDK"
        elif name.startswith("DASK_"):
            key = dask_config_key(name)
            assert dask_config_key_exists(key), f"{env.where}: {name} -> no dask config {key}"
        else:
            assert name in env.from_references and name in used_in_references, \
                f"{env.where}: {name} is neither OTEL_*, DASK_* nor a used helper"
    for ref in used_in_references:
        assert ref in env.values, f"{env.where}: $({ref}) is not defined"
    # A Dask server with this environment gets a valid configuration, and one
    # that exports somewhere: the bridge would be off otherwise
    import dask.config

    resolved = resolved_env(env)
    dask_settings = dask.config.collect_env({k: v for k, v in resolved.items() if k.startswith("DASK_")})
    with otel_environ(resolved), dask.config.set(dotted(dask_settings)):
        config = dask_otel.config.read_config()
    assert config.enabled and config.traces_exporters and config.metrics_exporters


def test_scheduler_environments_switch_the_bridge_on():
    for env in container_envs():
        if "scheduler" in env.where:
            assert env.values.get("DASK_DISTRIBUTED__SCHEDULER__PRELOAD") == "dask_otel", env.where


def dask_command_lines() -> list[tuple[str, list[str]]]:
    out = []
    for name, service in compose()["services"].items():
        command = service.get("command") or []
        if command[:2] in (["dask", "scheduler"], ["dask", "worker"]):
            out.append((f"compose {name}", command))
    (cluster,) = load_yaml_documents(DASK_CLUSTER)
    for part in ("scheduler", "worker"):
        for container in cluster["spec"][part]["spec"]["containers"]:
            # The operator sets DASK_WORKER_NAME and DASK_SCHEDULER_ADDRESS
            args = [REFERENCE.sub("placeholder", a) for a in container["args"]]
            out.append((f"DaskCluster {part}", args))
    # The dask chart runs `dask-scheduler --port=8786 --dashboard-address=:8787
    # <extraArgs>` and `dask-worker <scheduler> ... <extraArgs>`
    values = yaml.safe_load(HELM_VALUES.read_text())
    out.append(("helm scheduler", ["dask-scheduler", "--port=8786", "--dashboard-address=:8787",
                                   *values["scheduler"].get("extraArgs", [])]))
    out.append(("helm worker", ["dask-worker", "tcp://scheduler:8786", "--no-dashboard",
                                "--dashboard-address", "8790",
                                *values["worker"].get("extraArgs", [])]))
    return out


@pytest.mark.parametrize("args", [pytest.param(args, id=where) for where, args in dask_command_lines()])
def test_dask_command_line_parses(args):
    check_dask_cli(args)


# =============================================================================
# Kubernetes
# =============================================================================


def k8s_validate(resource: dict[str, Any]) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        kind = resource.get("kind")
        pytest.fail(f"{kind} {resource['metadata'].get('name')}: {str(e).splitlines()[0]}")


def test_collector_manifests_validate_against_kubernetes_schemas():
    directory = KUBERNETES / "collector"
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources = []
    for name in kustomization["resources"]:
        resources += load_yaml_documents(directory / name)
    for resource in resources:
        k8s_validate(resource)
    (generator,) = kustomization["configMapGenerator"]
    for entry in generator["files"]:
        assert (directory / entry.split("=")[-1]).exists()
    (daemonset,) = [r for r in resources if r["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"]["name"] == generator["name"]
    (container,) = pod["containers"]
    config_file = container["args"][0].removeprefix("--config=")
    mount = container["volumeMounts"][0]["mountPath"]
    assert config_file == f"{mount}/{generator['files'][0].split('=')[0]}"
    ports = {p["name"] for p in container["ports"]}
    (service,) = [r for r in resources if r["kind"] == "Service"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    for monitor in load_yaml_documents(KUBERNETES / "monitoring" / "podmonitors.yaml"):
        if monitor["metadata"]["name"] == "dask-otel-collector":
            assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    # Dask pods send to this Service
    for env in container_envs():
        if not env.where.startswith("compose"):
            host = re.match(r"http://([^:]+):", env.values["OTEL_EXPORTER_OTLP_ENDPOINT"]).group(1)
            assert host == f"{service['metadata']['name']}.{kustomization['namespace']}.svc.cluster.local"


#: What the DaskCluster custom resource (kubernetes.dask.org/v1) takes, from the
#: dask-kubernetes operator's documentation and CRD templates: scheduler.spec and
#: worker.spec are core PodSpecs, scheduler.service a ServiceSpec.
DASK_CLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubernetes.dask.org/v1"},
        "kind": {"const": "DaskCluster"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["scheduler", "worker"],
            "properties": {
                "idleTimeout": {"type": "integer"},
                "scheduler": {"type": "object", "additionalProperties": False,
                              "required": ["spec", "service"],
                              "properties": {"spec": {"type": "object"},
                                             "service": {"type": "object"}}},
                "worker": {"type": "object", "additionalProperties": False,
                           "required": ["spec"],
                           "properties": {"replicas": {"type": "integer"},
                                          "spec": {"type": "object"}}},
            },
        },
    },
}


def test_dask_cluster_validates_against_the_operator_and_kubernetes_schemas():
    (cluster,) = load_yaml_documents(DASK_CLUSTER)
    jsonschema.validate(cluster, DASK_CLUSTER_SCHEMA)
    name = cluster["metadata"]["name"]
    for part in ("scheduler", "worker"):
        k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-{part}"},
                      "spec": cluster["spec"][part]["spec"]})
    service = cluster["spec"]["scheduler"]["service"]
    k8s_validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
                  "spec": service})
    assert service["selector"]["dask.org/cluster-name"] == name
    # The port the pull-mode PodMonitor scrapes exists on both pods
    for part in ("scheduler", "worker"):
        (container,) = cluster["spec"][part]["spec"]["containers"]
        assert "http-dashboard" in {p["name"] for p in container["ports"]}


#: The keys of the dask Helm chart's values (chart dask/dask, appVersion
#: 2023.10.1) that the templates read, as far as deploy/kubernetes/helm uses them:
#: its values.yaml, plus scheduler.env, which the scheduler Deployment template
#: reads although values.yaml does not list it.
_IMAGE = {"repository": str, "tag": str, "pullPolicy": str, "pullSecrets": list}
_PROBE = {"httpGet": dict, "initialDelaySeconds": int, "periodSeconds": int}
DASK_CHART_VALUES = {
    "scheduler": {"name": str, "enabled": bool, "image": _IMAGE, "replicas": int,
                  "serviceType": str, "servicePort": int, "extraArgs": list,
                  "resources": dict, "env": list, "tolerations": list, "affinity": dict,
                  "nodeSelector": dict, "securityContext": dict, "metrics": dict,
                  "livenessProbe": _PROBE, "readinessProbe": _PROBE},
    "worker": {"name": str, "image": {**_IMAGE, "dask_worker": str}, "replicas": int,
               "extraArgs": list, "resources": dict, "env": list, "mounts": dict,
               "annotations": dict, "tolerations": list, "affinity": dict,
               "nodeSelector": dict, "securityContext": dict, "portDashboard": int,
               "threads_per_worker": int, "metrics": dict,
               "livenessProbe": _PROBE, "readinessProbe": _PROBE},
    "jupyter": {"enabled": bool},
}


def _check_values(values: dict, known: dict, path: str) -> None:
    for key, value in values.items():
        assert key in known, f"{path}{key} is not a value of the dask chart"
        if isinstance(known[key], dict):
            assert isinstance(value, dict), f"{path}{key}"
            _check_values(value, known[key], f"{path}{key}.")
        else:
            assert isinstance(value, known[key]), f"{path}{key}: {value!r}"


def test_helm_values_use_only_keys_of_the_dask_chart():
    values = yaml.safe_load(HELM_VALUES.read_text())
    _check_values(values, DASK_CHART_VALUES, "")
    for part in ("scheduler", "worker"):
        part_values = values[part]
        container = {"name": part, "image": "x:1", "env": part_values["env"],
                     **({"resources": part_values["resources"]} if "resources" in part_values else {}),
                     **{k: part_values[k] for k in ("livenessProbe", "readinessProbe") if k in part_values}}
        k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": part},
                      "spec": {"containers": [container]}})


# =============================================================================
# Collector configs
# =============================================================================

#: Components of the contrib distribution the configs may use
@pytest.mark.parametrize("path", COLLECTOR_CONFIGS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_collector_config_is_consistent(path):
    """What the real Collector accepts (tests/test_collector.py validates each
    config) and what the dashboards need besides"""
    config = yaml.safe_load(path.read_text())
    service = config["service"]
    for pipeline in service["pipelines"].values():
        # memory_limiter must come first
        assert pipeline["processors"][0] == "memory_limiter"
    assert set(service["pipelines"]) == {"traces", "metrics"}
    prometheus = config["exporters"]["prometheus"]
    # The settings the dashboards' names and labels rely on
    assert prometheus["add_metric_suffixes"] is True
    assert prometheus["resource_to_telemetry_conversion"]["enabled"] is False
    assert "namespace" not in prometheus and "const_labels" not in prometheus


def test_kubernetes_collector_config_differs_from_compose_only_in_endpoints():
    def without_endpoints(path: Path) -> dict:
        config = yaml.safe_load(path.read_text())
        for name, exporter in config["exporters"].items():
            if name.startswith("otlp_grpc/"):
                exporter.pop("endpoint")
        return config

    compose_config, kubernetes_config = map(without_endpoints, COLLECTOR_CONFIGS)
    assert compose_config == kubernetes_config


# =============================================================================
# A real cluster, scraped by a real Prometheus with the shipped config and rules
# =============================================================================

#: The tests of one scraped run, in one test process (pytest-xdist): the run once
ON_THE_SCRAPED_RUN = pytest.mark.xdist_group("deploy-scraped-run")


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory) -> Iterator[ScrapedRun]:
    """Pull mode: the Dask servers' /metrics scraped with deploy/prometheus/prometheus.yml;
    the same processes push their metrics over OTLP to the harness receiver too"""
    env = {**SPILL_ENV, "DASK_OTEL__METRICS__EXPORTER": "prometheus,otlp"}
    with OTLPReceiver("http/protobuf") as receiver, dask_processes(
        {**receiver.env(), **env, **workload_pythonpath()}, worker_args=WORKER_ARGS
    ) as cluster, cluster.client() as client:
        info = client.scheduler_info()
        ports = [info["services"]["dashboard"]] + [
            w["services"]["dashboard"] for w in info["workers"].values()]
        targets = [f"127.0.0.1:{port}" for port in ports]
        prometheus = PrometheusServer(targets, scrape_interval=f"{SCRAPE_INTERVAL:g}s")
        prometheus.config = shipped_scrape_config(
            "prometheus.yml", tmp_path_factory.mktemp("rules"), targets)
        with prometheus:
            prometheus.wait_for_targets_up(timeout=30)
            time.sleep(2 * SCRAPE_INTERVAL)  # counters scraped at 0 before the work
            start = time.time()
            run_workload(cluster, client)
            yield ScrapedRun(
                prometheus, job=prometheus.config["scrape_configs"][0]["job_name"],
                workers=sorted(w["name"] for w in info["workers"].values()),
                start=start, end=time.time(), receiver=receiver)


@ON_THE_SCRAPED_RUN
def test_the_undelivered_spans_query_of_metrics_md_returns_the_schedulers_series(scraped_run):
    """docs/metrics.md's query of the mirrored spans not yet delivered returns one series,
    the scheduler's: the workers publish their export health too, and have no mirror"""
    from tests.test_doc_queries import documented_queries

    (query,) = [q for doc, q, _ in documented_queries()
                if doc == "metrics.md" and "dask_otel_span_mirrored_total" in q
                and "dask_otel_export_items_total" in q]
    result = wait_until(lambda: scraped_run.prometheus.query(query), timeout=30,
                        message="the query's series")
    assert len(result) == 1, result
    assert float(result[0]["value"][1]) >= 0


@ON_THE_SCRAPED_RUN
def test_every_dashboard_query_returns_data_from_a_spilling_cluster(scraped_run):
    """Each expression, with the template variables substituted (each worker, each
    task prefix, and All), has data over the run; so does each selector in it,
    so that no metric or label value a panel names is missing."""
    problems = every_dashboard_problem(scraped_run)
    assert not problems, "\n".join(problems)
    # Every worker is a value of $worker: both spilled and show up
    spill_values = resolve_variables(scraped_run, dashboards()["dask-spill.json"])
    assert spill_values["worker"] == scraped_run.workers


#: opentelemetry-exporter-prometheus labels every series with its instrumentation
#: scope (otel_scope_name) from 0.64b0 on; before, the bridge's series cannot be
#: told from the rest of a scrape
SCOPE_LABELS = pytest.mark.skipif(
    Version(version("opentelemetry-exporter-prometheus")) < Version("0.64b0"),
    reason="opentelemetry-exporter-prometheus < 0.64b0 adds no otel_scope_name label",
)


@ON_THE_SCRAPED_RUN
@SCOPE_LABELS
def test_dashboards_name_only_metrics_the_bridge_emits(scraped_run):
    """The dask_* metrics the dashboards and rules use are among those the cluster
    exposed, and those all come from the bridge (otel_scope_name="dask_otel")"""
    emitted = {r["metric"]["__name__"] for r in scraped_run.prometheus.query(
        'group by (__name__) ({otel_scope_name="dask_otel"})', time=scraped_run.end)}
    # A Grafana variable in a query is no metric (`offset $__range`)
    used = {name for board in dashboards().values() for query in panel_queries("", board)
            if query.datasource_type == "prometheus"
            for name in metric_names(re.sub(r"\$\w+", "1m", query.expr))}
    for rule_file in RULE_FILES:
        for group in yaml.safe_load(rule_file.read_text())["groups"]:
            for rule in group["rules"]:
                used |= set(metric_names(rule["expr"]))
    assert used <= emitted, used - emitted
    # The dashboards between them show every metric the bridge emits
    assert emitted <= used, emitted - used


@ON_THE_SCRAPED_RUN
def test_the_spill_dashboard_shows_spilling(scraped_run):
    """Not just series: the workload spilled on every worker, unspilled, and the
    target threshold is where the worker config put it"""
    prom = scraped_run.prometheus
    for worker in scraped_run.workers:
        selector = f'job="{scraped_run.job}", dask_worker_name="{worker}"'
        written = prom.query(f'dask_spill_count_total{{{selector}, dask_activity_name="disk-write"}}',
                             time=scraped_run.end)
        assert prom.values(written)[0] > 0, f"{worker} never spilled"
        on_disk = prom.query(f'max_over_time(dask_spill_disk_keys{{{selector}}}[1h])',
                             time=scraped_run.end)
        assert prom.values(on_disk)[0] > 0, f"{worker} never had a key on disk at a scrape"
        read = prom.query(f'dask_spill_count_total{{{selector}, dask_activity_name="disk-read"}}',
                          time=scraped_run.end)
        assert prom.values(read)[0] > 0, f"{worker} never unspilled"
        (target,) = prom.values(prom.query(
            f'dask_memory_threshold_bytes{{{selector}, dask_threshold="target"}}', time=scraped_run.end))
        assert target == 0.02 * 500e6


@ON_THE_SCRAPED_RUN
def test_alert_rules_load_and_stay_quiet_on_a_healthy_run(scraped_run):
    problems = rule_problems(scraped_run)
    assert not problems, "\n".join(problems)


@ON_THE_SCRAPED_RUN
@SCOPE_LABELS
def test_a_collector_gives_the_metrics_the_same_prometheus_names_and_labels(scraped_run):
    """The same processes pushed their metrics over OTLP too: named as the
    Collector's prometheus exporter names them (add_metric_suffixes), they are the
    names Prometheus scraped in pull mode, with the same labels; and the resource
    yields the same `job` (service.name) the scrape job gives in pull mode."""
    points = [p for p in scraped_run.receiver.metric_points() if p.scope == "dask_otel"]
    assert points
    pushed: dict[str, set[str]] = {}
    for point in points:
        name = collector_prometheus_name(point.name, point.unit, point.kind, point.monotonic)
        # A histogram is three series in Prometheus (dask.workflow.duration)
        names = ([name + suffix for suffix in ("_bucket", "_sum", "_count")]
                 if point.kind == "histogram" else [name])
        for name in names:
            pushed.setdefault(name, set()).update(map(prometheus_label, point.attributes))
        assert point.resource["service.name"] == scraped_run.job
        assert point.resource.get("service.instance.id")  # the collector's `instance`
    series = http_get_json(f"{scraped_run.prometheus.url}/api/v1/series", {
        "match[]": '{otel_scope_name="dask_otel"}', "start": scraped_run.start,
        "end": scraped_run.end})["data"]
    pulled: dict[str, set[str]] = {}
    for labels in series:
        pulled.setdefault(labels["__name__"], set()).update(
            k for k, v in labels.items() if v and k != "__name__")
    assert set(pushed) == set(pulled)
    for name, labels in pushed.items():
        assert labels <= pulled[name], (name, labels - pulled[name])


@ON_THE_SCRAPED_RUN
def test_trace_attributes_the_dashboards_search_for_are_exported(scraped_run):
    """The Tempo (TraceQL) and Jaeger panels search by span and resource
    attributes: the exported spans carry them, and service.name is $cluster"""
    spans = [s for s in scraped_run.receiver.spans() if s.scope == "dask_otel"]
    assert spans
    searched: set[tuple[str, str]] = set()
    for board in dashboards().values():
        for query in panel_queries("", board):
            if query.datasource_type == "tempo":
                searched |= set(re.findall(r"\b(span|resource)\.([\w.]+)", query.target["query"]))
            elif query.datasource_type == "jaeger":
                searched |= {("span", key) for key in re.findall(r"([\w.]+)=", query.target["tags"])}
    assert ("span", "dask.span.id") in searched
    for scope, attribute in searched:
        where = [s.resource if scope == "resource" else s.attributes for s in spans]
        assert any(attribute in w for w in where), f"{scope}.{attribute}"
    assert {s.resource["service.name"] for s in spans} == {scraped_run.job}


# =============================================================================
# A real trace store: Jaeger
# =============================================================================


def test_the_workload_span_tree_reaches_a_trace_store():
    """The compose stack's workload, exported over OTLP/HTTP to Jaeger, reads back
    through Jaeger's query API as one trace whose id is the root Dask span's UUID,
    with every parent id pointing at the span the Dask tree says"""
    workload = load_workload()
    with JaegerServer() as jaeger:
        env = {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http_endpoint,
            "OTEL_METRICS_EXPORTER": "none",
            **workload_pythonpath(),
        }
        with dask_processes(env) as cluster, cluster.client() as client:
            root_id = workload.run_round(client, chunks=4, chunk_bytes=80_000)
            trace_id = root_id.replace("-", "")
            groups = {f"taskgroup/{group}": span for group, span in workload.TASK_GROUPS.items()}
            expected = len(workload.SPAN_TREE) + len(groups)
            spans = jaeger.wait_for_trace(trace_id, count=expected, timeout=30)

    assert len(spans) == expected
    assert {s["trace_id"] for s in spans} == {trace_id}
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == set(workload.SPAN_TREE) | set(groups)
    root = by_name["spill demo"]
    assert root["parent_id"] is None
    assert root["span_id"] == trace_id[-16:]
    assert root["attributes"]["dask.span.id"] == root_id
    for name, parent in {**workload.SPAN_TREE, **groups}.items():
        if parent is not None:
            assert by_name[name]["parent_id"] == by_name[parent]["span_id"], name
    for name in workload.SPAN_TREE:
        span = by_name[name]
        dask_id = span["attributes"]["dask.span.id"]
        assert span["span_id"] == dask_id.replace("-", "")[-16:], name
    # One whole trace, children within their parents
    assert_span_tree(spans, one_trace=True)
