"""dask_otel.instrumentor: zero-code (``opentelemetry-instrument``), and one bridge
whatever paths turn it on.

The in-process tests drive :class:`DaskInstrumentor` as ``opentelemetry-instrument``
does (``instrument()`` with no arguments); the process tests run the real command,
with the ``dask`` entry point of ``opentelemetry_instrumentor`` installed (``pip
install -e '.[test]'``), the SDK's global providers set up by opentelemetry-distro,
and read back from the harness OTLP receiver what arrives.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from importlib.metadata import entry_points, version
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster, Scheduler, Worker, span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

import dask_otel
from dask_otel.instrumentor import DaskInstrumentor
from tests.support.cluster import (
    MEMORY_CONFIG,
    UNINSTRUMENTED_CONFIG,
    Mirrored,
    cluster_kwargs,
)
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import FAST_ENV, PRELOAD_ENV, REPO, scheduler_address
from tests.support.tasks import inc, user_work

#: ``opentelemetry-instrument``, as its console script runs it, with this interpreter
OPENTELEMETRY_INSTRUMENT = [
    sys.executable, "-c",
    (
        "import sys; from opentelemetry.instrumentation.auto_instrumentation import run; "
        "sys.argv[0] = 'opentelemetry-instrument'; sys.exit(run())"
    ),
]


def entry_point_installed() -> bool:
    return any(
        ep.name == "dask" and ep.value.startswith("dask_otel.instrumentor")
        for ep in entry_points(group="opentelemetry_instrumentor")
    )


def distro_installed() -> bool:
    return any(entry_points(group="opentelemetry_distro"))


def children_instrumented() -> bool:
    """opentelemetry-instrumentation 0.63b0+ instruments the processes the command
    starts (Nanny-spawned workers); 0.62b0 (opentelemetry 1.41) takes its
    sitecustomize out of their PYTHONPATH (docs/zero-code.md)"""
    from packaging.version import Version

    return Version(version("opentelemetry-instrumentation")) >= Version("0.63b0")


needs_entry_point = pytest.mark.skipif(
    not entry_point_installed() and not os.environ.get("CI"),
    reason="the dask entry point of opentelemetry_instrumentor is not installed "
    "(pip install -e '.[test]')",
)


@pytest.fixture
def instrumentor():
    """The instrumentor, on, as opentelemetry-instrument turns it on; off after"""
    instrumentor = DaskInstrumentor()
    instrumentor.instrument()
    try:
        yield instrumentor
    finally:
        instrumentor.uninstrument()


def user_preload(tmp_path: Path) -> Path:
    """A user's own scheduler preload, which names nothing of dask_otel"""
    module = tmp_path / "my_auth_plugin.py"
    module.write_text("def dask_setup(scheduler):\n    scheduler.my_auth_plugin = True\n")
    return module


# --- in process ---------------------------------------------------------------------


def test_instrumentor_adds_the_bridge_to_every_scheduler_and_uninstrument_restores():
    original = Scheduler.__init__
    original_worker_start = Worker.start_unsafe
    instrumentor = DaskInstrumentor()
    instrumentor.instrument()
    try:
        assert Scheduler.__init__ is not original
        with dask.config.set(UNINSTRUMENTED_CONFIG):
            for _ in range(2):  # every scheduler built while it is on
                with LocalCluster(**cluster_kwargs()) as cluster, Client(cluster) as client:
                    with span("zero-code") as sid:
                        assert client.gather(client.map(inc, range(3))) == [1, 2, 3]
                    Mirrored(cluster).by_dask_id(sid)
                    status = dask_otel.status(client)
                    assert status["scheduler"]["paths"] == ["instrumentor"]
                    assert status["scheduler"]["error"] is None
                    assert all(w["task_context"] for w in status["workers"].values())
    finally:
        instrumentor.uninstrument()
    assert Scheduler.__init__ is original
    assert Worker.start_unsafe is original_worker_start
    with dask.config.set(UNINSTRUMENTED_CONFIG):
        with LocalCluster(**cluster_kwargs(n_workers=1)) as cluster:
            assert "dask-otel" not in cluster.scheduler.plugins


