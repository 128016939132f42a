"""OTEL_CONFIG_FILE: the bridge's providers follow a declarative configuration file
(dask_otel/export/declarative.py, docs/configuration-file.md), on real Dask
processes, real OTLP receivers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster

import dask_otel
from dask_otel.config import ConfigError
from dask_otel.export.telemetry import ServerTelemetry, Telemetry, build_resource
from tests.support.cluster import wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.tasks import inc

pytest.importorskip("opentelemetry.configuration", reason="dask-otel[config] not installed")

#: The Dask spans' names a workflow of `dask_otel.span("configured")` gives
WORKFLOW = "configured"


def config_file(tmp_path: Path, receiver: OTLPReceiver, service: str = "from-the-file",
                after: tuple[str, str] | None = None) -> str:
    """A file sending spans, metrics and logs to ``receiver`` over gRPC, fast;
    ``after``: (a line of it, lines to put after that line)"""
    exporter = f"exporter: {{otlp_grpc: {{endpoint: \"{receiver.endpoint}\"}}}}"
    batch = f"  processors:\n    - batch: {{schedule_delay: 200, {exporter}}}\n"
    path = tmp_path / "otel.yaml"
    path.write_text(f"""\
file_format: "1.1"
resource:
  attributes:
    - {{name: service.name, value: {service}}}
    - {{name: deployment.environment.name, value: file-test}}
tracer_provider:
{batch}meter_provider:
  readers:
    - periodic: {{interval: 500, {exporter}}}
logger_provider:
{batch}""")
    if after:
        line, lines = after
        path.write_text(path.read_text().replace(f"{line}\n", f"{line}\n{lines}", 1))
    return str(path)


@contextlib.contextmanager
def telemetry_of(monkeypatch, path: str) -> Iterator[ServerTelemetry]:
    """One server's telemetry with OTEL_CONFIG_FILE=``path``, released after"""
    monkeypatch.setenv("OTEL_CONFIG_FILE", path)
    server = Telemetry.acquire(dask_otel.config.read_config())
    try:
        yield server
    finally:
        if Telemetry.detach(server.telemetry):
            server.telemetry.shutdown()


#: A default endpoint that nothing listens on: what the bridge sent there (the
#: OTEL_* variables it must ignore under a file) would be lost, not received
ELSEWHERE = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    "OTEL_EXPORTER_OTLP_INSECURE": "true",
    "OTEL_SERVICE_NAME": "from-the-variables",
    "OTEL_LOGS_EXPORTER": "none",
}


def _run_workflow(client) -> None:
    with dask_otel.span(WORKFLOW):
        assert client.submit(inc, 1).result() == 2


@pytest.mark.timeout(180)
def test_a_config_file_sends_dask_processes_spans_metrics_and_logs_where_it_says(tmp_path):
    with OTLPReceiver("grpc") as receiver:
        env = {**ELSEWHERE, "OTEL_CONFIG_FILE": config_file(tmp_path, receiver),
               "DASK_OTEL__TASKS__SPANS": "true"}
        with dask_processes(env, n_workers=1) as cluster, cluster.client() as client:
            _run_workflow(client)
            spans = receiver.wait_for(lambda r: r.spans(WORKFLOW) and r.spans("run/inc"), timeout=60)
            # the workers' spill instruments and the scheduler's self-metrics
            points = receiver.wait_for(
                lambda r: r.metric_points("dask.spill.memory.keys")
                and r.metric_points("dask.otel.span.mirrored"), timeout=60)
            status = dask_otel.status(client)
            address = cluster.address
            client.run_on_scheduler(
                lambda: __import__("logging").getLogger("distributed.scheduler").warning("from-the-scheduler"))
            logs = receiver.wait_for(
                lambda r: [x for x in r.logs() if x.body == "from-the-scheduler"], timeout=60)
    for signal in (*spans, *points, *logs):
        assert signal.resource["service.name"] == "from-the-file"
        assert signal.resource["deployment.environment.name"] == "file-test"
    # Dask's identity on top of the file's resource
    (mirrored,) = receiver.spans(WORKFLOW)
    assert mirrored.resource["dask.scheduler.address"] == address
    # the scheduler's TaskGroup span and the worker's task span: two processes
    tasks = receiver.spans("taskgroup/inc") + receiver.spans("run/inc")
    assert {s.resource["dask.scheduler.address"] for s in tasks} == {address}
    assert len({s.resource["process.pid"] for s in tasks}) == 2
    assert logs[0].resource["dask.scheduler.address"] == address
    for server in (status["scheduler"], *status["workers"].values()):
        assert server["service_name"] == {"name": "from-the-file", "from": "OTEL_CONFIG_FILE"}
        assert server["config_file"] == {"path": env["OTEL_CONFIG_FILE"], "ignored": []}


