"""Traces in a real Jaeger v2, read back through its query API as its UI reads them.

The bridge exports over OTLP/gRPC to Jaeger (built by .ci/install-backends, in-memory
storage); the tests read ``/api/traces/{id}`` and ``/api/services/{svc}/operations``
and check the tree a user looks at (docs/traces.md): the caller's span >
``dask_otel.span`` > sub-spans > TaskGroups > task spans > spans made inside tasks,
with its links, events, status and attributes, from ``LocalCluster(processes=True)``,
from ``dask scheduler``/``dask worker`` processes and from ``dask-otel demo``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from distributed import Event, wait
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import dask_otel
from tests.support.backends import JaegerServer
from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import set_otel_env
from tests.support.processes import dask_processes
from tests.support.span_tree import assert_span_tree
from tests.support.tasks import (broken, exit_once, inc, load, nap, sleep_on_loop, total,
                                 user_work, wait_for_event)

#: The names of docs/traces.md "Span names": a Dask span is its tag, a TaskGroup
#: span and a task span carry their task prefix behind their own word
TASKGROUP, TASK = "taskgroup/{}", "run/{}"


@pytest.fixture(scope="module")
def jaeger() -> Iterator[JaegerServer]:
    with JaegerServer() as server:
        yield server


def jaeger_env(jaeger: JaegerServer, service: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


def one(spans: list[dict], name: str) -> dict:
    (span,) = [s for s in spans if s["name"] == name]
    return span


def children(spans: list[dict], parent: dict) -> list[str]:
    return sorted(s["name"] for s in spans if s["parent_id"] == parent["span_id"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_workflow_under_a_callers_span_reads_back_from_jaeger(jaeger, monkeypatch, tmp_path):
    """processes=True: the caller's span > nightly report > stages > TaskGroups >
    task spans > the spans tasks make; a link to the workflow that made the inputs;
    dask.worker.lost on the stage whose worker died; ERROR on the stage that failed"""
    service = "dask-jaeger-tree"
    set_otel_env(monkeypatch, jaeger_env(jaeger, service))
    caller = TracerProvider(resource=Resource.create({"service.name": "web"}))
    caller.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=jaeger.otlp_grpc_endpoint, insecure=True)))
    tracer = caller.get_tracer("web")
    config = {"otel.traces.exporter": "otlp", "otel.metrics.exporter": "none"}
    with otel_cluster(config, processes=True, n_workers=2) as (client, _):
        with dask_otel.span("prepare") as prepare_id:
            inputs = client.map(inc, range(2))
            wait(inputs)
        with tracer.start_as_current_span("handle request") as request:
            trace_id = f"{request.get_span_context().trace_id:032x}"
            with dask_otel.span("nightly report", tasks={"spans": True}) as report_id:
                with dask_otel.span("load"):
                    client.gather(client.map(load, range(3)))
                with dask_otel.span("score"):
                    client.gather(client.map(user_work, range(2)))
                with dask_otel.span("combine"):
                    client.submit(total, inputs).result()
                # What the workers held is in Jaeger before one of them is killed
                jaeger.wait_for_trace(trace_id, predicate=lambda spans: len(
                    [s for s in spans if s["name"].startswith("run/")]) == 6)
                with dask_otel.span("unstable"):
                    assert client.submit(exit_once, str(tmp_path / "died"), 7).result() == 7
                with dask_otel.span("failing"), pytest.raises(RuntimeError, match="diverged"):
                    client.submit(broken, 1).result()
        caller.shutdown()
        expected = {
            "handle request", "nightly report", "load", "score", "combine", "unstable",
            "failing", *(TASKGROUP.format(p) for p in ("load", "user_work", "total",
                                                        "exit_once", "broken")),
        }
        # 3 load, 2 user_work, 1 total, 1 exit_once (run again elsewhere), 1 broken
        count = len(expected) + 8 + 2
        spans = jaeger.wait_for_trace(trace_id, count=count, timeout=60)

    assert len(spans) == count, [s["name"] for s in spans]
    assert_span_tree(spans, one_trace=True, dask_roots=("nightly report",))
    names = [s["name"] for s in spans]
    assert expected <= set(names)
    request_span, report = one(spans, "handle request"), one(spans, "nightly report")
    assert request_span["resource"]["service.name"] == "web"
    assert report["parent_id"] == request_span["span_id"]
    assert report["attributes"]["dask.span.id"] == report_id
    assert children(spans, report) == ["combine", "failing", "load", "score", "unstable"]
    for stage, prefix, n in [("load", "load", 3), ("score", "user_work", 2),
                             ("combine", "total", 1), ("unstable", "exit_once", 1),
                             ("failing", "broken", 1)]:
        stage_span = one(spans, stage)
        group = one(spans, TASKGROUP.format(prefix))
        assert children(spans, stage_span) == sorted([group["name"]] + [TASK.format(prefix)] * n)
        assert group["parent_id"] == stage_span["span_id"]
        assert group["attributes"]["dask.taskgroup.prefix"] == prefix
        assert group["attributes"]["dask.span.id"] == stage_span["attributes"]["dask.span.id"]
        tasks = [s for s in spans if s["name"] == TASK.format(prefix)]
        assert len(tasks) == n, stage
        for task in tasks:
            # A task span is a child of its Dask span, beside its TaskGroup's span
            assert task["parent_id"] == stage_span["span_id"]
            assert task["attributes"]["dask.task.key"].startswith(prefix + "-")
            assert task["attributes"]["code.function.name"] == f"tests.support.tasks.{prefix}"
            assert task["attributes"]["dask.worker.address"].startswith("tcp://127.0.0.1:")
        assert (stage_span["resource"]["service.name"] == group["resource"]["service.name"]
                == tasks[0]["resource"]["service.name"] == service)
    # Spans made inside the tasks are the children of their task spans
    score_tasks = {s["span_id"] for s in spans if s["name"] == TASK.format("user_work")}
    user_spans = [s for s in spans if s["name"] == "user work"]
    assert len(user_spans) == 2 and {s["parent_id"] for s in user_spans} == score_tasks
    # The link to the workflow that made combine's inputs, in another trace
    prepare = f"{int(prepare_id.replace('-', ''), 16):032x}"
    assert one(spans, "combine")["links"] == [(prepare, prepare[-16:])]
    # The worker that died under "unstable"
    unstable = one(spans, "unstable")
    (lost,) = [e for e in unstable["events"] if e["name"] == "dask.worker.lost"]
    assert lost["attributes"]["dask.worker.address"].startswith("tcp://127.0.0.1:")
    assert unstable["start_time_unix_nano"] <= lost["timestamp"] <= unstable["end_time_unix_nano"]
    # Status: the failed stage, its TaskGroup and its task span say so; the others do not
    failing = one(spans, "failing")
    assert failing["status_code"] == "ERROR" and failing["status_message"] == "1 tasks erred"
    assert failing["attributes"]["error.type"] == "RuntimeError"
    assert one(spans, TASKGROUP.format("broken"))["status_code"] == "ERROR"
    failed_task = one(spans, TASK.format("broken"))
    assert failed_task["status_code"] == "ERROR"
    assert failed_task["status_message"] == "RuntimeError: diverged"
    (exception,) = failed_task["events"]
    assert exception["name"] == "exception"
    assert exception["attributes"]["exception.type"] == "RuntimeError"
    for stage in ("load", "score", "combine", "unstable"):
        assert one(spans, stage)["status_code"] == "UNSET", stage
    # The documented attributes, as Jaeger shows them (a string[] as its JSON text)
    assert json.loads(one(spans, "load")["attributes"]["dask.span.name"]) == [
        "nightly report", "load"]
    assert one(spans, "load")["attributes"]["dask.tasks.total"] == 3
    load_group = one(spans, TASKGROUP.format("load"))["attributes"]
    assert load_group["dask.tasks.total"] == 3 and load_group["dask.taskgroup.name"] == "load"
    assert report["attributes"]["dask.tasks.total"] == 3 + 2 + 1 + 1 + 1


def test_dask_scheduler_and_worker_processes_give_three_kinds_of_operations(jaeger):
    """``dask scheduler`` / ``dask worker`` switched on by the environment: the trace
    reads back whole, and Jaeger's operation list has a Dask span, a TaskGroup and a
    task each as an operation of its own, so each level is found and aggregated alone"""
    service = "dask-jaeger-processes"
    env = {**jaeger_env(jaeger, service), "DASK_OTEL__TASKS__SPANS": "true"}
    with dask_processes(env) as cluster, cluster.client() as client:
        with dask_otel.span("etl") as etl_id:
            with dask_otel.span("extract"):
                client.gather(client.map(load, range(2)))
        trace_id = etl_id.replace("-", "")
        spans = jaeger.wait_for_trace(trace_id, count=5, timeout=60)

    assert_span_tree(spans, one_trace=True)
    assert sorted(s["name"] for s in spans) == [
        "etl", "extract", "run/load", "run/load", "taskgroup/load"]
    assert one(spans, "etl")["span_id"] == trace_id[-16:]
    extract = one(spans, "extract")
    assert children(spans, extract) == ["run/load", "run/load", "taskgroup/load"]
    assert jaeger.operations(service) == ["etl", "extract", "run/load", "taskgroup/load"]
    # Each level is searched on its own, as the UI's "Operation" box does
    assert jaeger.find_traces(service, "taskgroup/load") == [trace_id]
    assert jaeger.find_traces(service, "run/load") == [trace_id]


def test_a_failed_stage_shows_its_exception_in_jaeger_without_task_spans(jaeger):
    """``dask scheduler``/``dask worker``, task spans off (the default): Jaeger shows
    the failed TaskGroup's ``exception`` event with its message, key and worker"""
    service = "dask-jaeger-failed"
    with dask_processes(jaeger_env(jaeger, service)) as cluster, cluster.client() as client:
        with dask_otel.span("nightly") as root_id, dask_otel.span("failing"):
            bad = client.submit(broken, 1)
            wait([bad])
        workers = set(client.scheduler_info()["workers"])
        spans = jaeger.wait_for_trace(root_id.replace("-", ""), count=3, timeout=60)
    assert sorted(s["name"] for s in spans) == ["failing", "nightly", TASKGROUP.format("broken")]
    for name in (TASKGROUP.format("broken"), "nightly"):
        (event,) = [e for e in one(spans, name)["events"] if e["name"] == "exception"]
        assert event["attributes"]["exception.type"] == "RuntimeError"
        assert event["attributes"]["exception.message"] == "diverged"
        assert 'raise RuntimeError("diverged")' in event["attributes"]["exception.stacktrace"]
        assert event["attributes"]["dask.task.key"] == str(bad.key)
        assert event["attributes"]["dask.worker.address"] in workers


