"""Dask's console under ``opentelemetry-instrument`` (dask_otel/log.py, docs/logs.md).

opentelemetry-instrumentation-logging puts a handler on the root logger when
``opentelemetry-instrument`` starts a process; distributed, imported after it,
then skips its console handler. Which comes first depends on the order in which
``opentelemetry-instrument`` finds the instrumentors' entry points (the order
importlib.metadata finds their distributions: ``sys.path`` order, then each
directory's listing order), and so on the environment. These tests fix the order
with one directory per distribution first on ``PYTHONPATH`` (copies of the
installed distributions' metadata, so the same instrumentors load) and run real
``dask scheduler`` and ``dask worker`` processes (with a Nanny and without) under
``opentelemetry-instrument``, comparing their console with the plain CLI's and
reading back what a real OTLP receiver gets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterator
from importlib.metadata import distribution
from pathlib import Path

import pytest
from distributed import Client

from tests.support.cluster import wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import FAST_ENV, PRELOAD_ENV, REPO, scheduler_address
from tests.test_instrumentor import (
    OPENTELEMETRY_INSTRUMENT,
    children_instrumented,
    needs_entry_point,
)

#: The distributions whose instrumentors the order is about
LOGGING, DASK = "opentelemetry-instrumentation-logging", "dask-otel"
#: instrumentation-logging's handler on the root logger before distributed is
#: imported (the console went dark), and the other way round
ORDERS = {"logging-first": (LOGGING, DASK), "dask-first": (DASK, LOGGING)}
#: Nothing but what the test is about: no spans, no metrics; the instrumentations
#: that make noise on a Dask server off (docs/zero-code.md)
QUIET = {
    "OTEL_SERVICE_NAME": "console",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "click,asyncio,tornado",
}
#: Dask's default ``distributed.admin.log-format``: time - logger - level - message
DASK_FORMAT = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - (\S+) - ([A-Z]+) - (.*)$")
#: What differs from run to run in a line: addresses, ports, pids, sizes, ids, paths
VARYING = re.compile(r"\S*\d\S*|/\S+")
#: Lines that depend on the machine's load or on the order in which the processes
#: close (a worker's last heartbeat racing its removal), not on the set-up
LOAD_DEPENDENT = (
    "Event loop was unresponsive",
    "GIL",
    "Received heartbeat from unregistered worker",
    "Failed to communicate with scheduler during heartbeat",
    "Connection to scheduler broken",
)
#: The processes of a test cluster, by name
SERVERS = ("scheduler", "nanny", "no-nanny")
#: The message a task logs to an application logger (it propagates to the root)
TASK_MESSAGE = "task line for the root logger"


def first_on_pythonpath(tmp_path: Path, order: tuple[str, ...]) -> list[str]:
    """One directory per distribution, in ``order``, each holding a copy of that
    installed distribution's metadata and entry points, to put first on
    ``PYTHONPATH``: ``opentelemetry-instrument`` then loads their instrumentors in
    that order, whatever the environment's own listing order"""
    directories = []
    for i, name in enumerate(order):
        dist = distribution(name)
        directory = tmp_path / f"first-{i}"
        info = directory / f"{name.replace('-', '_')}-{dist.version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(dist.read_text("METADATA") or dist.read_text("PKG-INFO"))
        (info / "entry_points.txt").write_text(dist.read_text("entry_points.txt"))
        directories.append(str(directory))
    return directories


def clean_env(extra: dict[str, str], pythonpath: list[str] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update(FAST_ENV)
    env.update(extra)
    # tests.support.tasks and this module are pickled by reference
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [*pythonpath, str(REPO), os.environ.get("PYTHONPATH")])
    )
    return env


