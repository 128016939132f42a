"""Client -> Dask: ``dask_otel.span`` continues the caller's OTel trace.

Real clusters (LocalCluster with processes=False and True, ``dask scheduler`` +
``dask worker`` processes switched on by the preload variable alone), the caller's
spans from a real SDK TracerProvider in this process, the Dask spans as the
scheduler exports them (in-memory exporter, or the OTLP receiver over a socket).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Sized

import dask
import dask.bag as db
import pytest
from distributed import span, wait
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

import dask_otel
from tests.support.callers import app_tracer
from tests.support.cluster import dask_span_ids, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.span_tree import assert_span_tree
from tests.support.tasks import double, inc, square


def assert_one_whole_trace(spans: list, **kwargs) -> None:
    assert_span_tree(spans, one_trace=True, **kwargs)


def current_span_context() -> trace.SpanContext:
    return trace.get_current_span().get_span_context()


def mirrored_trace(mirrored, trace_id: int, root_sid: str) -> list:
    """Every span the scheduler exported in ``trace_id``, once the root is exported
    and a few more polls have passed (children are exported first)"""
    mirrored.by_dask_id(root_sid)
    time.sleep(0.5)
    return [s for s in mirrored.spans() if s.context.trace_id == trace_id]


@pytest.mark.parametrize("processes", [False, True])
def test_root_dask_span_continues_the_callers_trace(processes):
    app_spans, tracer = app_tracer()
    with otel_cluster(processes=processes) as (client, mirrored):
        with tracer.start_as_current_span("POST /reports") as app:
            before_root = time.time()
            with dask_otel.span("report") as root_id:
                inside = current_span_context()
                # Client-side instrumented work nests under the Dask span
                with tracer.start_as_current_span("client call") as call:
                    pass
                time.sleep(0.3)  # the block is entered well before any graph arrives
                before_load = time.time()
                with dask_otel.span("load") as load_id:
                    time.sleep(0.2)
                    client.gather(client.map(inc, range(4)))  # futures
                with span("train") as train_id:  # a distributed.span in the mix
                    with dask_otel.span("evaluate") as eval_id:
                        bag = db.from_sequence(range(8), npartitions=4).map(double).persist()
                        wait(bag)  # persist
                        assert bag.map(square).sum().compute() == 560  # collections
        app_ctx = app.get_span_context()
        spans = mirrored_trace(mirrored, app_ctx.trace_id, root_id)

    by_id = {s.context.span_id: s for s in spans}
    root, load, train, evaluate = (
        by_id[dask_span_ids(i)[1]] for i in (root_id, load_id, train_id, eval_id)
    )
    # The root Dask span is a child of the caller's span, in the caller's trace
    assert root.parent.span_id == app_ctx.span_id
    assert root.parent.is_remote
    assert {s.context.trace_id for s in spans} == {app_ctx.trace_id}
    assert load.parent.span_id == root.context.span_id
    assert train.parent.span_id == root.context.span_id
    assert evaluate.parent.span_id == train.context.span_id
    # Inside the block the current span was the Dask span, with its exported ids
    assert (inside.trace_id, inside.span_id) == (app_ctx.trace_id, root.context.span_id)
    assert call.parent.span_id == root.context.span_id
    # Starts cover the client's blocks, not only the first graph's arrival
    assert root.start_time <= before_root * 1e9 + 0.05e9 < (before_load - 0.25) * 1e9
    assert load.start_time <= before_load * 1e9 + 0.05e9
    # Every span, the caller's included: one trace, parents present, children inside
    assert_one_whole_trace([*spans, *app_spans.get_finished_spans()], dask_roots=("report",))


def test_without_a_current_span_the_trace_is_the_root_uuid(cluster):
    client, mirrored = cluster
    with dask_otel.span("solo") as solo_id:
        inside = current_span_context()
        client.submit(inc, 1).result()
    trace_id, span_id = dask_span_ids(solo_id)
    assert (inside.trace_id, inside.span_id, inside.trace_flags.sampled) == (trace_id, span_id, True)
    solo = mirrored.by_dask_id(solo_id)
    assert (solo.context.trace_id, solo.parent) == (trace_id, None)


def test_nested_in_a_distributed_span_root_the_trace_is_the_roots(cluster):
    client, mirrored = cluster
    _, tracer = app_tracer()
    with tracer.start_as_current_span("app"):
        with span("plain root") as root_id:
            with dask_otel.span("inner") as inner_id:
                inside = current_span_context()
                client.submit(double, 2).result()
    trace_id, _ = dask_span_ids(root_id)
    assert (inside.trace_id, inside.span_id) == (trace_id, dask_span_ids(inner_id)[1])
    spans = mirrored_trace(mirrored, trace_id, root_id)
    assert mirrored.by_dask_id(root_id).parent is None
    assert_one_whole_trace(spans)


def test_baggage_of_the_caller_stays_in_the_context(cluster):
    client, _ = cluster
    token = otel_context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with dask_otel.span("with baggage"):
            assert baggage.get_baggage("tenant") == "acme"
            assert dask.get_annotations()["otel"].get("carrier") is None  # no current span
    finally:
        otel_context.detach(token)


@pytest.mark.parametrize("caller", ["always_off sampler", "remote parent not sampled"])
def test_a_trace_the_sampler_drops_drops_its_dask_spans(cluster, caller):
    client, mirrored = cluster
    if caller == "always_off sampler":
        _, tracer = app_tracer(ALWAYS_OFF)
        dropped_span = tracer.start_span("dropped request")
        token = otel_context.attach(trace.set_span_in_context(dropped_span))
    else:  # parentbased_always_on (the default) follows an incoming unsampled parent
        carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}
        token = otel_context.attach(propagate.extract(carrier))
    try:
        dropped_trace = current_span_context().trace_id
        with dask_otel.span("dropped") as dropped_id:
            assert not current_span_context().trace_flags.sampled
            with dask_otel.span("dropped too"):
                client.gather(client.map(inc, range(3)))
    finally:
        otel_context.detach(token)
    # A trace that is kept, after it: once it is exported, the dropped one would be
    with dask_otel.span("kept") as kept_id:
        client.gather(client.map(double, range(3)))
    mirrored.by_dask_id(kept_id)
    time.sleep(0.5)
    exported = mirrored.spans()
    assert [s for s in exported if s.context.trace_id == dropped_trace] == []
    # Not exported in a trace of their own either
    assert [s for s in exported if s.attributes["dask.span.name"][0] == "dropped"] == []
    assert [s for s in exported if s.attributes["dask.span.id"] == dropped_id] == []
    assert not mirrored.plugin.mirror.ledger.records  # nor their entries and callers


def containers_of(*objects: object) -> dict[str, Sized]:
    """Every dict, list, set and deque held by ``objects``, by ``Class.attribute``"""
    return {
        f"{type(o).__name__}.{name}": value
        for o in objects
        for name, value in vars(o).items()
        if isinstance(value, (dict, list, set, deque))
    }


def test_memory_of_the_mirror_is_bounded_by_open_spans(cluster):
    """Once everything is exported, the mirror keeps nothing per span: every
    container of the mirror and its ledger is empty, but for the two bounded by
    a constant (roots' callers for work that comes after their export, and the
    exemplar context per task prefix).

    Read through the scheduler plugin's ``mirror`` and ``mirror.ledger`` (no public
    API shows them): all their containers, found by type, so that one added
    later is checked too."""
    from dask_otel.scheduler.ledger import MAX_MADE_SPANS, MAX_REOPENED_ROOTS
    from dask_otel.spans import MAX_EXEMPLAR_PREFIXES

    client, mirrored = cluster
    _, tracer = app_tracer()
    with tracer.start_as_current_span("app"):
        for i in range(20):
            with dask_otel.span(f"wf-{i}") as sid:
                # A key prefix per workflow: Dask puts a prefix's tasks on one span
                client.submit(inc, i, key=f"wf{i}-inc").result()
                with dask_otel.span("sub"):
                    # One TaskGroup for all: batches after its first export
                    client.submit(double, i, pure=False).result()
                with dask_otel.span("client-side only"):
                    pass  # a block that runs no task: its exit waits export-delay for none
    mirrored.by_dask_id(sid)
    mirror = mirrored.plugin.mirror
    ledger = mirror.ledger

    def nothing_open():
        return not (ledger.records or ledger.groups or ledger.pending_exits)

    wait_until(nothing_open, what="every span, batch and block exported")
    time.sleep(0.3)  # a few more polls
    bounded = {
        "Ledger.reopened_parents": MAX_REOPENED_ROOTS,
        "Ledger.made": MAX_MADE_SPANS,  # the "sub" blocks of wf-1 to wf-19: Dask made none
        "SpanMirror.latest_by_prefix": min(MAX_EXEMPLAR_PREFIXES, 21),  # 20 + double
    }
    containers = containers_of(mirror, ledger)
    assert {"Ledger.records", "Ledger.groups", "Ledger.leaves",
            "Ledger.pending_exits", "Ledger.reopened_parents"} <= set(containers)
    kept = {
        name: len(c) for name, c in containers.items() if len(c) > bounded.get(name, 0)
    }
    assert kept == {}, f"kept after every span was exported: {kept}"
    assert len(mirrored.spans()) == 20 * 5  # 3 Dask spans and 2 TaskGroups a workflow


# --- dask scheduler + dask worker processes, switched on by the preload variable --


#: The tests of one processes_cluster, in one test process (pytest-xdist)
ON_THE_PROCESSES_CLUSTER = pytest.mark.xdist_group("client-processes-cluster")


@pytest.fixture(scope="module")
def processes_cluster():
    with OTLPReceiver("grpc") as receiver, dask_processes(receiver.env()) as cluster:
        yield cluster, receiver


def received_trace(receiver: OTLPReceiver, trace_hex: str, root_name: str) -> list:
    receiver.wait_for(lambda r: [s for s in r.spans(root_name) if s.trace_id == trace_hex])
    time.sleep(1.0)  # sub-spans went first; the batch processor sends every 200 ms
    return [s for s in receiver.spans() if s.trace_id == trace_hex]


@ON_THE_PROCESSES_CLUSTER
def test_processes_cluster_continues_the_callers_trace(processes_cluster):
    cluster, receiver = processes_cluster
    app_spans, tracer = app_tracer()
    with cluster.client() as client:
        with tracer.start_as_current_span("job") as app:
            with dask_otel.span("processes workflow") as root_id:
                with dask_otel.span("step") as step_id:
                    client.gather(client.map(inc, range(4)))
    ctx = app.get_span_context()
    spans = received_trace(receiver, f"{ctx.trace_id:032x}", "processes workflow")
    by_name = {s.name: s for s in spans}
    assert by_name["processes workflow"].parent_span_id == f"{ctx.span_id:016x}"
    assert by_name["processes workflow"].span_id == f"{dask_span_ids(root_id)[1]:016x}"
    assert by_name["step"].span_id == f"{dask_span_ids(step_id)[1]:016x}"
    assert by_name["taskgroup/inc"].parent_span_id == by_name["step"].span_id
    assert_one_whole_trace(
        [*spans, *app_spans.get_finished_spans()], dask_roots=("processes workflow",)
    )


#: A client process in which the OTel SDK cannot be imported: only the API is there
CLIENT_WITHOUT_SDK = """
import sys

