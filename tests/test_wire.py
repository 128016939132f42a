"""The user's path end to end: ``dask scheduler`` and ``dask worker`` processes with
the bridge switched on only by DASK_DISTRIBUTED__SCHEDULER__PRELOAD=dask_otel and the
standard OTEL_* variables, exporting over real OTLP (gRPC and HTTP/protobuf) to a
receiver the test runs on 127.0.0.1."""

from __future__ import annotations

import time

import pytest
from distributed import span, wait

from tests.support.cluster import wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.span_tree import assert_span_tree
from tests.support.tasks import broken, clean, fail_slowly, fit, load, log_in_task


def assert_well_formed(spans: list) -> None:
    """As otel_cluster checks the spans of an in-process cluster, in the order received"""
    assert_span_tree(spans, ends="inside-if-exported-first")


def workflow(client):
    """Three levels of spans, each stage with its own task prefixes, one failure"""
    with span("Alice's workflow") as root_id:
        with span("data load") as load_id:
            parts = client.map(load, range(4))
            with span("cleaning") as clean_id:
                cleaned = client.map(clean, parts)
                wait(cleaned)
        with span("train") as train_id:
            model = client.submit(fit, cleaned)
            model.result()
            bad = client.submit(broken, 1)
            wait(bad)
    return root_id, {"data load": load_id, "cleaning": clean_id, "train": train_id}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_workflow_arrives_as_one_trace_over_otlp(protocol):
    with OTLPReceiver(protocol) as receiver:
        env = {**receiver.env(), "OTEL_METRICS_EXPORTER": "none"}
        with dask_processes(env) as cluster, cluster.client() as client:
            started = time.time()
            root_id, ids = workflow(client)
            finished = time.time()
            trace_id = root_id.replace("-", "")
            # Root + 3 sub-spans + TaskGroups load, clean, fit, broken
            spans = receiver.wait_for(
                lambda r: len(t := [s for s in r.spans() if s.trace_id == trace_id]) >= 8 and t,
                timeout=30,
            )
            scheduler_address = cluster.address

    by_name = {s.name: s for s in spans}
    root = by_name["Alice's workflow"]
    assert root.span_id == trace_id[-16:]
    assert root.parent_span_id is None
    for name, dask_id in ids.items():
        assert by_name[name].span_id == dask_id.replace("-", "")[-16:]
        assert by_name[name].attributes["dask.span.id"] == dask_id
    assert by_name["data load"].parent_span_id == root.span_id
    assert by_name["cleaning"].parent_span_id == by_name["data load"].span_id
    assert by_name["train"].parent_span_id == root.span_id
    assert by_name["taskgroup/load"].parent_span_id == by_name["data load"].span_id
    assert by_name["taskgroup/clean"].parent_span_id == by_name["cleaning"].span_id
    assert by_name["taskgroup/fit"].parent_span_id == by_name["train"].span_id
    assert by_name["cleaning"].attributes["dask.span.name"] == (
        "Alice's workflow", "data load", "cleaning",
    )

    # Times: within the client's view of the run, children within their parents
    assert started - 0.5 <= root.start <= root.end <= finished + 0.5
    assert_well_formed(spans)

    # Attributes and status
    assert by_name["taskgroup/load"].attributes["dask.tasks.total"] == 4
    assert by_name["data load"].attributes["dask.tasks.total"] == 8  # subtree
    assert by_name["taskgroup/fit"].attributes["dask.metrics.execute.thread_noncpu.seconds"] > 0.03
    assert by_name["train"].status_code == "ERROR"
    assert by_name["train"].status_message == "1 tasks erred"
    assert by_name["taskgroup/broken"].status_code == "ERROR"
    assert by_name["data load"].status_code == "UNSET"
    assert root.status_code == "ERROR"
    assert any(e[0] == "dask.first_task_start" for e in root.events)

    # Which process emitted it
    assert root.resource["service.name"] == "dask"
    assert root.resource["dask.scheduler.address"] == scheduler_address
    assert root.scope == "dask_otel"


