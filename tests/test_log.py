"""The bridge's own log lines (logger ``dask_otel``) are Dask's: the same stream,
format and level filtering as the ``distributed`` logger's, set by dask config's
``logging:``, under ``dask scheduler`` and in a script that starts a LocalCluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from distributed import Client

from tests.support.cluster import wait_until
from tests.support.processes import REPO, dask_processes

#: Dask's default ``distributed.admin.log-format``: time, logger name, level
DASK_LINE = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - dask_otel - "
#: No collector in these tests: nothing to export
NO_EXPORT = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}


def dask_line(level: str, message: str) -> re.Pattern:
    return re.compile(f"{DASK_LINE}{level} - {message}", re.MULTILINE)


def test_dask_scheduler_logs_a_bad_value_at_error_in_dasks_format():
    env = {**NO_EXPORT, "DASK_OTEL__SPANS__EXPORT_DELAY": "soon"}
    with dask_processes(env, n_workers=0) as cluster:
        line = dask_line(
            "ERROR", r"dask_otel is off on scheduler tcp://127\.0\.0\.1:\d+: "
            r"otel\.spans\.export-delay: .*got 'soon'$",
        )
        wait_until(lambda: line.search(cluster.log("scheduler")), what="the ERROR line")
        log = cluster.log("scheduler")
    # not also as a bare line (Python's last-resort handler)
    assert not re.search(r"^dask_otel is off", log, re.MULTILINE), log


def scheduler_log_when_disabled(env: dict[str, str]) -> str:
    """The log of a ``dask scheduler`` whose bridge is switched off by otel.enabled,
    once Dask has run the preload (the bridge has logged what it logs by then)"""
    with dask_processes({**NO_EXPORT, "DASK_OTEL__ENABLED": "false", **env}, n_workers=0) as cluster:
        with Client(cluster.address, timeout=30) as client:
            wait_until(lambda: client.run_on_scheduler(preloaded), what="the preload")
        return cluster.log("scheduler")


def preloaded(dask_scheduler) -> bool:
    return "dask-otel" in dask_scheduler.plugins


INFO_LINE = dask_line("INFO", r"dask_otel: otel\.enabled is false on scheduler tcp://\S+; not exporting$")


def test_dask_scheduler_logs_the_bridges_info_lines():
    log = scheduler_log_when_disabled({})
    assert INFO_LINE.search(log), log


def test_dask_config_logging_sets_the_bridges_level_as_distributeds():
    """Not named in ``logging:``, the bridge's logger follows ``distributed``'s level;
    named, it has its own, like any ``distributed.*`` logger"""
    quiet = scheduler_log_when_disabled({"DASK_LOGGING__DISTRIBUTED": "warning"})
    assert not INFO_LINE.search(quiet), quiet
    own = scheduler_log_when_disabled(
        {"DASK_LOGGING__DISTRIBUTED": "warning", "DASK_LOGGING__DASK_OTEL": "info"}
    )
    assert INFO_LINE.search(own), own


def test_dask_worker_logs_the_bridges_info_lines():
    with dask_processes(NO_EXPORT, n_workers=0) as cluster:
        cluster.add_worker("off", env={"DASK_OTEL__ENABLED": "false"})
        line = dask_line(
            "INFO", r"dask_otel: otel\.enabled is false on worker tcp://\S+; not exporting$"
        )
        wait_until(lambda: line.search(cluster.log("off")), what="the INFO line")


SCRIPT = """
import dask
from distributed import Client, LocalCluster

if __name__ == "__main__":
    dask.config.set({{
        "distributed.scheduler.preload": ["dask_otel"],
        "otel.traces.exporter": "none",
        "otel.metrics.exporter": "none",
        "otel.spans.export-delay": "soon",
    }})
    with LocalCluster(n_workers=1, processes={processes}, dashboard_address="127.0.0.1:0",
                      **{host}) as cluster, Client(cluster) as client:
        assert client.submit(sum, [1, 2]).result() == 3