@contextlib.contextmanager
def dask_servers(
    env: dict[str, str], tmp_path: Path, instrumented: Collection[str] = SERVERS,
    scheduler_args: tuple[str, ...] = (),
) -> Iterator[tuple[str, dict[str, Path], dict[str, subprocess.Popen]]]:
    """``dask scheduler`` and ``dask worker`` (with a Nanny and without), those named
    in ``instrumented`` under ``opentelemetry-instrument``; their consoles (stdout
    and stderr) in files"""
    scheduler_file = tmp_path / "scheduler.json"
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def spawn(name: str, *args: str) -> None:
        logs[name] = tmp_path / f"{name}.log"
        cmd = [*(OPENTELEMETRY_INSTRUMENT if name in instrumented else []), sys.executable, "-m", *args]
        # a scratch space of its own: in the shared one, another test's workers leave
        # lock files that a worker here reports purging ("Found stale lock file")
        scratch = {"DASK_TEMPORARY_DIRECTORY": str(tmp_path / "scratch")}
        procs[name] = subprocess.Popen(
            cmd, env={**env, **scratch}, cwd=tmp_path, stdout=logs[name].open("w"), stderr=subprocess.STDOUT
        )

    try:
        spawn("scheduler", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
              "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file),
              *scheduler_args)
        deadline = time.monotonic() + 60
        while (address := scheduler_address(scheduler_file)) is None:
            if time.monotonic() > deadline or procs["scheduler"].poll() is not None:
                raise RuntimeError(f"scheduler did not start:\n{logs['scheduler'].read_text()}")
            time.sleep(0.1)
        for name in ("nanny", "no-nanny"):
            spawn(name, "distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                  "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
                  "--name", name, *(["--no-nanny"] if name == "no-nanny" else []))
        yield address, logs, procs
    finally:
        # SIGINT (Ctrl-C): the workers first, then the scheduler once they are gone
        for group in ([p for n, p in procs.items() if n != "scheduler"], [procs.get("scheduler")]):
            for proc in filter(None, group):
                if proc.poll() is None:
                    proc.send_signal(2)
            for proc in filter(None, group):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_a_workflow(address: str) -> None:
    """Both workers registered, a task on each that logs to an application logger"""
    with Client(address, timeout=30) as client:
        client.wait_for_workers(2, timeout=60)
        for worker in client.scheduler_info()["workers"]:
            client.submit(
                logging.getLogger("myapp").warning, TASK_MESSAGE, workers=[worker], pure=False
            ).result(timeout=30)


def workflow_consoles(
    env: dict[str, str], tmp_path: Path, instrumented: Collection[str]
) -> tuple[dict[str, Counter], dict[str, str]]:
    """The consoles of the servers once a workflow ran and its client left (what
    they print before they are stopped: the order in which processes close makes
    the rest vary from run to run), and their whole text once they stopped"""
    with dask_servers(env, tmp_path, instrumented) as (address, logs, _):
        run_a_workflow(address)
        wait_until(
            lambda: "Close client connection" in logs["scheduler"].read_text(), 30,
            "the client's leaving",
        )
        before_the_stop = {name: console(path.read_text()) for name, path in logs.items()}
    return before_the_stop, {name: path.read_text() for name, path in logs.items()}


def console(log: str) -> Counter:
    """The Dask-format lines of a console, as (logger, level, message with what
    varies from run to run blanked), counted; load-dependent lines left out"""
    lines = Counter()
    for line in log.splitlines():
        if (match := DASK_FORMAT.match(line)) and not any(s in line for s in LOAD_DEPENDENT):
            name, level, message = match.groups()
            lines[(name, level, VARYING.sub("#", message))] += 1
    return lines


@pytest.fixture(scope="module")
def plain_consoles(tmp_path_factory) -> dict[str, Counter]:
    """The consoles of plain ``dask scheduler`` (the bridge by the preload
    variable) and ``dask worker``s running the same workflow"""
    tmp_path = tmp_path_factory.mktemp("plain")
    env = clean_env({**QUIET, **PRELOAD_ENV, "OTEL_LOGS_EXPORTER": "none"})
    return workflow_consoles(env, tmp_path, instrumented=())[0]


def without_the_preload(lines: Counter) -> Counter:
    """How the bridge got there: the instrumentor says nothing of itself"""
    return Counter({
        line: n for line, n in lines.items()
        if not (line[0] == "distributed.preloading" and line[2].endswith(": dask_otel"))
    })


def differences(ours: Counter, theirs: Counter) -> dict[str, Counter]:
    return {"only under opentelemetry-instrument": ours - theirs, "only plain": theirs - ours}