@pytest.mark.timeout(120)
def test_without_the_file_the_receiver_it_names_hears_nothing(tmp_path):
    """The test above's receiver hears only what the file names: without the file,
    the bridge follows OTEL_* (here, to a port nothing listens on)"""
    with OTLPReceiver("grpc") as receiver:
        with dask_processes(ELSEWHERE, n_workers=1) as cluster, cluster.client() as client:
            _run_workflow(client)
            cluster.stop()
        assert receiver.spans() == []


def test_the_file_sampler_and_limits_hold_for_the_bridge(tmp_path, monkeypatch):
    """A sampler that keeps nothing and a value length of 8, from the file: the
    bridge's tracer provider and its span sink follow them"""
    with OTLPReceiver("grpc") as receiver:
        path = config_file(tmp_path, receiver, after=(
            "tracer_provider:",
            "  sampler:\n    always_off:\n  limits:\n    attribute_value_length_limit: 8\n",
        ))
        with telemetry_of(monkeypatch, path) as server:
            telemetry = server.telemetry
            sampler = telemetry.tracer_provider.sampler
            # the file's always_off, not the SDK's default ParentBased (whose description
            # names AlwaysOffSampler too, for remote parents not sampled)
            assert sampler.get_description() == "AlwaysOffSampler", sampler.get_description()
            assert server.span_sink.limits.max_span_attribute_length == 8
            # every exporter the file names is wrapped in the bridge's accounting
            for signal in ("spans", "metrics", "logs"):
                assert len(telemetry.accounted_of(signal)) == 1