"""


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_local_cluster_script_logs_the_bridges_lines_as_dasks(processes, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(processes=processes, host={"host": "127.0.0.1"} if processes else {})))
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    line = dask_line("ERROR", r"dask_otel is off on scheduler \S+: otel\.spans\.export-delay")
    assert line.search(run.stderr), run.stderr


def test_the_sdks_fallback_lines_print_in_dasks_format(tmp_path):
    """A malformed OTEL_* variable the SDK falls back from (its WARNING, one with a
    traceback): in a script with no logging set up, on Dask's console in its format,
    not bare on stderr (Python's last resort)"""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(processes=False, host={}).replace(
        '"otel.traces.exporter": "none"', '"otel.traces.exporter": "console"').replace(
        '"otel.spans.export-delay": "soon"', '"otel.spans.export-delay": "1s"'))
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "soon", "OTEL_RESOURCE_ATTRIBUTES": "=,novalue",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    sdk = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - opentelemetry\.[\w.]+ - (WARNING|ERROR) - "
    assert re.search(sdk + "Unable to parse value for OTEL_BSP_SCHEDULE_DELAY", run.stderr,
                     re.MULTILINE), run.stderr
    assert re.search(sdk + "Invalid key value resource attribute pair novalue", run.stderr,
                     re.MULTILINE), run.stderr
    assert not re.search(r"^(Unable to parse|Invalid key value)", run.stderr, re.MULTILINE)


# --- Dask's console beside an OpenTelemetry handler on the root logger --------------

#: A process where instrumentation-logging put its handler on the root logger
#: (as opentelemetry-instrument does at start-up), then the dask instrumentor turned
#: on before or after distributed's import; it prints what the loggers have, then
#: logs a Dask line
CONSOLE_SCRIPT = """
import json, logging, sys
from opentelemetry.instrumentation.logging import LoggingInstrumentor
from dask_otel.instrumentor import DaskInstrumentor

LoggingInstrumentor().instrument()
{before}
if {instrumentor_first}:
    DaskInstrumentor().instrument()
    # nothing of Dask's yet: the set-up waits for distributed's import
    assert "dask_otel.log" not in sys.modules and "distributed" not in sys.modules
import distributed
skipped = not logging.getLogger("distributed").handlers
late = logging.getLogger("myapp.late")  # after distributed's set-up
if not {instrumentor_first}:
    DaskInstrumentor().instrument()
theirs = logging.getLogger("distributed")
print(json.dumps({{
    "skipped": skipped,
    "handlers": [type(h).__name__ for h in theirs.handlers],
    "propagate": theirs.propagate,
    "root": sorted(type(h).__name__ for h in logging.getLogger().handlers),
    "late_disabled": late.disabled,
}}))
logging.getLogger("distributed.scheduler").info("a Dask line")
"""


def run_console_script(before: str = "", instrumentor_first: bool = False) -> tuple[dict, str]:
    script = CONSOLE_SCRIPT.format(before=before, instrumentor_first=instrumentor_first)
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))},
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), run.stderr


@pytest.mark.parametrize("instrumentor_first", [False, True],
                         ids=["distributed-first", "instrumentor-first"])
def test_the_bridge_gives_dask_its_console_back_beside_an_otel_handler_on_the_root(
    instrumentor_first,
):
    """distributed skipped its console handler (an OpenTelemetry handler was on the
    root); the instrumentor runs distributed's set-up again, at once if distributed
    is imported, else right after its import: its stream handler, in its format,
    propagation off; the root keeps its handler"""
    loggers, stderr = run_console_script(instrumentor_first=instrumentor_first)
    assert loggers == {
        # with the instrumentor first, the set-up ran before the script looked
        "skipped": not instrumentor_first, "handlers": ["StreamHandler"],
        "propagate": False, "root": ["LoggingHandler"], "late_disabled": False,
    }
    assert re.search(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - distributed\.scheduler - INFO - a Dask line$",
        stderr, re.MULTILINE,
    ), stderr


def test_an_application_handler_on_the_root_keeps_dasks_lines():
    """Beside the application's own root handler (``basicConfig``) distributed skips
    its console without OpenTelemetry too: Dask's lines go to the root, and the
    bridge leaves that as it is"""
    loggers, stderr = run_console_script(before="logging.basicConfig(level=logging.INFO)")
    assert loggers == {
        "skipped": True, "handlers": [],
        "propagate": True, "root": ["LoggingHandler", "StreamHandler"],
        "late_disabled": False,
    }
    assert "INFO:distributed.scheduler:a Dask line" in stderr, stderr


def test_a_dict_config_of_dasks_logging_is_not_run_again():
    """A ``version: 1`` set-up (``logging.config.dictConfig``) does not look at the
    root's handlers: the bridge does not run it again, which would disable the
    loggers made since (``disable_existing_loggers``)"""
    loggers, _ = run_console_script(
        before="import dask; dask.config.set({'logging': {'version': 1}})"
    )
    assert loggers["late_disabled"] is False
    assert loggers["handlers"] == [] and loggers["propagate"] is True
