"""Log records as OpenTelemetry logs (dask_otel.export.logs): correlated with the
task they were written in, Dask's own lines (its loggers do not propagate), each
record exported once beside other OTel handlers, over a real OTLP receiver from
real worker processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from distributed import span

from tests.support.cluster import dask_span_ids, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.processes import REPO, dask_processes
from tests.support.tasks import (
    log_in_task,
    log_info_in_task,
    warn_to,
    warn_to_distributed_worker,
)

#: Exported as soon as a record is logged: tests read them while the cluster runs
FAST_LOGS = {"OTEL_BLRP_SCHEDULE_DELAY": "100"}


def records(receiver: OTLPReceiver, body_starts: str, mentioning: str = "") -> list:
    """The records whose body starts with ``body_starts`` and mentions ``mentioning``
    (a worker's address or name: Dask's wording around them varies by version)"""
    return [
        g for g in receiver.logs()
        if str(g.body).startswith(body_starts) and mentioning in str(g.body)
    ]


@pytest.mark.parametrize("source", ["env", "config"])
def test_log_line_in_task_arrives_with_the_tasks_trace_and_span_id(monkeypatch, source):
    config = {"otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100"})
        if source == "env":
            monkeypatch.setenv("OTEL_LOGS_EXPORTER", "otlp")
        else:
            config["otel.logs.exporter"] = "otlp"
        with otel_cluster(config, processes=True) as (client, _):
            with span("scoring") as sid:
                client.submit(log_in_task, 42).result()
            receiver.wait_for(lambda r: [g for g in r.logs() if g.body == "scored partition 42"])
    (record,) = [g for g in receiver.logs() if g.body == "scored partition 42"]
    trace_id, span_id = dask_span_ids(sid)
    assert record.trace_id == f"{trace_id:032x}"
    assert record.span_id == f"{span_id:016x}"
    assert record.severity_text == "WARN"
    assert record.resource["service.name"] == "dask"
    assert "dask.scheduler.address" in record.resource


def test_log_level_threshold_and_task_spans_context(monkeypatch):
    config = {
        "otel.logs.exporter": "otlp",
        "otel.logs.level": "WARNING",
        "otel.tasks.spans": True,
        "otel.traces.exporter": "otlp",
        "otel.flush-timeout": "2s",
    }
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100",
                                   "OTEL_BSP_SCHEDULE_DELAY": "100"})
        with otel_cluster(config, processes=True) as (client, _):
            with span("levels"):
                future = client.submit(log_in_task, 7)
                future.result()
                client.submit(log_info_in_task, 8).result()
            record = receiver.wait_for(
                lambda r: next((g for g in r.logs() if g.body == "scored partition 7"), None)
            )
            (task_span,) = receiver.wait_for(
                lambda r: [s for s in r.spans("run/log_in_task")]
            )
            time.sleep(0.5)
    # a chosen task's span is its context: its log line carries the task span's id
    assert (record.trace_id, record.span_id) == (task_span.trace_id, task_span.span_id)
    assert not [g for g in receiver.logs() if g.body == "quiet detail 8"]
    assert all(g.severity_number >= 13 for g in receiver.logs())  # WARN and above


def test_the_exporters_and_the_bridges_own_records_are_not_exported(monkeypatch):
    """docs/logs.md, "Not": a WARNING to an ``opentelemetry.*`` logger (an exporter's
    complaint would feed back) or to ``dask_otel`` (not named in dask config's
    ``logging``) is not exported; the same WARNING to an application logger is"""
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            for logger_name in ("opentelemetry.exporter.fake", "dask_otel", "myapp"):
                client.submit(warn_to, logger_name, f"a line to {logger_name}").result()
            receiver.wait_for(lambda r: records(r, "a line to myapp"))
            time.sleep(0.5)  # the same batch, or the next
    assert records(receiver, "a line to opentelemetry") == []
    assert records(receiver, "a line to dask_otel") == []


def test_log_export_is_off_by_default():
    from dask_otel.config import read_config

    assert read_config().logs_exporters == ()


def test_log_export_outage_is_logged_once(monkeypatch, caplog):
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "1s"}
    with OTLPReceiver("grpc", mode="unavailable") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), "OTEL_BLRP_SCHEDULE_DELAY": "100",
                                   "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
        with caplog.at_level(logging.INFO):
            with otel_cluster(config) as (client, _):
                for i in range(4):
                    client.submit(log_in_task, i).result()
                    wait_until(lambda i=i: receiver.rejected > i, timeout=10)
                receiver.mode = "ok"
                client.submit(log_in_task, 100).result()
                receiver.wait_for(lambda r: [g for g in r.logs() if g.body == "scored partition 100"])
    told = [r.getMessage() for r in caplog.records if "cannot export logs" in r.getMessage()]
    assert len(told) == 1, told
    assert any("logs export recovered" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]


def test_dask_own_lines_from_worker_processes_arrive_once(monkeypatch):
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            client.submit(warn_to_distributed_worker, 3).result()
            client.cluster.scale(2)
            client.wait_for_workers(2)
            workers = sorted(client.scheduler_info()["workers"])
            receiver.wait_for(lambda r: len(records(r, "Starting worker compute stream")) >= 2)
            receiver.wait_for(lambda r: records(r, "task 3 saw a slow disk"))
            scheduler_pid = os.getpid()
        time.sleep(0.5)  # anything exported twice would have arrived
    for address in workers:
        (registered,) = records(receiver, "Register worker", f"{address}")
        assert len(records(receiver, "Starting worker compute stream", address)) == 1
        assert registered.scope == "distributed.scheduler"
        assert registered.resource["process.pid"] == scheduler_pid
    (warned,) = records(receiver, "task 3 saw a slow disk")
    assert warned.scope == "distributed.worker"
    assert warned.severity_text == "WARN"
    assert warned.resource["service.name"] == "dask"
    assert warned.resource["process.pid"] != scheduler_pid  # the worker process's resource
    assert "dask.scheduler.address" in warned.resource


def test_dask_own_lines_from_dask_scheduler_and_dask_worker_arrive_once():
    """Also a logger the user adds to dask config's ``logging`` (``report``), which
    distributed configures as its own: its handler, propagate = False"""
    with OTLPReceiver("grpc") as receiver:
        env = {**receiver.env(), **FAST_LOGS, "OTEL_LOGS_EXPORTER": "otlp",
               "DASK_LOGGING__REPORT": "info"}
        with dask_processes(env) as procs:
            with procs.client() as client:
                client.submit(warn_to_distributed_worker, 4, workers=["worker-0"]).result()
                client.submit(log_in_task, 4, workers=["worker-0"]).result()
                receiver.wait_for(lambda r: records(r, "task 4") and records(r, "scored partition 4"))
            procs.procs["worker-1"].send_signal(signal.SIGKILL)
            receiver.wait_for(lambda r: records(r, "Remove worker", "name: worker-1"))
            time.sleep(0.5)
            worker_0_stderr = procs.log("worker-0")
    for name in ("worker-0", "worker-1"):
        assert len(records(receiver, "Register worker", f"name: {name}")) == 1
    # worker-0 is removed too, when the processes stop
    (removed,) = records(receiver, "Remove worker", "name: worker-1")
    assert removed.scope == "distributed.scheduler"
    (warned,) = records(receiver, "task 4 saw a slow disk")
    assert warned.resource["service.name"] == "dask"
    (users,) = records(receiver, "scored partition 4")
    assert users.scope == "report"
    # What Dask prints is unchanged: each line once, in Dask's own format
    for logger_name, line in [("distributed.worker", "task 4 saw a slow disk"),
                              ("report", "scored partition 4")]:
        printed = [p for p in worker_0_stderr.splitlines() if line in p]
        assert len(printed) == 1, worker_0_stderr
        assert f" - {logger_name} - WARNING - {line}" in printed[0]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_dask_logger_that_propagates_is_exported_once(monkeypatch, when):
    """A user who sets ``propagate = True`` on ``distributed``, before the cluster
    starts or while it runs: its records reach the root logger's handler too, and
    are exported by one of the two"""
    if when == "before":
        monkeypatch.setattr(logging.getLogger("distributed"), "propagate", True)
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config) as (client, _):
            if when == "after":
                monkeypatch.setattr(logging.getLogger("distributed"), "propagate", True)
            client.submit(warn_to_distributed_worker, 5).result()
            client.submit(log_in_task, 5).result()
            receiver.wait_for(lambda r: records(r, "task 5") and records(r, "scored partition 5"))
            time.sleep(0.5)
            workers = sorted(client.scheduler_info()["workers"])
    assert len(records(receiver, "task 5 saw a slow disk")) == 1
    assert len(records(receiver, "scored partition 5")) == 1
    for address in workers:
        assert len(records(receiver, "Register worker", address)) == 1


@pytest.mark.parametrize("added", ["before", "after"])
def test_a_users_otel_handler_on_the_root_logger_is_not_doubled(monkeypatch, added):
    """The user's LoggingHandler on the root logger, added before the cluster starts
    (the bridge adds none there) or while it runs (the bridge's stands aside)"""
    from opentelemetry.instrumentation.logging.handler import LoggingHandler
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    users_exporter = InMemoryLogRecordExporter()
    users_provider = LoggerProvider(shutdown_on_exit=False)
    users_provider.add_log_record_processor(SimpleLogRecordProcessor(users_exporter))
    users_handler = LoggingHandler(logger_provider=users_provider)
    root, dask_logger = logging.getLogger(), logging.getLogger("distributed")
    if added == "before":
        root.addHandler(users_handler)
    before = (list(root.handlers), list(dask_logger.handlers))
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}
    try:
        with OTLPReceiver("grpc") as receiver:
            set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
            with otel_cluster(config) as (client, _):
                if added == "after":
                    root.addHandler(users_handler)
                otel_on_root = [h for h in root.handlers if isinstance(h, LoggingHandler)]
                client.submit(log_in_task, 6).result()
                client.submit(warn_to_distributed_worker, 6).result()
                receiver.wait_for(lambda r: records(r, "task 6 saw a slow disk"))
                time.sleep(0.5)
            if added == "after":
                root.removeHandler(users_handler)
            after = (list(root.handlers), list(dask_logger.handlers))
    finally:
        root.removeHandler(users_handler)
        users_provider.shutdown()
    if added == "before":
        assert otel_on_root == [users_handler]
    else:
        assert len(otel_on_root) == 2
    users_bodies = [r.log_record.body for r in users_exporter.get_finished_logs()]
    # the root's records: the user's handler exports them, ours not
    assert users_bodies.count("scored partition 6") == 1
    assert not records(receiver, "scored partition 6")
    # Dask's own (they never reach the root): ours, once
    assert len(records(receiver, "task 6 saw a slow disk")) == 1
    assert "task 6 saw a slow disk" not in users_bodies
    # released with the cluster: no handler of ours left anywhere
    assert after == before