@pytest.mark.timeout(300)
def test_a_stall_shows_its_cause_on_its_run_in_jaeger(jaeger):
    """``dask scheduler``/``dask worker``, Dask's limit at 1 s: the scheduler's loop
    blocked 2.5 s by a user's ``run_on_scheduler`` while a run's task runs. Jaeger shows
    the stall's event on the run's root, with the loop's stack (the function that
    slept) and the collector's share of it"""
    service = "dask-jaeger-stall"
    env = {**jaeger_env(jaeger, service), "DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": "1s"}
    with dask_processes(env) as cluster, cluster.client() as client:
        with dask_otel.span("nightly") as root_id:
            running = client.submit(nap, 5)
            # the task in flight first: the stall's rpc can come before the graph
            wait_until(lambda: any(client.processing().values()), what="the task processing")
            client.run_on_scheduler(sleep_on_loop, 2.5)
            assert running.result() == 5
        spans = jaeger.wait_for_trace(root_id.replace("-", ""), count=2, timeout=60)
    events = [e["attributes"] for e in one(spans, "nightly")["events"]
              if e["name"] == "dask.event_loop.blocked"]
    (stall,) = [e for e in events if e["dask.event_loop.blocked.duration"] >= 2.5 - 0.01]
    assert stall["dask.server.kind"] == "scheduler"
    assert "in sleep_on_loop\n    time.sleep(seconds)\n" in stall["code.stacktrace"]
    assert 0 <= stall["dask.event_loop.blocked.gc_share"] < 0.5