class NoSDK:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry.sdk" or name.startswith("opentelemetry.sdk."):
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, NoSDK())

import dask.bag as db
from distributed import Client
from opentelemetry import context, propagate, trace

import dask_otel

incoming = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
context.attach(propagate.extract(incoming))  # as a web framework does with a request
with Client(sys.argv[1]) as client:
    with dask_otel.span("api only") as root_id:
        ctx = trace.get_current_span().get_span_context()
        assert ctx.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736, ctx
        assert ctx.span_id == int(root_id.replace("-", "")[16:], 16), ctx
        outgoing = {}
        propagate.inject(outgoing)  # what an instrumented HTTP call would send
        assert outgoing["traceparent"].split("-")[2] == f"{ctx.span_id:016x}"
        with dask_otel.span("bag"):
            assert db.from_sequence(range(4), npartitions=2).map(lambda x: x + 1).sum().compute() == 10
assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")]
print(root_id)
"""


@ON_THE_PROCESSES_CLUSTER
def test_client_without_the_sdk(processes_cluster, tmp_path):
    cluster, receiver = processes_cluster
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENT_WITHOUT_SDK))
    out = subprocess.run(
        [sys.executable, str(script), cluster.address],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    root_id = out.stdout.split()[-1]
    spans = received_trace(receiver, "4bf92f3577b34da6a3ce929d0e0e4736", "api only")
    by_name = {s.name: s for s in spans}
    assert by_name["api only"].span_id == f"{dask_span_ids(root_id)[1]:016x}"
    assert by_name["bag"].parent_span_id == by_name["api only"].span_id
    assert_one_whole_trace(spans, root_parent="00f067aa0ba902b7")  # the caller is not here


def test_import_dask_otel_needs_no_sdk():
    code = (
        "import sys, dask_otel; "
        "print([m for m in sys.modules if m.startswith('opentelemetry.sdk')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "otel", ["not a dict", {"entered": [1, 2]}, {"entered": {}, "carrier": 5},
             {"entered": "x", "carrier": {"traceparent": 7}}],
)
def test_an_otel_annotation_not_made_by_dask_otel_changes_nothing(cluster, otel):
    client, mirrored = cluster
    with span("foreign") as sid:
        with dask.annotate(otel=otel):
            assert client.submit(inc, 1, key=f"foreign-{len(str(otel))}").result() == 2
    s = mirrored.by_dask_id(sid)
    assert (s.context.trace_id, s.parent) == (dask_span_ids(sid)[0], None)
    assert mirrored.plugin.status()["error"] is None


# --- A Dask span covers its client block (issue 18) ---------------------------------


def run_request(client, tracer) -> dict:
    """The user's path: ``request`` opens ``dask_otel.span("workflow")``, which
    computes and then writes a report on the client; then a block with only
    client-side work. Returns the Dask span UUIDs and the caller's span."""
    with tracer.start_as_current_span("request") as request:
        with dask_otel.span("workflow") as workflow_id:
            futures = client.map(inc, range(6), key=[f"workflow-{i}" for i in range(6)])
            assert client.gather(futures) == list(range(1, 7))
            with tracer.start_as_current_span("write report"):
                time.sleep(0.15)  # after the last task: the Dask span must cover it
        with dask_otel.span("client only") as empty_id:
            with tracer.start_as_current_span("call a service"):
                time.sleep(0.05)
    return {"workflow": workflow_id, "empty": empty_id, "request": request}