def test_every_path_at_once_gives_one_bridge_and_each_span_once(instrumentor):
    """instrumentor + preload key + dask_otel.instrument(client): one scheduler
    plugin, one worker plugin per worker, every span exported once"""
    with dask.config.set(MEMORY_CONFIG):  # the preload key too
        with LocalCluster(**cluster_kwargs()) as cluster, Client(cluster) as client:
            dask_otel.instrument(client)
            dask_otel.instrument(client)
            scheduler = cluster.scheduler
            bridges = [type(p).__name__ for p in scheduler.plugins.values()]
            assert bridges.count("OtelSchedulerPlugin") == 1
            per_worker = client.run(lambda dask_worker: [
                type(p).__name__ for p in dask_worker.plugins.values()
            ].count("OtelWorkerPlugin"))
            assert set(per_worker.values()) == {1}
            with span("all paths") as sid:
                client.gather(client.map(inc, range(4)))
            mirrored = Mirrored(cluster)
            mirrored.by_dask_id(sid)
            status = dask_otel.status(client)
            assert status["scheduler"]["paths"] == ["instrumentor", "preload", "client"]
            assert status["warning"] is None
            # the execute hook is installed once on each worker
            hooks = client.run(
                lambda dask_worker: type(dask_worker.plugins["dask-otel"].bridge.task_context).__name__
            )
            assert set(hooks.values()) == {"TaskContextHook"}
            time.sleep(0.5)  # a second export would come one poll later
            ids = Counter(s.context.span_id for s in mirrored.spans())
            assert ids and max(ids.values()) == 1, ids


def test_a_command_line_preload_of_something_else_keeps_the_instrumentors_bridge(
    instrumentor, tmp_path
):
    """``dask scheduler --preload my_plugin`` (Scheduler(preload=...)) drops the
    config preload, not the instrumentor's bridge"""
    other = str(user_preload(tmp_path))

    async def plugins() -> tuple[set[str], bool]:
        async with Scheduler(dashboard=False, port=0, preload=[other]) as scheduler:
            return set(scheduler.plugins), getattr(scheduler, "my_auth_plugin", False)

    import asyncio

    with dask.config.set(MEMORY_CONFIG):
        names, user_preload_ran = asyncio.run(plugins())
    assert "dask-otel" in names and user_preload_ran


def test_status_names_the_preload_trap(tmp_path):
    """Without the instrumentor, ``--preload my_plugin`` silently drops the config
    preload: status() says so, and how to fix it"""
    other = str(user_preload(tmp_path))
    with dask.config.set(MEMORY_CONFIG):
        with LocalCluster(**cluster_kwargs(n_workers=1, scheduler_kwargs={"preload": [other]})) as cluster:
            with Client(cluster) as client:
                assert "dask-otel" not in cluster.scheduler.plugins
                status = dask_otel.status(client)
    assert status["scheduler"] is None
    warning = status["warning"]
    assert warning and "--preload" in warning and "my_auth_plugin" in warning
    assert "opentelemetry-instrument" in warning and "dask_otel.instrument(client)" in warning


def test_the_tracer_provider_given_to_instrument_names_the_service():
    """instrument(tracer_provider=...): the bridge's spans carry that provider's
    service.name, as application spans made with it do; status() says why"""
    provider = TracerProvider(resource=Resource.create({"service.name": "reports"}))
    instrumentor = DaskInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        with dask.config.set(UNINSTRUMENTED_CONFIG):
            with LocalCluster(**cluster_kwargs(n_workers=1)) as cluster, Client(cluster) as client:
                with span("named") as sid:
                    client.submit(inc, 1).result()
                exported = Mirrored(cluster).by_dask_id(sid)
                status = dask_otel.status(client)
    finally:
        instrumentor.uninstrument()
    assert exported.resource.attributes["service.name"] == "reports"
    assert status["scheduler"]["service_name"] == {
        "name": "reports", "from": "DaskInstrumentor.instrument(tracer_provider=)"
    }


# --- real processes under opentelemetry-instrument ---------------------------------