def test_a_runs_labels_find_its_trace_in_jaeger(jaeger):
    """``dask scheduler``/``dask worker``: a run's labels on each of its spans in Jaeger,
    and Jaeger's search by tag finds its trace, not another run's of the same operation"""
    service = "dask-jaeger-labels"
    with dask_processes(jaeger_env(jaeger, service)) as cluster, cluster.client() as client:
        with dask_otel.span("nightly", attributes={"team": "data"}) as root_id, \
                dask_otel.span("load", attributes={"env": "dev"}):
            wait(client.map(inc, range(2)))
        with dask_otel.span("adhoc", attributes={"team": "web"}):
            wait(client.submit(inc, 10))
        trace_id = root_id.replace("-", "")
        spans = jaeger.wait_for_trace(trace_id, count=3, timeout=60)
        deadline = time.monotonic() + 60
        while len(found := jaeger.find_traces(service, TASKGROUP.format("inc"))) < 2:
            assert time.monotonic() < deadline, found
            time.sleep(0.5)
        data = jaeger.find_traces(service, TASKGROUP.format("inc"), tags={"team": "data"})
    assert sorted(s["name"] for s in spans) == ["load", "nightly", TASKGROUP.format("inc")]
    assert [s["attributes"]["team"] for s in spans] == ["data"] * 3
    assert [s["attributes"].get("env") for s in spans if s["name"] != "nightly"] == ["dev"] * 2
    assert data == [trace_id]