def check_request(ids: dict, spans: list, app_spans: list) -> None:
    """Every span inside its parent (the Dask roots inside ``request`` to 1 ms), the
    report inside the workflow's Dask span, the empty block exported under
    ``request`` with its child"""
    request = ids["request"].get_span_context()
    nodes = assert_span_tree(
        [*spans, *app_spans], one_trace=True, dask_roots=("workflow", "client only")
    )
    by_name = {n.name: n for n in nodes.values()}
    workflow, report = by_name["workflow"], by_name["write report"]
    empty, call = by_name["client only"], by_name["call a service"]
    assert workflow.span_id == f"{dask_span_ids(ids['workflow'])[1]:016x}"
    assert workflow.parent_id == empty.parent_id == f"{request.span_id:016x}"
    assert report.parent_id == workflow.span_id and call.parent_id == empty.span_id
    assert workflow.end_ns >= report.end_ns  # the block, not only its tasks
    assert empty.span_id == f"{dask_span_ids(ids['empty'])[1]:016x}"
    assert empty.start_ns <= call.start_ns and call.end_ns <= empty.end_ns


@ON_THE_PROCESSES_CLUSTER
def test_a_dask_span_covers_its_block_on_dask_processes(processes_cluster):
    cluster, receiver = processes_cluster
    app_spans, tracer = app_tracer()
    with cluster.client() as client:
        ids = run_request(client, tracer)
        trace_hex = f"{ids['request'].get_span_context().trace_id:032x}"
        receiver.wait_for(lambda r: [s for s in r.spans("client only") if s.trace_id == trace_hex])
        spans = received_trace(receiver, trace_hex, "workflow")
    check_request(ids, spans, app_spans.get_finished_spans())