@needs_entry_point
@pytest.mark.slow
@pytest.mark.parametrize(
    "order, logs_exporter",
    [("logging-first", "none"), ("logging-first", "otlp"), ("dask-first", "otlp")],
)
def test_opentelemetry_instrument_dask_prints_what_dask_prints(
    plain_consoles, tmp_path, order, logs_exporter
):
    """Under ``opentelemetry-instrument`` the scheduler, a worker and a Nanny and its
    worker print the lines the plain CLI prints (up to their stop, then their closing
    lines), in Dask's format, whichever
    instrumentor loads first, with logs exported or not; with
    ``OTEL_LOGS_EXPORTER=none`` nothing is exported (docs/zero-code.md: "keep logs
    local")"""
    with OTLPReceiver("grpc") as receiver:
        env = clean_env(
            {**QUIET, **receiver.env(), "OTEL_LOGS_EXPORTER": logs_exporter},
            first_on_pythonpath(tmp_path, ORDERS[order]),
        )
        consoles, texts = workflow_consoles(env, tmp_path, instrumented=SERVERS)
        if logs_exporter == "none":
            time.sleep(1)  # a batch would have come by now
            assert receiver.logs() == []
    for name, lines in consoles.items():
        assert lines, f"{name} printed nothing:\n{texts[name]}"
        plain = plain_consoles[name] if name != "scheduler" else without_the_preload(
            plain_consoles[name]
        )
        assert lines == plain, (name, differences(lines, plain))
        assert console(texts[name]) - lines, f"{name} printed nothing as it closed"
    assert ("distributed.scheduler", "INFO", "End scheduler") in console(texts["scheduler"])