#: The demo's Dask spans (its TaskGroups: load_partition, evaluate, fit)
DEMO_DASK_SPANS = ["Alice's workflow", "data load", "evaluate", "train"]


def test_the_demos_printed_trace_id_is_found_in_jaeger(jaeger):
    """``dask-otel demo --endpoint`` against Jaeger, as the README tells a newcomer"""
    out = subprocess.run(
        [sys.executable, "-m", "dask_otel", "demo", "--endpoint", jaeger.otlp_grpc_endpoint],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "OTEL_SERVICE_NAME": "dask-otel-demo"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    trace_id = re.search(r"^trace ([0-9a-f]{32})$", out.stdout, re.M).group(1)
    spans = jaeger.wait_for_trace(trace_id, count=7, timeout=60)
    assert_span_tree(spans, one_trace=True)
    assert sorted(s["name"] for s in spans if "/" not in s["name"]) == DEMO_DASK_SPANS
    assert sorted(s["name"] for s in spans if "/" in s["name"]) == [
        "taskgroup/evaluate", "taskgroup/fit", "taskgroup/load_partition"]
    root = one(spans, "Alice's workflow")
    assert root["parent_id"] is None and root["span_id"] == trace_id[-16:]
    assert root["resource"]["service.name"] == "dask-otel-demo"
    # What the demo printed is what Jaeger stored, name for name
    printed = [m.group(1).strip() for m in re.finditer(r"^( *\S.*?)\s+[\d.]+ ms \|", out.stdout, re.M)]
    assert sorted(printed) == sorted(s["name"] for s in spans)
    check_the_documented_curls(jaeger, "dask-otel-demo", trace_id)


def check_the_documented_curls(jaeger: JaegerServer, service: str, trace_id: str) -> None:
    """docs/deploy.md: the Jaeger .ci/install-backends builds serves a placeholder for
    its UI, and the two ``curl`` lines it gives find the trace, as written but for the
    port, the service and the trace id"""
    from tests.support.processes import REPO

    with urllib.request.urlopen(jaeger.url + "/", timeout=10) as page:
        assert "This is not the Jaeger UI you are looking for" in page.read().decode()
    doc = (REPO / "docs" / "deploy.md").read_text().split("to look at a trace without Docker", 1)[1]
    block = doc.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    assert len(lines) == 2 and all(line.startswith("curl -s ") for line in lines), lines
    port = jaeger.url.rsplit(":", 1)[1]
    found = []
    for line in lines:
        line = (line.replace("127.0.0.1:16686", f"127.0.0.1:{port}")
                .replace("service=dask&", f"service={service}&").replace("TRACE_ID", trace_id))
        run = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30)
        found.append({int(t["traceID"], 16) for t in json.loads(run.stdout)["data"]})
    assert all(int(trace_id, 16) in ids for ids in found), found