def test_a_dask_span_covers_its_block_on_a_local_cluster_of_processes():
    config = {"otel.spans.export-delay": "300ms", "otel.spans.poll-interval": "100ms"}
    app_spans, tracer = app_tracer()
    with otel_cluster(config, processes=True) as (client, mirrored):
        ids = run_request(client, tracer)
        mirrored.by_dask_id(ids["workflow"])
        wait_until(lambda: [s for s in mirrored.spans() if s.name == "client only"])
        time.sleep(0.3)
        trace_id = ids["request"].get_span_context().trace_id
        spans = [s for s in mirrored.spans() if s.context.trace_id == trace_id]
    check_request(ids, spans, app_spans.get_finished_spans())


def test_an_open_block_keeps_its_dask_span_open_until_it_exits():
    config = {"otel.spans.export-delay": "100ms", "otel.spans.poll-interval": "50ms"}
    with otel_cluster(config) as (client, mirrored):
        with dask_otel.span("open") as sid:
            client.gather(client.map(inc, range(3), key=["open-0", "open-1", "open-2"]))
            time.sleep(0.6)  # six export delays: idle, but the block is open
            assert not [s for s in mirrored.spans() if s.name == "open"]
            left = time.time()
        exported = mirrored.by_dask_id(sid)
    assert exported.end_time >= int(left * 1e9)