def test_failed_tasks_end_their_spans_within_the_parent_over_otlp():
    """Dask records no run time for an erred task: its group and span end when the
    worker says it failed, and the root still ends after them"""
    with OTLPReceiver("grpc") as receiver:
        env = {**receiver.env(), "OTEL_METRICS_EXPORTER": "none"}
        with dask_processes(env) as cluster, cluster.client() as client:
            with span("root") as root_id:
                with span("load"):
                    client.gather(client.map(load, range(2)))
                with span("fail"):
                    # 2 s: the worker clock offset Dask estimates was seen 0.51 s off
                    wait(client.submit(fail_slowly, 1, delay=2.0))
            trace_id = root_id.replace("-", "")
            spans = receiver.wait_for(
                lambda r: len(t := [s for s in r.spans() if s.trace_id == trace_id]) >= 5 and t,
                timeout=30,
            )
    by_name = {s.name: s for s in spans}
    assert by_name["taskgroup/fail_slowly"].duration >= 0.5  # the run, not a point at enqueue
    assert by_name["fail"].duration >= 0.5
    assert by_name["taskgroup/fail_slowly"].end <= by_name["fail"].end <= by_name["root"].end
    assert_well_formed(spans)


def test_service_name_and_resource_attributes_come_from_otel_variables():
    with OTLPReceiver("grpc") as receiver:
        env = {
            **receiver.env(),
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_SERVICE_NAME": "etl-cluster",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=staging",
        }
        with dask_processes(env, n_workers=1) as cluster, cluster.client() as client:
            with span("named"):
                client.submit(load, 1).result()
            (s,) = receiver.wait_for(lambda r: r.spans("named"), timeout=30)
    assert s.resource["service.name"] == "etl-cluster"
    assert s.resource["deployment.environment"] == "staging"


def test_scheduler_shutdown_flushes_pending_spans():
    """Spans not yet exported when the scheduler stops are exported by dask_teardown"""
    with OTLPReceiver("grpc") as receiver:
        env = {
            **receiver.env(),
            "OTEL_METRICS_EXPORTER": "none",
            "DASK_OTEL__SPANS__EXPORT_DELAY": "1h",  # never by the poll
            "OTEL_BSP_SCHEDULE_DELAY": "60000",  # never by the batch timer
        }
        with dask_processes(env, n_workers=1) as cluster:
            with cluster.client() as client:
                with span("last words") as sid:
                    client.submit(load, 1).result()
            time.sleep(0.5)
            assert not receiver.spans("last words")
        # the scheduler was stopped with SIGINT on leaving the block
        (s,) = receiver.wait_for(lambda r: r.spans("last words"), timeout=10)
    assert s.attributes["dask.span.id"] == sid
    assert "dask.span.unfinished" not in s.attributes



#: The signals as the bridge's outage WARNING names them
NAMES = {"TRACES": "spans", "METRICS": "metrics", "LOGS": "logs"}


@pytest.mark.parametrize("signal, protocol", [
    ("TRACES", "http/protobuf"), ("METRICS", "grpc"), ("LOGS", "http/protobuf"),
])
def test_a_signals_own_protocol_variable_wins_over_the_general_one(signal, protocol):
    """OTEL_EXPORTER_OTLP_PROTOCOL names the protocol the receiver does not speak,
    one signal's OTEL_EXPORTER_OTLP_<signal>_PROTOCOL the one it speaks: that
    signal arrives, by its own variable; the other two, by the general one, do not"""
    other = {"grpc": "http/protobuf", "http/protobuf": "grpc"}[protocol]
    with OTLPReceiver(protocol) as receiver:
        env = {**receiver.env(), "OTEL_EXPORTER_OTLP_PROTOCOL": other,
               f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL": protocol,
               "OTEL_EXPORTER_OTLP_TIMEOUT": "2", "DASK_OTEL__FLUSH_TIMEOUT": "2s",
               **{f"OTEL_{s}_EXPORTER": "otlp" for s in NAMES},
               "OTEL_BLRP_SCHEDULE_DELAY": "100"}
        with dask_processes(env, n_workers=1) as cluster, cluster.client() as client:
            with span("by its own protocol"):
                assert client.submit(log_in_task, 3).result() == 3
            received = {
                "TRACES": lambda r: r.spans("by its own protocol"),
                "METRICS": lambda r: r.metric_points("dask.otel.span.mirrored"),
                "LOGS": lambda r: [g for g in r.logs() if g.body == "scored partition 3"],
            }
            receiver.wait_for(received[signal], timeout=60)
            # the other two are sent, by the general variable's protocol, and fail
            failing = [f"cannot export {name}" for s, name in NAMES.items() if s != signal]
            wait_until(lambda: all(f in cluster.log("scheduler") for f in failing),
                       timeout=60, what=f"the scheduler's WARNINGs {failing}")
    arrived = {"TRACES": bool(receiver.spans()), "METRICS": bool(receiver.metric_points()),
               "LOGS": bool(receiver.logs())}
    assert arrived == {s: s == signal for s in arrived}, receiver.summary()