INSTRUMENTED_APPLICATION = """
    import logging

    import dask
    from distributed import Client, LocalCluster

    from tests.support.tasks import log_in_task, warn_to_distributed_worker

    if __name__ == "__main__":
        config = {
            "distributed.scheduler.preload": ["dask_otel"],
            "otel.logs.exporter": "otlp",
            "otel.traces.exporter": "none",
            "otel.metrics.exporter": "none",
        }
        with dask.config.set(config):
            with LocalCluster(n_workers=1, processes=False,
                              dashboard_address="127.0.0.1:0") as cluster:
                with Client(cluster) as client:
                    client.submit(log_in_task, 7).result()
                    client.submit(warn_to_distributed_worker, 7).result()
        logging.getLogger("app").warning("application done")
"""


@pytest.mark.parametrize("sdk_handler", [False, True], ids=["instrumentation-logging", "sdk"])
def test_under_opentelemetry_instrument_each_record_is_exported_once(tmp_path, sdk_handler):
    """``opentelemetry-instrument`` with the logging instrumentation installed puts its
    handler on the root logger (the SDK's with
    OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED=true): the bridge adds none there"""
    pytest.importorskip("opentelemetry.instrumentation.logging")
    # configures the global LoggerProvider from OTEL_LOGS_EXPORTER (dask-otel[test])
    pytest.importorskip("opentelemetry.distro")
    script = tmp_path / "application.py"
    script.write_text(textwrap.dedent(INSTRUMENTED_APPLICATION))
    with OTLPReceiver("grpc") as receiver:
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "DASK_"))
        }
        env.update(receiver.env())
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OTEL_SERVICE_NAME": "nightly-report",
            "OTEL_LOGS_EXPORTER": "otlp",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            **FAST_LOGS,
        })
        if sdk_handler:
            env["OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED"] = "true"
        instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
        done = subprocess.run(
            [instrument, sys.executable, str(script)], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        receiver.wait_for(lambda r: records(r, "application done"))
        time.sleep(0.5)
    # the application's records (tasks' too): the instrumentation's handler, once
    (in_task,) = records(receiver, "scored partition 7")
    assert in_task.resource["service.name"] == "nightly-report"
    assert len(records(receiver, "application done")) == 1
    # Dask's own: the bridge's handler, once
    assert len(records(receiver, "task 7 saw a slow disk")) == 1
    assert len(records(receiver, "Register worker")) == 1


def test_without_instrumentation_logging_the_sdks_handler_exports(monkeypatch):
    """opentelemetry-instrumentation-logging is an extra (``dask-otel[logs]``):
    without it, the SDK's deprecated handler, placed the same way"""
    from opentelemetry.sdk._logs import LoggingHandler as SDKLoggingHandler

    monkeypatch.setitem(sys.modules, "opentelemetry.instrumentation.logging.handler", None)
    config = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config) as (client, _):
            ours = [h for h in logging.getLogger("distributed").handlers
                    if isinstance(h, SDKLoggingHandler)]
            client.submit(warn_to_distributed_worker, 8).result()
            client.submit(log_in_task, 8).result()
            receiver.wait_for(lambda r: records(r, "task 8") and records(r, "scored partition 8"))
            time.sleep(0.5)
    assert len(ours) == 1
    assert len(records(receiver, "task 8 saw a slow disk")) == 1
    assert len(records(receiver, "scored partition 8")) == 1


def test_the_loggers_distributed_configures_are_read_from_each_config_style(tmp_path):
    from dask_otel.export.logs import DISTRIBUTED_LOGGERS, dask_logger_names

    assert dask_logger_names({}) == list(DISTRIBUTED_LOGGERS)
    old_style = {"logging": {"distributed": "debug", "myapp": "info"}}
    assert dask_logger_names(old_style) == [*DISTRIBUTED_LOGGERS, "myapp"]
    under_distributed = {"distributed": {"logging": {"distributed.shuffle": "debug"}}}
    assert dask_logger_names(under_distributed)[-1] == "distributed.shuffle"
    dict_config = {"logging": {"version": 1, "loggers": {"myapp.jobs": {"level": "INFO"}}}}
    assert dask_logger_names(dict_config)[-1] == "myapp.jobs"
    ini = tmp_path / "logging.ini"
    ini.write_text(textwrap.dedent("""
        [loggers]
        keys = root, jobs
        [logger_root]
        handlers =
        [logger_jobs]
        qualname = myapp.jobs
        handlers =
    """))
    assert dask_logger_names({"logging-file-config": str(ini)})[-1] == "myapp.jobs"