def test_a_client_that_leaves_closes_its_open_blocks():
    config = {"otel.spans.export-delay": "100ms", "otel.spans.poll-interval": "50ms"}
    with otel_cluster(config) as (client, mirrored):
        other = type(client)(client.scheduler.address, set_as_default=False)
        block = dask_otel.span("abandoned")
        sid = block.__enter__()  # never left: the client goes away first
        other.gather(other.map(inc, range(2), key=["abandoned-0", "abandoned-1"]))
        other.close()
        mirrored.by_dask_id(sid)
        block.__exit__(None, None, None)


def test_a_scheduler_without_the_bridge_ignores_block_exits():
    from dask_otel.annotation import BLOCK_EXIT
    from tests.support.processes import FAST_ENV, DaskProcesses

    app_spans, tracer = app_tracer()
    with DaskProcesses(dict(FAST_ENV)) as cluster, cluster.client() as client:
        for _ in range(3):
            ids = run_request(client, tracer)
        assert client.submit(inc, 1).result() == 2  # the connection is fine
        events = wait_until(lambda: client.get_events(BLOCK_EXIT))
        assert len(events) == 6  # kept in its event log, as any event
        assert client.status == "running"
        log = cluster.log("scheduler")
    assert "Traceback" not in log and "No handler" not in log, log
    assert {s.name for s in app_spans.get_finished_spans()} == {
        "request", "write report", "call a service"
    }
    assert ids["workflow"] != ids["empty"]


def test_futures_that_outlive_their_block_extend_its_dask_span():
    from tests.support.tasks import slow

    config = {"otel.spans.export-delay": "100ms", "otel.spans.poll-interval": "50ms"}
    with otel_cluster(config) as (client, mirrored):
        with dask_otel.span("outlived") as sid:
            future = client.submit(slow, 1, delay=0.5, key="outlived-0")
            left = time.time()
        future.result()
        done = time.time()
        exported = mirrored.by_dask_id(sid)
        (group,) = mirrored.children(exported)
    assert exported.end_time >= group.end_time >= int((left + 0.4) * 1e9)
    assert exported.end_time <= int(done * 1e9)


def two_clusters(**overrides):
    """Two LocalClusters with the bridge in this process, the default client on
    the first; yields the second's client (not the default) and both Mirrored"""
    import contextlib

    from distributed import Client, LocalCluster, get_client

    from tests.support.cluster import MEMORY_CONFIG, Mirrored, cluster_kwargs

    @contextlib.contextmanager
    def clusters():
        config = {**MEMORY_CONFIG, "otel.metrics.exporter": "memory"}
        with dask.config.set(config), LocalCluster(**cluster_kwargs(**overrides)) as one, \
                LocalCluster(**cluster_kwargs(**overrides)) as two, Client(one) as default, \
                Client(two, set_as_default=False) as second:
            assert get_client() is default
            yield second, Mirrored(one), Mirrored(two)

    return clusters()


def spans_of(mirrored, sid: str, scheduler: str) -> list:
    """The OTel spans of Dask span ``sid`` that ``scheduler`` exported (the
    clusters share the process's exporter: the resource tells them apart)"""
    span_id = dask_span_ids(sid)[1]
    return [s for s in mirrored.spans() if s.context.span_id == span_id
            and s.resource.attributes["dask.scheduler.address"] == scheduler]