def test_without_limits_in_the_file_the_value_length_stays_the_bridges(tmp_path, monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        with telemetry_of(monkeypatch, config_file(tmp_path, receiver)) as server:
            assert server.span_sink.limits.max_span_attribute_length == 4096


def test_what_the_bridge_cannot_honour_is_one_warning_and_in_status(tmp_path, monkeypatch, caplog):
    with OTLPReceiver("grpc") as receiver:
        path = config_file(tmp_path, receiver, after=(
            "  readers:",
            "    - pull:\n        exporter:\n          prometheus/development:\n"
            "            port: 0\n",
        ))
        monkeypatch.setenv("OTEL_CONFIG_FILE", path)
        with (
            caplog.at_level(logging.WARNING, logger="dask_otel"),
            dask.config.set({"distributed.scheduler.preload": ["dask_otel"]}),
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            status = dask_otel.status(client)
    warnings = [r for r in caplog.records if "OTEL_CONFIG_FILE" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "meter_provider.readers[0].pull" in warnings[0].getMessage()
    for server in (status["scheduler"], *status["workers"].values()):
        (ignored,) = server["config_file"]["ignored"]
        assert ignored.startswith("meter_provider.readers[0].pull")


def test_a_config_file_without_the_package_is_an_error_naming_the_variable_and_the_extra(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("OTEL_CONFIG_FILE", str(tmp_path / "otel.yaml"))
    monkeypatch.setitem(sys.modules, "opentelemetry.configuration", None)
    with pytest.raises(ConfigError, match=r"OTEL_CONFIG_FILE.*dask-otel\[config\]"):
        build_resource()


def test_files_of_the_stable_schema_and_of_its_release_candidate_are_read(tmp_path, monkeypatch):
    """file_format 1.1 (what the docs write), 1.0 and a 1.0-rc.1 file of before"""
    for i, version in enumerate(("1.1", "1.0", "1.0-rc.1")):
        path = tmp_path / f"otel{i}.yaml"
        path.write_text(f'file_format: "{version}"\nresource:\n  attributes:\n'
                        f'    - {{name: service.name, value: v{i}}}\n')
        monkeypatch.setenv("OTEL_CONFIG_FILE", str(path))
        assert build_resource().attributes["service.name"] == f"v{i}", version


def test_a_file_that_is_not_valid_is_an_error_naming_the_variable(tmp_path, monkeypatch):
    path = tmp_path / "otel.yaml"
    path.write_text("file_format: '9.0'\n")
    monkeypatch.setenv("OTEL_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match="OTEL_CONFIG_FILE"):
        build_resource()


#: ``opentelemetry-instrument python -m``, with this Python (the one that has
#: opentelemetry-configuration) for both
INSTRUMENT = (
    sys.executable, "-c",
    "from opentelemetry.instrumentation.auto_instrumentation import run; run()",
    sys.executable, "-m",
)


@pytest.mark.timeout(180)
def test_a_config_file_configures_the_bridge_under_opentelemetry_instrument(tmp_path):
    """``opentelemetry-instrument dask scheduler``: the SDK builds the application's
    providers from the file, and the bridge (found by its entry point) its own"""
    pytest.importorskip("opentelemetry.instrumentation.auto_instrumentation")
    from importlib.metadata import entry_points

    if "dask" not in {ep.name for ep in entry_points(group="opentelemetry_instrumentor")}:
        pytest.skip("dask-otel is not installed with its entry points (pip install -e .)")
    with OTLPReceiver("grpc") as receiver:
        env = {
            **os.environ, **ELSEWHERE,
            "OTEL_CONFIG_FILE": config_file(tmp_path, receiver, service="instrumented"),
            "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "click,asyncio,tornado,logging",
            "DASK_OTEL__SPANS__EXPORT_DELAY": "300ms",
        }
        scheduler_file = str(tmp_path / "scheduler.json")
        procs = [subprocess.Popen(
            [*INSTRUMENT, "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", "127.0.0.1:0", "--scheduler-file", scheduler_file],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )]
        try:
            from tests.support.backends import wait_until
            from tests.support.processes import scheduler_address

            wait_until(lambda: scheduler_address(scheduler_file), timeout=60)
            procs.append(subprocess.Popen(
                [*INSTRUMENT, "distributed.cli.dask_worker", "--scheduler-file", scheduler_file,
                 "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
                 "--no-nanny"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            with Client(scheduler_address(scheduler_file), timeout=30) as client:
                client.wait_for_workers(1, timeout=60)
                _run_workflow(client)
                spans = receiver.wait_for(lambda r: r.spans(WORKFLOW), timeout=60)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
    assert spans[0].resource["service.name"] == "instrumented"


# -- The outage policy under a file: the file's exporter, the file's intervals ---------


def emit_span(telemetry: Telemetry, name: str) -> None:
    telemetry.tracer_provider.get_tracer("test").start_span(name).end()


def test_after_an_outage_spans_still_go_to_the_files_endpoint_with_its_header(
    tmp_path, monkeypatch
):
    """The file's exporter (its endpoint, its header) refused once while its
    collector is down: what follows reaches that collector with that header, and
    nothing reaches the OTEL_* endpoint"""
    with OTLPReceiver("grpc") as receiver, OTLPReceiver("grpc") as elsewhere:
        for key, value in {**ELSEWHERE, **elsewhere.env()}.items():
            monkeypatch.setenv(key, value)
        exporter = (f"exporter: {{otlp_grpc: {{endpoint: \"{receiver.endpoint}\", "
                    "headers: [{name: x-dask-token, value: from-the-file}]}}")
        path = tmp_path / "otel.yaml"
        path.write_text(f'file_format: "1.1"\ntracer_provider:\n  processors:\n'
                        f"    - batch: {{schedule_delay: 100, {exporter}}}\n")
        with telemetry_of(monkeypatch, str(path)) as server:
            telemetry = server.telemetry
            (accounted,) = telemetry.accounted_of("spans")
            receiver.stop()
            emit_span(telemetry, "while down")
            wait_until(lambda: accounted.health.failing, what="the refused export")
            receiver.start()
            emit_span(telemetry, "when back")
            receiver.wait_for(lambda r: r.spans("when back"), timeout=30)
    assert {h.get("x-dask-token") for h in receiver.headers} == {"from-the-file"}
    assert elsewhere.requests == 0


def test_under_a_file_the_sdks_own_metrics_go_to_the_bridges_meter_provider(tmp_path, monkeypatch):
    """With OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true, the file's batch span
    processor and its metric exporter report the SDK's own instruments
    (``otel.sdk.processor.span.*``, ``otel.sdk.exporter.metric_data_point.*``) to the
    bridge's MeterProvider, as under the OTEL_* variables"""
    wanted = {"otel.sdk.processor.span.processed", "otel.sdk.exporter.metric_data_point.exported"}
    with OTLPReceiver("grpc") as receiver:
        monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
        with telemetry_of(monkeypatch, config_file(tmp_path, receiver)) as server:
            emit_span(server.telemetry, "counted by the SDK")
            receiver.wait_for(lambda r: wanted <= {p.name for p in r.metric_points() if p.value},
                              timeout=30)


def test_under_a_file_an_outage_is_probed_at_the_files_interval(tmp_path, monkeypatch):
    """A metric reader every second in the file, the OTEL_* interval at its 60 s
    default: while the collector answers UNAVAILABLE every scheduled export is a
    probe, and the first after it is back delivers (none skipped for 48 s)"""
    with OTLPReceiver("grpc", mode="unavailable") as receiver:
        monkeypatch.delenv("OTEL_METRIC_EXPORT_INTERVAL", raising=False)
        exporter = f"exporter: {{otlp_grpc: {{endpoint: \"{receiver.endpoint}\"}}}}"
        path = tmp_path / "otel.yaml"
        path.write_text(f'file_format: "1.1"\nmeter_provider:\n  readers:\n'
                        f"    - periodic: {{interval: 1000, {exporter}}}\n")
        with telemetry_of(monkeypatch, str(path)) as server:
            telemetry = server.telemetry
            telemetry.meter_provider.get_meter("test").create_counter("probed").add(1)
            (accounted,) = telemetry.accounted_of("metrics")
            assert accounted.health.interval == 1.0
            wait_until(lambda: receiver.rejected >= 2, what="two refused exports")
            receiver.mode = "ok"
            receiver.wait_for(lambda r: r.metric_points("probed"), timeout=30)
            # a probe per scheduled export: none dropped without a request (at the
            # OTEL_* interval, 47 of the next 48 would be)
            assert accounted.health.skipped == 0


def test_a_file_with_logs_only_holds_the_exporters_lines(tmp_path, monkeypatch, caplog):
    """Logs only, to a collector answering UNAVAILABLE: one WARNING of the bridge's,
    none of the SDK exporter's own lines (one per failed batch and retry)"""
    from dask_otel.export.accounting import HELD_EXPORTER_LOGS

    for name in list(logging.root.manager.loggerDict):  # as in a fresh process
        logging.getLogger(name).removeFilter(HELD_EXPORTER_LOGS)
    with OTLPReceiver("grpc", mode="unavailable") as receiver:
        exporter = f"exporter: {{otlp_grpc: {{endpoint: \"{receiver.endpoint}\"}}}}"
        path = tmp_path / "otel.yaml"
        path.write_text(f'file_format: "1.1"\nlogger_provider:\n  processors:\n'
                        f"    - batch: {{schedule_delay: 100, {exporter}}}\n")
        with caplog.at_level(logging.WARNING), telemetry_of(monkeypatch, str(path)) as server:
            assert server.telemetry.logs is not None and server.span_sink is None
            logging.getLogger("distributed.scheduler").warning("a line to export")
            wait_until(lambda: receiver.rejected >= 1, what="the refused export")
            (accounted,) = server.telemetry.accounted_of("logs")
            wait_until(lambda: accounted.health.failing, what="the failed export counted")
    sdk = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert sdk == []
    assert [r for r in caplog.records if "cannot export logs" in r.getMessage()]


def test_a_file_naming_an_unknown_exporter_is_one_error_naming_the_file_and_exporter(
    tmp_path, monkeypatch, caplog
):
    path = tmp_path / "otel.yaml"
    path.write_text('file_format: "1.1"\ntracer_provider:\n  processors:\n'
                    '    - batch: {exporter: {no_such_exporter: {}}}\n')
    monkeypatch.setenv("OTEL_CONFIG_FILE", str(path))
    with (
        caplog.at_level(logging.INFO, logger="dask_otel"),
        dask.config.set({"distributed.scheduler.preload": ["dask_otel"]}),
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert client.submit(inc, 1).result() == 2  # the cluster runs
        status = dask_otel.status(client)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(r.exc_info is None for r in errors)
    for text in (errors[0].getMessage(), status["scheduler"]["error"]):
        assert "OTEL_CONFIG_FILE" in text and str(path) in text, text
        assert "tracer_provider.processors[0]" in text and "no_such_exporter" in text, text


def test_the_files_general_attribute_limits_hold_for_the_bridges_spans(tmp_path, monkeypatch):
    """``attribute_limits`` at the top of the file, none under tracer_provider: the
    bridge's spans are cut to its length, not to the bridge's 4096"""
    with OTLPReceiver("grpc") as receiver:
        path = config_file(tmp_path, receiver, after=(
            'file_format: "1.1"', "attribute_limits:\n  attribute_value_length_limit: 8\n",
        ))
        with telemetry_of(monkeypatch, path) as server:
            assert server.span_sink.limits.max_span_attribute_length == 8