@pytest.mark.timeout(300)
def test_before_its_root_arrives_a_running_trace_shows_its_finished_parts(jaeger, monkeypatch):
    """processes=True, a run held open by a task blocked on a distributed.Event
    (docs/traces.md "While a run runs"): its finished sub-span and TaskGroup are in
    Jaeger, the root is not; Jaeger's API (what its UI reads) gives the sub-span its
    missing parent's id, with the warning "invalid parent span IDs". Once the run
    ends the root arrives and the trace is whole, without that warning."""
    service = "dask-jaeger-running"
    set_otel_env(monkeypatch, jaeger_env(jaeger, service))
    config = {"otel.traces.exporter": "otlp", "otel.metrics.exporter": "none"}
    with otel_cluster(config, processes=True, n_workers=1) as (client, _):
        with dask_otel.span("long run") as run_id:
            trace_id, root_id = run_id.replace("-", ""), run_id.replace("-", "")[-16:]
            with dask_otel.span("load"):
                client.gather(client.map(inc, range(2)))
            held = client.submit(wait_for_event, "jaeger-running", pure=False)
            spans = jaeger.wait_for_trace(trace_id, count=2, timeout=60)
            assert sorted(s["name"] for s in spans) == ["load", TASKGROUP.format("inc")]
            assert one(spans, "load")["parent_id"] == root_id
            (raw,) = jaeger._get(f"/api/traces/{trace_id}")
            (load,) = [s for s in raw["spans"] if s["operationName"] == "load"]
            assert f"invalid parent span IDs={root_id}" in " ".join(load.get("warnings") or [])
            Event("jaeger-running", client=client).set()
            held.result()
        spans = jaeger.wait_for_trace(trace_id, count=4, timeout=60)
    assert_span_tree(spans, one_trace=True)
    assert one(spans, "long run")["span_id"] == root_id
    (raw,) = jaeger._get(f"/api/traces/{trace_id}")
    assert not any("invalid parent" in w for s in raw["spans"] for w in s.get("warnings") or [])


def test_a_kept_run_reads_back_from_jaeger_as_a_trace_of_its_own(jaeger):
    """``dask scheduler``/``dask worker``, every trace dropped (``always_off``),
    ``otel.traces.keep.erred`` and task spans on: the run that erred is in Jaeger as a
    trace of its own (its root's UUID), linked to the caller's span, its erred task's
    span in it; the run that did not err is not"""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    service = "dask-jaeger-kept"
    env = {**jaeger_env(jaeger, service), "OTEL_TRACES_SAMPLER": "always_off",
           "DASK_OTEL__TRACES__KEEP__ERRED": "true", "DASK_OTEL__TASKS__SPANS": "true"}
    caller = SpanContext(0x39AB, 0x39CD, is_remote=False, trace_flags=TraceFlags(0))
    with dask_processes(env) as cluster, cluster.client() as client:
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(caller)))
        try:
            with dask_otel.span("kept-fine") as fine_id:
                client.submit(inc, 1, key="keptfine-0").result()
            with dask_otel.span("kept-nightly") as root_id, dask_otel.span("failing"):
                wait([client.submit(broken, 1, key="keptbroken-0")])
        finally:
            otel_context.detach(token)
        spans = jaeger.wait_for_trace(root_id.replace("-", ""), count=4, timeout=60)
    assert sorted(s["name"] for s in spans) == [
        "failing", "kept-nightly", TASK.format("keptbroken"), TASKGROUP.format("keptbroken")]
    root = one(spans, "kept-nightly")
    assert root["parent_id"] is None and root["attributes"]["dask.trace.kept"] == "erred"
    assert root["links"] == [(f"{0x39AB:032x}", f"{0x39CD:016x}")]
    assert children(spans, one(spans, "failing")) == [
        TASK.format("keptbroken"), TASKGROUP.format("keptbroken")]
    assert not jaeger.trace(fine_id.replace("-", "")) and not jaeger.trace(f"{0x39AB:032x}")