def test_a_block_belongs_to_the_client_its_tasks_went_to():
    """Worker processes: a block whose task went to the second (non-default)
    client's cluster ends on that cluster as the block did, its workflow run
    too; the default client's scheduler, which never saw it, exports nothing"""
    from tests.support.metrics import collect, metric_reader
    from tests.support.tasks import slow

    with two_clusters(processes=True, n_workers=1) as (second, one, two):
        a, b = one.cluster.scheduler.address, two.cluster.scheduler.address
        with dask_otel.span("on-two", workflow=True) as sid:
            entered = time.time()
            assert second.submit(slow, 1, delay=0.02, key="on-two-0").result() == 1
        left = time.time()
        # Exported once its block exit is heard; ten seconds is far past that
        try:
            wait_until(lambda: spans_of(two, sid, b), timeout=10)
        except AssertionError:
            pass  # the asserts below say how it went
        points = collect(metric_reader(two.cluster))
        runs = [p for p in points.get("dask.workflow.duration", [])
                if p.attributes.get("dask.workflow.name") == "on-two"]
        time.sleep(1)  # an exit heard on cluster 1 is exported after 200 ms
    exported = spans_of(two, sid, b)
    assert len(exported) == 1, exported
    (span_two,) = exported
    assert span_two.start_time <= int(entered * 1e9)
    assert span_two.end_time <= int(left * 1e9), (span_two.end_time - span_two.start_time) / 1e9
    assert (span_two.end_time - span_two.start_time) / 1e9 < 5
    assert [(p.attributes["dask.workflow.result"], p.value < 5) for p in runs] == [("ok", True)]
    assert spans_of(one, sid, a) == []


def test_enclosing_and_empty_blocks_belong_to_the_client_of_their_work():
    """An outer block whose only graph went, from a nested block, to the second
    client's cluster ends there at its exit; a block with no task run with the
    second client as current is exported by that cluster alone"""
    with two_clusters(n_workers=1) as (second, one, two):
        a, b = one.cluster.scheduler.address, two.cluster.scheduler.address
        with dask_otel.span("outer") as outer:
            with dask_otel.span("inner") as inner:
                assert second.submit(inc, 1, key="inner-0").result() == 2
            time.sleep(0.1)  # client-side work in the outer block only
            outer_left = time.time()
        with second.as_current(), dask_otel.span("client only") as empty:
            time.sleep(0.05)
        left = time.time()
        for sid in (outer, inner, empty):
            wait_until(lambda: spans_of(two, sid, b), timeout=20)
        time.sleep(1)  # an exit heard on cluster 1 is exported after 200 ms
    (outer_span,), (inner_span,) = spans_of(two, outer, b), spans_of(two, inner, b)
    assert outer_span.end_time >= int(outer_left * 1e9) >= inner_span.end_time + 100_000_000
    assert outer_span.end_time <= int(left * 1e9)
    (empty_span,) = spans_of(two, empty, b)
    assert empty_span.attributes["dask.tasks.total"] == 0
    assert [spans_of(one, sid, a) for sid in (outer, inner, empty)] == [[], [], []]


#: Blocks submitted in a loop: the scheduler reads many of their graphs after the
#: exits that followed them (each exit an rpc of its own, the graphs read in turn
#: from the client's stream): 398 of 400 Dask spans were left open, then exported
#: twice at close, before exits waited for graphs
FLOOD = 200


def test_an_exit_heard_before_its_graph_waits_for_it():
    """FLOOD blocks, one task each, in a loop on worker processes: every block's
    spans are exported once, with their task, none as a block that ran no task"""
    with otel_cluster({}, processes=True, n_workers=2) as (client, mirrored):
        futures = []
        for i in range(FLOOD):
            with dask_otel.span(f"flood {i}"), dask_otel.span("step"):
                futures.append(client.submit(inc, i, key=f"flood{i}-0"))  # a group each
        wait(futures)
        wait_until(lambda: dask_otel.status(client)["scheduler"]["open_spans"] == 0, timeout=60)
        steps = wait_until(lambda: [s for s in mirrored.spans() if s.name == "step"] if len(
            [s for s in mirrored.spans() if s.name == "step"]) >= FLOOD else None, timeout=30)
        assert len(steps) == FLOOD
        assert [s.attributes["dask.span.name"] for s in steps if s.attributes["dask.tasks.total"] != 1] == []