def zero_code_env(receiver: OTLPReceiver, preload_variable: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update(receiver.env())
    env.update(FAST_ENV)
    env.update({
        # tests.support.tasks is pickled by reference; the user's preload is a path
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "host,process,os",
        # what opentelemetry-distro would export too, not the subject here
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    })
    if preload_variable:
        env.update(PRELOAD_ENV)
    if not children_instrumented():
        # A Nanny's worker runs without the SDK's global providers: its task
        # code exports through the bridge's, named as the rule says (`dask`), and
        # only OTEL_SERVICE_NAME gives every process one name
        env["OTEL_SERVICE_NAME"] = "zero-code"
    return env


@contextlib.contextmanager
def instrumented_processes(
    env: dict[str, str], tmp_path: Path, preload: Path, instrumented_scheduler: bool = True,
    workers: tuple[str, ...] = ("nanny", "no-nanny"),
):
    """``opentelemetry-instrument dask scheduler --preload <preload>`` (or plain
    ``dask scheduler``) and ``opentelemetry-instrument dask worker``, with a Nanny
    and without"""
    scheduler_file = tmp_path / "scheduler.json"
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def spawn(name: str, *args: str) -> None:
        logs[name] = tmp_path / f"{name}.log"
        instrument = instrumented_scheduler or name != "scheduler"
        cmd = [*(OPENTELEMETRY_INSTRUMENT if instrument else []), sys.executable, "-m", *args]
        procs[name] = subprocess.Popen(
            cmd, env=env, cwd=tmp_path, stdout=logs[name].open("w"), stderr=subprocess.STDOUT
        )

    worker = ("distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
              "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0")
    try:
        spawn("scheduler", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
              "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file),
              "--preload", str(preload))
        deadline = time.monotonic() + 60
        while (address := scheduler_address(scheduler_file)) is None:  # written, not just there
            if time.monotonic() > deadline or procs["scheduler"].poll() is not None:
                raise RuntimeError(f"scheduler did not start:\n{logs['scheduler'].read_text()}")
            time.sleep(0.1)
        for name in workers:
            spawn(name, *worker, *(["--no-nanny"] if name == "no-nanny" else []), "--name", name)
        yield address, logs
    finally:
        for name in sorted(procs, key=lambda n: n == "scheduler"):  # the scheduler last
            if procs[name].poll() is None:
                procs[name].send_signal(2)  # SIGINT: Ctrl-C, the bridge flushes
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_received_once_with_one_service(receiver: OTLPReceiver, sid: str, n_tasks: int) -> None:
    """The Dask span and every span made in a task arrive once; one service.name"""
    trace_id = sid.replace("-", "")

    def arrived():
        spans = receiver.spans()
        user = [s for s in spans if s.name == "user work" and s.trace_id == trace_id]
        dask_span = [s for s in spans if s.attributes.get("dask.span.id") == sid
                     and "dask.taskgroup.name" not in s.attributes]
        return len(user) >= n_tasks and dask_span

    from tests.support.cluster import wait_until

    wait_until(arrived, 30, "the Dask span and the spans made in tasks")
    time.sleep(1)  # a duplicate would come within a batch delay
    spans = [s for s in receiver.spans() if s.trace_id == trace_id]
    copies = Counter(s.span_id for s in spans)
    assert max(copies.values()) == 1, [s.name for s in spans if copies[s.span_id] > 1]
    assert len([s for s in spans if s.name == "user work"]) == n_tasks
    names = {s.resource.get("service.name") for s in spans}
    assert len(names) == 1, names


@needs_entry_point
@pytest.mark.slow
@pytest.mark.parametrize("preload_variable", [False, True], ids=["no-preload", "preload-variable"])
def test_opentelemetry_instrument_dask_scheduler_and_workers(tmp_path, preload_variable):
    """``opentelemetry-instrument dask scheduler --preload my_auth_plugin`` and
    ``opentelemetry-instrument dask worker`` (Nanny and --no-nanny), with no
    dask_otel preload anywhere or with the preload variable as well: one bridge,
    every span once, one service.name, and the detectors' resource beside Dask's
    identity"""
    with OTLPReceiver("grpc") as receiver:
        env = zero_code_env(receiver, preload_variable)
        with instrumented_processes(env, tmp_path, user_preload(tmp_path)) as (address, logs):
            with Client(address, timeout=30) as client:
                client.wait_for_workers(2, timeout=60)
                assert client.run_on_scheduler(
                    lambda dask_scheduler: getattr(dask_scheduler, "my_auth_plugin", False)
                )
                with span("zero-code") as sid:
                    client.gather(client.map(user_work, range(4), pure=False))
                status = dask_otel.status(client)
                executable = client.run_on_scheduler(lambda: sys.executable)
                check_received_once_with_one_service(receiver, sid, 4)
            for worker in ("nanny", "no-nanny"):
                assert "has no dask_otel bridge" not in logs[worker].read_text()
        # --preload my_auth_plugin makes Dask ignore the variable (the trap): the
        # instrumentor's bridge is the one, with or without it
        assert status["scheduler"]["paths"] == ["instrumentor"], logs["scheduler"].read_text()
        assert status["warning"] is None
        assert all(w["error"] is None and w["task_context"] for w in status["workers"].values())
        # no OTEL_SERVICE_NAME: the name the SDK's global providers have, everywhere
        # (the distro sets them up; without it there are none, and the rule says dask)
        service = status["scheduler"]["service_name"]
        assert service["from"] == (
            "OTEL_SERVICE_NAME" if not children_instrumented()
            else "the global TracerProvider" if distro_installed() else "default"
        )
        assert {w["service_name"]["name"] for w in status["workers"].values()} == {service["name"]}
        if service["from"] == "the global TracerProvider":
            # docs/zero-code.md: the SDK's default (the process detector is on here)
            from packaging.version import Version

            new_sdk = Version(version("opentelemetry-sdk")) >= Version("1.45")
            assert service["name"] == "unknown_service:" + (
                os.path.basename(executable) if new_sdk else executable)

        dask_spans = [s for s in receiver.spans() if "dask.span.id" in s.attributes]
        assert dask_spans
        for s in dask_spans:
            assert s.resource["service.name"] == service["name"]
            assert s.resource["dask.scheduler.address"] == address
            assert s.resource.get("service.instance.id")
            for detected in ("host.arch", "os.type", "process.runtime.name", "process.pid"):
                assert detected in s.resource, (detected, s.resource)


@needs_entry_point
@pytest.mark.slow
def test_the_preload_trap_is_named_by_the_worker_and_by_status(tmp_path):
    """A plain ``dask scheduler --preload my_auth_plugin`` with the preload
    variable has no bridge: an instrumented worker logs why, status() says so"""
    with OTLPReceiver("grpc") as receiver:
        env = zero_code_env(receiver, preload_variable=True)
        with instrumented_processes(
            env, tmp_path, user_preload(tmp_path), instrumented_scheduler=False,
            workers=("no-nanny",),
        ) as (address, logs):
            with Client(address, timeout=30) as client:
                client.wait_for_workers(1, timeout=60)
                status = dask_otel.status(client)
                worker_log = logs["no-nanny"].read_text()
    assert status["scheduler"] is None
    assert "--preload" in status["warning"] and "my_auth_plugin" in status["warning"]
    assert "has no dask_otel bridge" in worker_log and "--preload dask_otel" in worker_log


APP = """
import json, sys
from distributed import Client, LocalCluster, span
import dask_otel
from tests.support.tasks import user_work

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        with span("app workflow") as sid:
            client.gather(client.map(user_work, range(4), pure=False))
        dask_otel.instrument(client)  # a second path: still one bridge
        print(json.dumps({"sid": sid, "status": dask_otel.status(client)}, default=str))
"""


@needs_entry_point
@pytest.mark.slow
def test_an_application_under_opentelemetry_instrument_starting_a_local_cluster(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(APP)
    with OTLPReceiver("grpc") as receiver:
        env = zero_code_env(receiver, preload_variable=False)
        env["OTEL_SERVICE_NAME"] = "reports-app"
        out = subprocess.run(
            [*OPENTELEMETRY_INSTRUMENT, sys.executable, str(app)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        check_received_once_with_one_service(receiver, result["sid"], 4)
    status = result["status"]
    assert status["scheduler"]["paths"] == ["instrumentor", "client"]
    assert status["scheduler"]["service_name"] == {"name": "reports-app", "from": "OTEL_SERVICE_NAME"}
    assert {s.resource["service.name"] for s in receiver.spans()} == {"reports-app"}


#: A script that imports distributed only after it has looked at what is imported,
#: then starts a LocalCluster (its scheduler in this process, where the bad value's
#: ERROR is logged)
LATE_IMPORT = """
import json, sys
before = sorted(sys.modules)
import dask
import distributed
defaults = dask.config.get("otel.enabled", None)  # otel.yaml's, no variable's
from distributed import Client, LocalCluster

if __name__ == "__main__":
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        assert client.submit(sum, [1, 2]).result() == 3
    print(json.dumps({"before": before, "defaults": defaults}))
"""
#: What loading the dask entry point may import: the package and the instrumentor
ENTRY_POINT_MODULES = {"dask_otel", "dask_otel.instrumentor"}


@needs_entry_point
@pytest.mark.slow
def test_a_process_pays_for_dask_only_once_it_imports_distributed(tmp_path):
    """opentelemetry-instrument loads the dask entry point in every process: until
    distributed is imported, nothing of Dask's or of the bridge beyond the
    instrumentor is; once it is, the otel: config defaults are loaded and Dask's
    console is back beside the logging instrumentation's root handler (the
    scheduler's ERROR for a bad value, in Dask's format)"""
    script = tmp_path / "late.py"
    script.write_text(LATE_IMPORT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none", "DASK_OTEL__SPANS__EXPORT_DELAY": "soon",
    })
    out = subprocess.run(
        [*OPENTELEMETRY_INSTRUMENT, sys.executable, str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    before = set(result["before"])
    assert ENTRY_POINT_MODULES <= before  # the entry point was loaded
    heavy = {
        m for m in before
        if m.split(".")[0] in ("dask", "distributed", "tornado", "numpy", "yaml")
        or (m.startswith("dask_otel") and m not in ENTRY_POINT_MODULES)
    }
    assert not heavy, sorted(heavy)
    assert result["defaults"] is True  # the otel: config defaults loaded
    assert re.search(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - dask_otel - ERROR - dask_otel is off on "
        r"scheduler tcp://127\.0\.0\.1:\d+: otel\.spans\.export-delay: .*got 'soon'$",
        out.stderr, re.MULTILINE,
    ), out.stderr[-3000:]