@needs_entry_point
@pytest.mark.slow
def test_with_the_dask_instrumentation_disabled_the_console_comes_with_the_preload(
    plain_consoles, tmp_path
):
    """With ``dask`` in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` and the preload
    variable, a scheduler prints Dask's lines from its preload's import on
    (docs/logs.md): the plain CLI's lines less those logged before, and a worker's
    lines are the plain CLI's, fewer"""
    env = clean_env(
        {**QUIET, **PRELOAD_ENV, "OTEL_LOGS_EXPORTER": "none",
         "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": QUIET["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] + ",dask"},
        first_on_pythonpath(tmp_path, ORDERS["logging-first"]),
    )
    consoles = workflow_consoles(env, tmp_path, instrumented=SERVERS)[0]
    logged_before = Counter({
        ("distributed.scheduler", "INFO", "-" * 47): 1,
        ("distributed.preloading", "INFO", "Creating preload: dask_otel"): 1,
    })
    assert consoles["scheduler"] == plain_consoles["scheduler"] - logged_before, differences(
        consoles["scheduler"], plain_consoles["scheduler"]
    )
    for worker in ("nanny", "no-nanny"):
        assert consoles[worker] and not consoles[worker] - plain_consoles[worker], worker


@needs_entry_point
@pytest.mark.slow
def test_under_opentelemetry_instrument_dasks_lines_are_exported_once_by_the_bridge(tmp_path):
    """With ``OTEL_LOGS_EXPORTER=otlp`` and instrumentation-logging's handler on the
    root logger first: Dask's lines arrive once, with the bridge's resource (Dask's
    identity); a Nanny's lines, and a worker's before its bridge starts, are not
    exported; a task's line to an application logger arrives once, through the
    root logger's OpenTelemetry handler (docs/logs.md)"""
    with OTLPReceiver("grpc") as receiver:
        env = clean_env(
            {**QUIET, **receiver.env(), "OTEL_LOGS_EXPORTER": "otlp"},
            first_on_pythonpath(tmp_path, ORDERS["logging-first"]),
        )
        with dask_servers(env, tmp_path, instrumented=SERVERS) as (address, logs, procs):
            run_a_workflow(address)
            pids = {name: proc.pid for name, proc in procs.items()}  # the command execs
            wait_until(
                lambda: [r for r in receiver.logs() if r.body == TASK_MESSAGE][1:],
                30, "the tasks' lines",
            )
            wait_until(
                lambda: [r for r in receiver.logs() if str(r.body).startswith("Register worker")],
                30, "the scheduler's 'Register worker' lines",
            )
        records = receiver.logs()
    copies = Counter((r.body, r.time, r.resource.get("process.pid")) for r in records)
    assert max(copies.values()) == 1, [key for key, n in copies.items() if n > 1]

    dask_lines = [r for r in records if r.scope.startswith("distributed")]
    registered = [r for r in dask_lines if str(r.body).startswith("Register worker")]
    assert len(registered) == 2, [r.body for r in registered]
    for record in registered:
        assert record.resource["dask.scheduler.address"] == address
        assert record.resource["process.pid"] == pids["scheduler"]
        assert record.resource.get("host.name")
        assert record.resource["service.name"] == "console"
    # printed, not exported: the Nanny runs no bridge; a worker's first lines
    # come before its bridge starts
    assert "Start Nanny at" in logs["nanny"].read_text()
    assert not [r for r in records if r.resource.get("process.pid") == pids["nanny"]]
    assert "Start worker at" in logs["no-nanny"].read_text()
    assert not [r for r in records if str(r.body).startswith("Start worker at")]
    # the root logger's records are the instrumentation's handler's (its provider's
    # resource: the SDK's, without Dask's identity), once each; a Nanny's worker
    # runs without it on opentelemetry-instrumentation 0.62b0 (docs/zero-code.md)
    # and its root's records are the bridge's
    from_tasks = [r for r in records if r.body == TASK_MESSAGE]
    assert len(from_tasks) == 2
    instrumented = [r for r in from_tasks if "dask.scheduler.address" not in r.resource]
    assert len(instrumented) == (2 if children_instrumented() else 1)


@needs_entry_point
@pytest.mark.slow
def test_a_bad_value_is_on_the_console_of_opentelemetry_instrument_dask_scheduler(tmp_path):
    """README ("Configuration"): a bad value is logged at ERROR naming the key and
    the value, in Dask's format, under ``opentelemetry-instrument`` too"""
    env = clean_env(
        {**QUIET, "OTEL_LOGS_EXPORTER": "none", "DASK_OTEL__SPANS__EXPORT_DELAY": "soon"},
        first_on_pythonpath(tmp_path, ORDERS["logging-first"]),
    )
    line = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - dask_otel - ERROR - dask_otel is off on "
        r"scheduler tcp://127\.0\.0\.1:\d+: otel\.spans\.export-delay: .*got 'soon'$",
        re.MULTILINE,
    )
    with dask_servers(env, tmp_path, instrumented=SERVERS) as (_, logs, _):
        wait_until(lambda: line.search(logs["scheduler"].read_text()), 60, "the ERROR line")


@needs_entry_point
@pytest.mark.slow
def test_the_preload_trap_warning_is_on_the_console_of_opentelemetry_instrument_dask_worker(
    tmp_path,
):
    """A plain ``dask scheduler --preload my_auth_plugin`` with the preload variable
    runs no bridge (docs/zero-code.md, the trap); a worker under
    ``opentelemetry-instrument``, with a Nanny (where its worker is instrumented) or
    without, prints the WARNING that says so in Dask's format, with
    instrumentation-logging's handler on its root logger first"""
    preload = tmp_path / "my_auth_plugin.py"
    preload.write_text("def dask_setup(scheduler):\n    pass\n")
    env = clean_env(
        {**QUIET, **PRELOAD_ENV, "OTEL_LOGS_EXPORTER": "none"},
        first_on_pythonpath(tmp_path, ORDERS["logging-first"]),
    )
    warning = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - dask_otel - WARNING - dask_otel: "
        r"scheduler tcp://127\.0\.0\.1:\d+ has no dask_otel bridge, so worker \S+ exports "
        r"nothing of Dask's .* --preload dask_otel",
        re.MULTILINE,
    )
    with dask_servers(
        env, tmp_path, instrumented=("nanny", "no-nanny"), scheduler_args=("--preload", str(preload))
    ) as (_, logs, _):
        # a Nanny's worker runs under the instrumentor from opentelemetry-instrumentation
        # 0.63b0 (docs/zero-code.md)
        for worker in ("nanny", "no-nanny") if children_instrumented() else ("no-nanny",):
            log = logs[worker]
            wait_until(lambda: warning.search(log.read_text()), 60, f"{worker}'s WARNING")
