"""Dask spans -> OTel spans, read back from the SDK's in-memory exporter on the
scheduler of a real LocalCluster (the mapping contract: README, "Traces: the mapping")."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator

import dask
import pytest
from distributed import Client, LocalCluster, span, wait
from opentelemetry.trace import StatusCode

import dask_otel
from tests.support import oracle
from tests.support.cluster import (
    UNINSTRUMENTED_CONFIG,
    dask_span_ids,
    otel_cluster,
    wait_until,
)
from tests.support.metrics import collect, metric_reader, value
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.span_tree import assert_span_tree
from tests.support.tasks import (
    current_ids,
    die_once,
    double,
    fail,
    fail_slowly,
    inc,
    log_in_task,
    print_in_task,
    slow,
    total,
    wait_for_event,
)


def assert_well_formed(spans: list) -> None:
    """The span-tree checks otel_cluster makes as it closes, made now, and every
    child inside its parent, whatever the order of their exports"""
    assert_span_tree(spans, ends="inside")


@pytest.mark.parametrize("processes", [False, True])
def test_nested_spans_become_one_trace(processes):
    with otel_cluster(processes=processes) as (client, mirrored):
        with span("Alice's workflow") as root_id:
            with span("data load") as load_id:
                client.gather(client.map(inc, range(4)))
            with span("train") as train_id:
                with span("evaluate") as eval_id:
                    client.submit(total, client.map(double, range(4))).result()

        root = mirrored.by_dask_id(root_id)
        load, train, evaluate = (
            mirrored.by_dask_id(i) for i in (load_id, train_id, eval_id)
        )
        trace_id, _ = dask_span_ids(root_id)
        for s in (root, load, train, evaluate):
            assert s.context.trace_id == trace_id
            assert s.context.span_id == dask_span_ids(s.attributes["dask.span.id"])[1]
        assert f"{root.context.trace_id:032x}" == root_id.replace("-", "")
        assert root.parent is None
        assert load.parent.span_id == root.context.span_id
        assert train.parent.span_id == root.context.span_id
        assert evaluate.parent.span_id == train.context.span_id
        assert [s.name for s in (root, load, train, evaluate)] == [
            "Alice's workflow", "data load", "train", "evaluate",
        ]
        assert evaluate.attributes["dask.span.name"] == (
            "Alice's workflow", "train", "evaluate",
        )


def test_taskgroups_are_children_named_by_prefix(cluster):
    client, mirrored = cluster
    with span("stage") as sid:
        client.gather(client.map(inc, range(5)))
        client.gather(client.map(double, range(3)))
    stage = mirrored.by_dask_id(sid)
    children = wait_until(lambda: len(mirrored.children(stage)) == 2 and mirrored.children(stage))
    by_name = {c.name: c for c in children}
    assert set(by_name) == {"taskgroup/inc", "taskgroup/double"}
    assert by_name["taskgroup/inc"].attributes["dask.tasks.total"] == 5
    assert by_name["taskgroup/double"].attributes["dask.taskgroup.prefix"] == "double"
    assert by_name["taskgroup/inc"].attributes["dask.span.id"] == sid
    for c in children:
        assert c.context.trace_id == stage.context.trace_id
        assert stage.start_time <= c.start_time <= c.end_time <= stage.end_time


def test_span_timing_and_first_task_event(cluster):
    client, mirrored = cluster
    before = time.time()
    with span("timed") as sid:
        client.gather(client.map(slow, range(2), delay=0.3))
    after = time.time()
    s = mirrored.by_dask_id(sid)
    start, end = s.start_time / 1e9, s.end_time / 1e9
    assert before - 0.1 <= start < end <= after + 0.1
    assert end - start >= 0.3
    (event,) = [e for e in s.events if e.name == "dask.first_task_start"]
    assert start <= event.timestamp / 1e9 <= end


def test_span_attributes_carry_counts_bytes_and_fine_metrics(cluster):
    client, mirrored = cluster
    with span("work") as sid:
        futures = client.map(slow, range(4), delay=0.05)
        client.gather(futures)
    exported = mirrored.by_dask_id(sid)
    attrs = exported.attributes
    assert attrs["dask.tasks.total"] == 4
    # Counts by state: the non-zero ones only (the futures are held: in memory)
    (group,) = wait_until(lambda: mirrored.children(exported))
    for each in (attrs, group.attributes):
        states = {k: v for k, v in each.items()
                  if k.startswith("dask.tasks.") and k != "dask.tasks.total"}
        assert states == {"dask.tasks.memory": 4}
    assert attrs["dask.output.bytes"] > 0
    assert attrs["dask.duration"] >= 0.2
    assert attrs["dask.active_cpu_seconds"] > 0
    # Fine performance metrics arrived with the workers' heartbeats before export
    assert attrs["dask.metrics.execute.thread_noncpu.seconds"] >= 0.15
    assert "dask.metrics.execute.thread_cpu.seconds" in attrs


def test_taskgroup_spans_of_one_prefix_sum_to_dasks_fine_metrics(cluster):
    """Dask keys fine metrics by span and task prefix, not by TaskGroup: the
    TaskGroup spans of one prefix in one Dask span (two groups at once, a third
    after their export, a later batch of the first) carry each figure once, so
    that their sum is Dask's own figure of the prefix in that span"""
    client, mirrored = cluster
    token = uuid.uuid4().hex[:16]

    def keys(group, ids):
        return [(f"slow-{group}{token}", i) for i in ids]  # prefix "slow", own group

    def taskgroup_spans(stage):
        return [c for c in mirrored.children(stage)
                if c.attributes["dask.taskgroup.prefix"] == "slow"]

    with dask_otel.span("one prefix, three groups") as sid:
        held = client.map(slow, range(4), key=keys("a", range(4)), delay=0.05)  # group a stays
        client.gather(held + client.map(slow, range(4), key=keys("b", range(4)), delay=0.05))
        spans = mirrored.cluster.scheduler.extensions["spans"].spans
        head = dask_span_ids(sid)[1]
        wait_until(lambda: len([s for s in mirrored.spans()
                                if s.parent and s.parent.span_id == head]) == 2,
                   what="the two groups' spans")
        client.gather(client.map(slow, range(3), key=keys("c", range(3)), delay=0.05))
        client.gather(client.map(slow, range(4, 6), key=keys("a", range(4, 6)), delay=0.05))
    stage = mirrored.by_dask_id(sid)
    groups = taskgroup_spans(stage)
    assert sorted(g.attributes["dask.taskgroup.name"][5] for g in groups) == ["a", "a", "b", "c"]
    expected: dict[str, float] = {}
    for (context, *prefix, activity, unit), value in spans[sid].cumulative_worker_metrics.items():
        if context == "execute" and prefix == ["slow"] and value:
            expected[f"dask.metrics.execute.{activity}.{unit}".replace(" ", "_").replace("-", "_")] = value
    assert expected["dask.metrics.execute.thread_noncpu.seconds"] >= 0.05 * 13
    got: dict[str, float] = {}
    for g in groups:
        for name, value in g.attributes.items():
            if name.startswith("dask.metrics."):
                got[name] = got.get(name, 0) + value
    assert got == pytest.approx(expected)


def test_erred_tasks_set_error_status(cluster):
    client, mirrored = cluster
    with span("fails") as sid:
        futures = client.map(fail, range(3))
        wait(futures)
    s = mirrored.by_dask_id(sid)
    assert s.status.status_code is StatusCode.ERROR
    assert s.status.description == "3 tasks erred"
    assert s.attributes["error.type"] == "ValueError"  # as OTel's conventions name it
    (group,) = wait_until(lambda: mirrored.children(s))
    assert group.status.status_code is StatusCode.ERROR
    assert group.attributes["error.type"] == "ValueError"

    with span("fine") as ok_id:
        client.submit(inc, 1).result()
    assert mirrored.by_dask_id(ok_id).status.status_code is StatusCode.UNSET


def test_erred_tasks_forgotten_before_the_export_are_still_counted(cluster):
    """dask.tasks.erred counts every task that erred, even if since forgotten
    (docs/traces.md, the attribute table): Dask's state counts have let the
    erred tasks go by the time the span is exported"""
    client, mirrored = cluster
    with span("fails and forgets") as sid:
        futures = client.map(fail, range(3), key=[f"forgot-{i}" for i in range(3)])
        wait(futures)
    del futures  # released: the scheduler forgets the erred tasks
    wait_until(lambda: not any(str(k).startswith("forgot-")
                               for k in mirrored.cluster.scheduler.tasks))
    s = mirrored.by_dask_id(sid)
    (group,) = wait_until(lambda: mirrored.children(s))
    for each in (s, group):
        assert each.attributes["dask.tasks.erred"] == 3, each.name
        assert each.status.status_code is StatusCode.ERROR
        assert each.status.description == "3 tasks erred"


def test_error_type_of_a_task_that_erred_because_its_dependency_did(cluster):
    client, mirrored = cluster
    with span("upstream"):
        bad = client.submit(fail, 1)
    with span("downstream") as sid:
        wait(client.submit(inc, bad))
    assert mirrored.by_dask_id(sid).attributes["error.type"] == "ValueError"


def test_error_type_of_a_task_whose_workers_died_is_killed_worker(tmp_path):
    config = {"distributed.scheduler.allowed-failures": 0}
    with otel_cluster(config, processes=True, n_workers=1) as (client, mirrored):
        with span("killer") as sid:
            wait(client.submit(die_once, str(tmp_path / "killed")))
        s = mirrored.by_dask_id(sid, timeout=60)
        assert s.status.status_code is StatusCode.ERROR
        assert s.attributes["error.type"] == "KilledWorker"
        (event,) = [e.attributes for e in s.events if e.name == "exception"]
        assert event["exception.type"] == "KilledWorker"  # no text of its own: says why
        assert event["exception.message"] == "its workers died: see the dask.worker.lost span events"


def test_multiple_tags_at_once_nest(cluster):
    client, mirrored = cluster
    with span("a", "b", "c") as leaf_id:
        client.submit(inc, 10).result()
    leaf = mirrored.by_dask_id(leaf_id)
    assert leaf.name == "c"
    assert leaf.attributes["dask.span.name"] == ("a", "b", "c")
    parent = next(s for s in mirrored.spans() if s.context.span_id == leaf.parent.span_id)
    assert parent.name == "b"
    wait_until(lambda: any(s.name == "a" and s.parent is None for s in mirrored.spans()))


def test_unicode_and_parameterised_tags(cluster):
    client, mirrored = cluster
    for i, tag in enumerate(["données", "モデル", "x" * 5000]):
        with span(f"run {i}", tag) as sid:
            client.submit(inc, i, key=f"inc-tag-{i}").result()
        s = mirrored.by_dask_id(sid)
        assert s.attributes["dask.span.name"][0] == f"run {i}"
        # the name is cut as the tag is, to the attribute length limit (4096 here)
        assert s.name == s.attributes["dask.span.name"][1] == tag[:4096]


def test_default_span_each_idle_period_its_own_trace(cluster):
    client, mirrored = cluster
    client.submit(inc, 1, key="first-default").result()
    wait_until(lambda: [s for s in mirrored.spans() if s.name == "default"])
    client.submit(inc, 2, key="second-default").result()
    defaults = wait_until(
        lambda: len(r := [s for s in mirrored.spans() if s.name == "default"]) == 2 and r
    )
    assert defaults[0].context.trace_id != defaults[1].context.trace_id
    assert all(s.parent is None for s in defaults)


def test_span_code_is_not_exported_by_default():
    # Dask records code (nframes > 0): there is something to withhold
    with otel_cluster({"distributed.diagnostics.computations.nframes": 1}) as (client, mirrored):
        with span("secret") as sid:
            dask.delayed(inc)(1).compute()
        s = mirrored.by_dask_id(sid)
        dask_span = mirrored.cluster.scheduler.extensions["spans"].spans[sid]
        assert any(dask_span.code)
    assert not any("code" in k for k in s.attributes)


def test_span_code_is_exported_when_asked(caplog):
    config = {"otel.spans.code": True, "distributed.diagnostics.computations.nframes": 1}
    with otel_cluster(config) as (client, mirrored):
        with span("shown") as sid:
            dask.delayed(inc)(1).compute()
        code = mirrored.by_dask_id(sid).attributes["dask.span.code"]
        assert any("dask.delayed(inc)(1).compute()" in c for c in code)
    assert "nframes" not in caplog.text


def test_span_code_without_nframes_warns_once_naming_the_dask_key(caplog):
    """Dask's default nframes is 0: the client sends no code, and one WARNING says
    which key to set"""
    with otel_cluster({"otel.spans.code": True}) as (client, mirrored):
        for name in ("first", "second"):
            with span(name) as sid:
                dask.delayed(inc)(1).compute()
            assert mirrored.by_dask_id(sid).attributes["dask.span.code"] == ()
    told = [r for r in caplog.records if "nframes" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.WARNING
    assert "distributed.diagnostics.computations.nframes" in told[0].getMessage()


def test_own_totals_count_nothing_twice():
    with otel_cluster({"otel.spans.totals": "own"}) as (client, mirrored):
        with span("parent") as parent_id:
            client.gather(client.map(inc, range(2)))
            with span("child") as child_id:
                client.gather(client.map(double, range(3)))
        parent, child = mirrored.by_dask_id(parent_id), mirrored.by_dask_id(child_id)
        assert parent.attributes["dask.tasks.total"] == 2
        assert child.attributes["dask.tasks.total"] == 3


def test_subtree_totals_include_children(cluster):
    client, mirrored = cluster
    with span("parent") as parent_id:
        client.gather(client.map(inc, range(2)))
        with span("child"):
            client.gather(client.map(double, range(3)))
    assert mirrored.by_dask_id(parent_id).attributes["dask.tasks.total"] == 5


def test_subtree_totals_are_dasks_own_span_properties(cluster):
    """Sub-spans' totals are rolled up into their parent as they are exported; the
    result is what Dask's own Span properties say of the whole tree"""
    client, mirrored = cluster
    with span("root") as root_id:
        client.gather(client.map(inc, range(2), key=["r0", "r1"]))
        with span("left"):
            client.gather(client.map(slow, range(3), delay=0.05))
            with span("deep"):
                client.gather(client.map(double, range(4)))
        with span("right"):
            client.gather(client.map(inc, range(5), key=[f"right{i}" for i in range(5)]))
    attrs = mirrored.by_dask_id(root_id).attributes
    dask_span = mirrored.cluster.scheduler.extensions["spans"].spans[root_id]
    assert attrs["dask.tasks.total"] == sum(dask_span.states.values()) == 14
    assert attrs["dask.output.bytes"] == dask_span.nbytes_total
    assert attrs["dask.duration"] == pytest.approx(dask_span.duration)
    expected: dict[str, float] = {}
    for (context, *_, activity, unit), value in dask_span.cumulative_worker_metrics.items():
        name = f"dask.metrics.{context}.{activity}.{unit}".replace(" ", "_").replace("-", "_")
        expected[name] = expected.get(name, 0) + value
    got = {k: v for k, v in attrs.items() if k.startswith("dask.metrics.")}
    # Idle is the thread time over the exported span's time that no task
    # accounts for: Dask's own over Span.stop differs by where the span ends
    idle = "dask.metrics.execute.idle_or_other_spans.seconds"
    execute = sum(v for k, v in got.items() if k.startswith("dask.metrics.execute.") and k != idle
                  and k.endswith(".seconds"))
    assert got.pop(idle) == pytest.approx(attrs["dask.active_cpu_seconds"] - execute)
    expected.pop(idle, None)
    assert got == pytest.approx({k: v for k, v in expected.items() if v})
    (event,) = [e for e in mirrored.by_dask_id(root_id).events]
    assert event.timestamp == int(dask_span.start * 1e9)
    # Nothing is kept once the tree is exported
    assert not (mirrored.plugin.mirror.ledger.records or mirrored.plugin.mirror.ledger.leaves)


@contextlib.contextmanager
def uninstrumented_cluster() -> Iterator[tuple[LocalCluster, Client]]:
    """A cluster started without the preload key, for dask_otel.instrument"""
    with otel_cluster(UNINSTRUMENTED_CONFIG, n_workers=1) as (client, mirrored):
        yield mirrored.cluster, client


def test_instrumented_mid_span_counts_the_steps_before_it():
    why = "a step finished before dask_otel.instrument is summed into its parent, not exported"
    oracle.waive("every-span", why)
    oracle.waive("every-task", why)
    with uninstrumented_cluster() as (cluster, client):
        with span("outer") as outer_id:
            with span("done before"):
                client.gather(client.map(inc, range(3)))
            with span("running"):
                running = client.submit(slow, 1, delay=1)
            wait_until(lambda: running.key in cluster.scheduler.tasks)
            dask_otel.instrument(client)  # "outer" and "running" are open
            running.result()
        plugin = cluster.scheduler.plugins["dask-otel"]
        exporter = plugin.telemetry.span_exporters[0]
        # built on the builder thread once the ledger lets the record go
        (outer,) = wait_until(lambda: [s for s in exporter.get_finished_spans()
                                       if s.attributes["dask.span.id"] == outer_id])
        assert outer.attributes["dask.tasks.total"] == 4
        assert not (plugin.mirror.ledger.records or plugin.mirror.ledger.leaves)


def test_each_span_is_exported_once_and_forgotten(cluster):
    client, mirrored = cluster
    with span("once") as sid:
        client.gather(client.map(inc, range(3)))
    mirrored.by_dask_id(sid)
    time.sleep(0.5)  # several more polls
    ids = [s.context.span_id for s in mirrored.spans()]
    assert len(ids) == len(set(ids))
    status = dask_otel.status(client)["scheduler"]
    assert status["open_spans"] == status["open_groups"] == 0
    assert status["mirrored_spans"] == len(ids)


def test_work_on_an_exported_span_becomes_new_children_not_a_duplicate(cluster):
    client, mirrored = cluster
    with span("notebook") as sid:
        client.submit(inc, 1).result()
        first = mirrored.by_dask_id(sid)  # exported: done for longer than the delay
        client.submit(double, 2).result()  # new work under the same Dask span
        late = wait_until(lambda: [c for c in mirrored.children(first) if c.name == "taskgroup/double"])
    time.sleep(0.5)
    same_id = [s for s in mirrored.spans() if s.context.span_id == first.context.span_id]
    assert same_id == [first]
    assert late[0].context.trace_id == first.context.trace_id


def test_span_not_done_waits_for_export_delay():
    with otel_cluster({"otel.spans.export-delay": "1s"}) as (client, mirrored):
        with span("quick succession") as sid:
            client.submit(inc, 1).result()
            time.sleep(0.3)  # less than the export delay
            client.submit(slow, 1, delay=0.5).result()
        s = mirrored.by_dask_id(sid)
        # One OTel span covering both computes, not one cut after the first
        assert (s.end_time - s.start_time) / 1e9 >= 0.8
        assert s.attributes["dask.tasks.total"] == 2


def test_a_running_group_is_looked_at_once_per_export_delay_and_exported_when_done():
    """Polls pass over a TaskGroup found running until otel.spans.export-delay has
    passed (one comparison, not Dask's states), and still export it once, whole,
    one delay after its last task"""
    from distributed import Event

    with otel_cluster({"otel.spans.export-delay": "500ms"}) as (client, mirrored):
        mirror = mirrored.plugin.mirror
        with span("long") as sid:
            future = client.submit(wait_for_event, "go", key="waiting-0")
            batch = wait_until(lambda: next(iter(mirror.ledger.groups.values()), None))
            wait_until(lambda: batch.busy, what="a poll finding the group running")
            for _ in range(3):  # several polls (every 100 ms) while it runs
                found = batch.busy
                assert batch.wake == found + 0.5
                wait_until(lambda found=found: batch.busy > found, what="the next look")
                assert batch.busy >= found + 0.5  # not looked at in between
            Event("go").set()
            future.result()
        finished = time.monotonic()
        s = mirrored.by_dask_id(sid)
        latency = time.monotonic() - finished
        (group,) = mirrored.children(s)
        scheduler = mirrored.cluster.scheduler
        tg = scheduler.task_groups[group.attributes["dask.taskgroup.name"]]
        heard = max(t for key, start, _, _, _, t in scheduler.transition_log
                    if key == "waiting-0" and start == "processing")
        assert not mirror.ledger.groups
    # Dask's stop, or earlier where Dask's clock-offset estimate put it after the
    # scheduler heard of the task: then when the plugin's hook heard it, just after
    # Dask logged the transition (the causal bound, docs/traces.md)
    stop, heard = int(tg.stop * 1e9), int(heard * 1e9)
    assert group.end_time == stop or heard <= group.end_time < stop
    assert group.name == "taskgroup/waiting"
    assert [x.name for x in mirrored.spans()] == ["taskgroup/waiting", "long"]  # each once
    assert 0.4 <= latency < 2.5  # the delay after its end, not a delay after a late look


def test_scheduler_close_exports_unfinished_spans():
    with otel_cluster({"otel.spans.export-delay": "1h"}, n_workers=1) as (client, mirrored):
        cluster = mirrored.cluster
        with span("cut short") as sid:
            fut = client.submit(slow, 1, delay=5)
            wait_until(lambda: getattr(cluster.scheduler.tasks.get(fut.key), "state", None) == "processing")
            cluster.close()  # while the task runs and the client still wants it
        spans = mirrored.spans()
    (s,) = [s for s in spans if s.context.span_id == dask_span_ids(sid)[1]]
    assert s.attributes["dask.span.unfinished"] is True
    assert s.end_time >= s.start_time
    assert_well_formed(spans)


def test_the_close_hands_the_sdk_every_span_before_it_flushes():
    """The scheduler's close exports what is open (three finished spans waiting for
    their export delay, one cut short, and their TaskGroups: 8 spans), and its
    release lets the builder thread hand them all to the SDK before the SDK flushes
    and shuts down, though the exporter takes 0.1 s a span (the in-memory exporter's
    processor exports on the builder thread): none is built after the shutdown"""
    with otel_cluster({"otel.spans.export-delay": "1h"}, n_workers=1) as (client, mirrored):
        cluster = mirrored.cluster
        for i in range(3):
            with span(f"waiting {i}"):
                client.submit(inc, i, key=f"waiting{i}-0").result()
        (memory,) = mirrored.plugin.telemetry.span_exporters
        export = memory.export

        def slow_export(batch):
            time.sleep(0.1)
            return export(batch)

        memory.export = slow_export
        with span("cut short"):
            fut = client.submit(slow, 1, delay=5)
            wait_until(lambda: getattr(cluster.scheduler.tasks.get(fut.key), "state", None) == "processing")
            cluster.close()
    names = sorted(s.name for s in mirrored.spans())
    assert names == sorted(["cut short", "taskgroup/slow"] + [f"waiting {i}" for i in range(3)]
                           + [f"taskgroup/waiting{i}" for i in range(3)]), names


def test_a_full_builder_queue_drops_children_first_and_never_orphans_what_it_keeps():
    """The builder's queue, of two spans here; a poll hands over TaskGroups and then
    their Dask spans (children first), and the root after its three sub-spans, in
    that poll or a later one. A full queue drops TaskGroups and Dask spans, but keeps,
    past its capacity, every Dask span below which a span was kept: each span that
    arrives has its parent; each one dropped is counted, in status() and in
    dask.otel.export.dropped with error.type=queue_full"""
    oracle.waive("every-task", "a queue of 2 drops batches on purpose, counted")
    oracle.waive("every-span", "a queue of 2 drops spans on purpose, counted")
    config = {"otel.metrics.exporter": "memory", "otel.spans.export-delay": "300ms"}
    with otel_cluster(config, n_workers=1) as (client, mirrored):
        mirror = mirrored.plugin.mirror
        builder = mirror.builder
        builder.capacity = 2
        with span("root"):
            for i in range(3):
                with span(f"stage {i}"):
                    client.gather([client.submit(inc, j, key=f"s{i}g{j}-0") for j in range(5)])
        made = 1 + 3 + 3 * 5  # Dask spans and TaskGroups
        wait_until(lambda: not mirror.ledger.records and builder.built == builder.queued,
                   what="every span handed over and built")
        spans = mirrored.spans()
        assert_span_tree(spans, ends="inside-if-exported-first")
        assert builder.dropped == made - len(spans) > 0, (builder.dropped, len(spans))
        assert dask_otel.status(client)["scheduler"]["queue_full_dropped_spans"] == builder.dropped
        points = collect(metric_reader(mirrored.cluster))
        assert value(points, "dask.otel.export.dropped", error_type="queue_full") == builder.dropped


def test_instrument_a_running_cluster():
    for check in ("every-span", "every-task"):
        oracle.waive(check, "finished before dask_otel.instrument: not the bridge's", ["before"])
    with uninstrumented_cluster() as (cluster, client):
        with span("before") as before_id:
            client.submit(inc, 1).result()
        assert "dask-otel" not in cluster.scheduler.plugins
        dask_otel.instrument(client)
        plugin = cluster.scheduler.plugins["dask-otel"]
        dask_otel.instrument(client)  # twice is harmless: the same plugin, one mirror
        assert cluster.scheduler.plugins["dask-otel"] is plugin
        assert sum(isinstance(p, type(plugin)) for p in cluster.scheduler.plugins.values()) == 1
        with span("after") as after_id:
            client.submit(inc, 2).result()
        wait_until(lambda: plugin.mirror.mirrored >= 2)
        spans = plugin.telemetry.span_exporters[0].get_finished_spans()
        names = {s.attributes["dask.span.id"] for s in spans}
        assert after_id in names and before_id not in names
        assert all(w["error"] is None for w in dask_otel.status(client)["workers"].values())


@pytest.mark.parametrize(
    "key, value",
    [
        ("otel.spans.export-delay", "soon"),
        ("otel.spans.poll-interval", 0),
        ("otel.spans.code", "yes"),
        ("otel.traces.exporter", "jaeger-thrift"),
        ("otel.spans.totals", "everything"),
    ],
)
def test_bad_config_value_is_logged_and_the_cluster_computes(key, value, caplog):
    with caplog.at_level(logging.ERROR, logger="dask_otel"):
        with otel_cluster({key: value}) as (client, _):
            assert client.submit(inc, 41).result() == 42
            status = dask_otel.status(client)
    assert key in status["scheduler"]["error"] and repr(value) in status["scheduler"]["error"]
    assert any(key in r.getMessage() and repr(value) in r.getMessage() for r in caplog.records)


def test_bad_otlp_protocol_names_the_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with otel_cluster({"otel.traces.exporter": "otlp"}) as (client, _):
        assert client.submit(inc, 1).result() == 2
        error = dask_otel.status(client)["scheduler"]["error"]
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in error and "http/json" in error


#: Every signal the bridge can emit switched on, exported over OTLP (the Dask spans,
#: task spans, scheduler and worker metrics with Dask's families, log records, Dask's
#: events and a user's topic): what ``otel.enabled: false`` must keep silent
EVERY_SIGNAL = {
    "otel.traces.exporter": "otlp",
    "otel.metrics.exporter": "otlp",
    "otel.metrics.dask": True,
    "otel.logs.exporter": "otlp",
    "otel.tasks.spans": True,
    "otel.events.topics": "dask, inventory",
    "otel.flush-timeout": "2s",
}
#: Batches and collections sent as soon as they are made
FAST_EXPORT = {
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_BLRP_SCHEDULE_DELAY": "100",
    "OTEL_METRIC_EXPORT_INTERVAL": "300",
}


def signals_emitted(monkeypatch, enabled: bool) -> dict[str, object]:
    """Run a workload that gives every signal a reason to be emitted, on a cluster
    of worker processes with ``otel.enabled`` set to ``enabled``, and return what
    reached the collector or the tasks, by signal (empty values: nothing)"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_EXPORT})
        config = {**EVERY_SIGNAL, "otel.enabled": enabled}
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            with span("workflow"):
                in_task = client.submit(current_ids, "in a task").result()
                client.submit(log_in_task, 3).result()  # the root logger, in a task
                client.submit(print_in_task, 4).result()  # a Dask event
            client.log_event("inventory", {"sku": "a1"})
            time.sleep(1.0)  # a few export intervals (300 ms) with the cluster up
            status = dask_otel.status(client)
        time.sleep(0.5)  # the last requests of the close, if any, arrive
        logs = receiver.logs()
        return {
            "spans": receiver.span_names(),
            "metrics": receiver.metric_names(),
            "log records": [str(g.body) for g in logs if "dask.event.topic" not in g.attributes],
            "events": [g.attributes["dask.event.topic"] for g in logs
                       if "dask.event.topic" in g.attributes],
            "task context": in_task if in_task[0] else None,
            "requests": receiver.requests,
            "status": {
                "scheduler": status["scheduler"]["traces"],
                "workers": [w and w["task_context"] for w in status["workers"].values()],
            },
        }


def test_disabled_does_nothing(monkeypatch):
    """otel.enabled: false on the scheduler: no span, metric point, log record or
    event reaches the collector, tasks run in no OTel context, and no request is
    sent at all, although every signal is configured to be exported"""
    emitted = signals_emitted(monkeypatch, enabled=False)
    leaked = {name: what for name, what in emitted.items() if what and name != "status"}
    assert leaked == {}, f"leaked with otel.enabled false: {leaked}"
    assert emitted["status"] == {"scheduler": False, "workers": [None]}


def test_the_disabled_workload_emits_every_signal_when_enabled(monkeypatch):
    """The control of test_disabled_does_nothing: the same workload with the bridge
    on emits each signal it checks, so an empty one there means 'not emitted'"""
    emitted = signals_emitted(monkeypatch, enabled=True)
    assert {"workflow", "taskgroup/log_in_task", "taskgroup/current_ids"} <= set(emitted["spans"])
    metrics = set(emitted["metrics"])
    assert "dask.spill.memory.keys" in metrics  # a worker's
    assert "dask.otel.span.mirrored" in metrics  # the scheduler's
    assert "dask.scheduler.tasks" in metrics  # Dask's own families
    assert "scored partition 3" in emitted["log records"]
    assert {"print", "inventory"} <= set(emitted["events"])
    assert emitted["task context"] is not None
    assert emitted["status"] == {"scheduler": True, "workers": [True]}


def test_default_settings_export_within_5_seconds_of_completion():
    defaults = {"otel.spans.export-delay": "2s", "otel.spans.poll-interval": "500ms"}
    with otel_cluster(defaults) as (client, mirrored):
        with span("prompt") as sid:
            client.gather(client.map(inc, range(3)))
        done = time.monotonic()
        mirrored.by_dask_id(sid, timeout=5)
        latency = time.monotonic() - done
    assert 1.5 <= latency < 5  # not long before the 2 s export delay; within the promise


def test_active_cpu_seconds_is_dasks(cluster):
    from dask_otel.scheduler.totals import active_cpu_seconds

    client, mirrored = cluster
    with span("measured") as sid:
        client.gather(client.map(slow, range(3), delay=0.1))
    exported_span = mirrored.by_dask_id(sid)
    exported = exported_span.attributes["dask.active_cpu_seconds"]
    dask_span = mirrored.cluster.scheduler.extensions["spans"].spans[sid]
    # Dask's property over the exported span's time: it ends when the scheduler
    # heard of its last task, which bounds Span.stop (docs/traces.md, "Times")
    end = exported_span.end_time / 1e9
    assert exported == pytest.approx(active_cpu_seconds(dask_span, end), rel=1e-9)
    assert active_cpu_seconds(dask_span, dask_span.stop) == pytest.approx(
        dask_span.active_cpu_seconds, rel=1e-9
    )


@pytest.mark.parametrize("sampler, kept", [("always_off", 0), ("always_on", 4)])
def test_otel_traces_sampler_is_honoured_per_trace(sampler, kept, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    with otel_cluster() as (client, mirrored):
        with span("sampled?"):
            with span("child"):
                client.submit(inc, 1, key="sampledinc-1").result()
            client.submit(double, 1, key="sampleddouble-1").result()
        mirror = mirrored.plugin.mirror
        wait_until(lambda: mirror.mirrored + mirror.sampled_out >= 4)
        assert len(mirrored.spans()) == kept == mirror.mirrored
        assert mirror.sampled_out == 4 - kept
        # Nothing is kept about a span once exported or sampled out
        assert not (mirror.ledger.records or mirror.ledger.groups or mirror.ledger.leaves)


# --- fidelity: failed tasks' times, every batch of a TaskGroup (issue 9) -----------


def _duration(s) -> float:
    return (s.end_time - s.start_time) / 1e9


@pytest.mark.parametrize("processes", [False, True])
def test_erred_only_span_ends_when_its_task_failed_within_its_parent(processes):
    with otel_cluster(processes=processes) as (client, mirrored):
        with span("root") as root_id:
            with span("load"):
                client.gather(client.map(inc, range(2)))
            with span("fail") as fail_id:
                # 2 s: Dask's estimate of a worker's clock offset (distributed 2024.1.0,
                # a loaded machine) was seen 0.51 s off, and the times are bounded by it
                wait(client.submit(fail_slowly, 1, delay=2.0, key="failslowly-1"))
        root = mirrored.by_dask_id(root_id)
        failed = mirrored.by_dask_id(fail_id)
        (group,) = wait_until(lambda: mirrored.children(failed))
        # The task ran 2 s before it failed: Dask records no run time for it
        assert 0.5 <= _duration(group) < 3
        assert _duration(failed) >= 0.5
        assert group.end_time <= failed.end_time <= root.end_time
        assert failed.status.status_code is StatusCode.ERROR
        # (and every span lies within its parent: checked as the cluster closes)


def test_export_delay_runs_from_when_the_last_task_failed():
    """The span's last task erred: the next compute, submitted within the export
    delay of that failure, still joins the same span"""
    with otel_cluster({"otel.spans.export-delay": "1s"}) as (client, mirrored):
        with span("fails last") as sid:
            client.submit(inc, 1, key="quick-1").result()
            wait(client.submit(fail_slowly, 1, delay=1.2, key="failslowly-2"))
            time.sleep(0.4)  # less than the delay since the failure
            client.submit(inc, 2, key="next-1").result()
        s = mirrored.by_dask_id(sid)
        assert s.attributes["dask.tasks.total"] == 3
        assert _duration(s) >= 1.5


def test_nested_erred_only_spans_nest_in_time(cluster):
    client, mirrored = cluster
    with span("outer") as outer_id:
        with span("middle") as middle_id:
            with span("inner") as inner_id:
                wait(client.map(fail_slowly, range(2), delay=0.2))
    outer, middle, inner = (mirrored.by_dask_id(i) for i in (outer_id, middle_id, inner_id))
    assert outer.start_time <= middle.start_time <= inner.start_time
    assert inner.end_time <= middle.end_time <= outer.end_time
    assert _duration(inner) >= 0.15
    assert outer.attributes["dask.tasks.erred"] == 2
    assert_well_formed(mirrored.spans())


def test_erred_only_default_span_ends_when_its_tasks_failed(cluster):
    client, mirrored = cluster
    wait(client.submit(fail_slowly, 1, key="defaultfail-1"))
    default = wait_until(lambda: [s for s in mirrored.spans() if s.name == "default"])[0]
    assert _duration(default) >= 0.25
    assert_well_formed(mirrored.spans())


def exported_inc_in_span_a(client, mirrored):
    """Span A with one task of TaskGroup inc, A and the group exported: A's span,
    and the task's future (held, so that Dask keeps the group)"""
    with span("A") as a_id:
        first = client.submit(inc, 1)
        first.result()
    a = mirrored.by_dask_id(a_id)
    wait_until(lambda: mirrored.children(a))
    return a, first


def test_taskgroup_work_after_its_export_is_a_new_child_of_the_span_it_was_submitted_in(
    cluster,
):
    """``client.submit(f, x)`` without key= puts every call of f in TaskGroup f,
    which Dask keeps on the first span (the TaskGroup collision): the second
    call, after the first span was exported, is a new batch covering only
    itself, a child of span B, where it was submitted, inside it"""
    client, mirrored = cluster
    a, first = exported_inc_in_span_a(client, mirrored)
    with span("B") as b_id:  # one graph: inc (A's group) and B's own group
        doubled = dask.delayed(double)(dask.delayed(inc)(2), dask_key_name="double-b")
        second = client.compute(doubled)
        second.result()
    b = mirrored.by_dask_id(b_id)
    assert [g.name for g in mirrored.children(a)] == ["taskgroup/inc"]
    groups = wait_until(lambda: len(c := mirrored.children(b)) == 2 and c)
    assert [g.name for g in groups] == ["taskgroup/inc", "taskgroup/double-b"]
    assert groups[0].attributes["dask.tasks.total"] == 1
    assert groups[0].attributes["dask.duration"] > 0
    del first, second
    time.sleep(0.5)  # more polls: nothing is exported twice
    assert len(mirrored.children(a)) == 1 and len(mirrored.children(b)) == 2
    assert_span_tree(mirrored.spans(), ends="inside")


def test_a_later_batch_whose_block_dask_never_made_is_exported_in_the_span_the_bridge_makes(
    cluster,
):
    """All of B's tasks join a group of A, exported: Dask makes no span of B. The
    bridge makes B's span itself (its ids, marked ``dask.span.collided``, linked to
    A), and the batch lies inside it; never under A, which ended before it ran
    (before: the batch was not exported at all)"""
    client, mirrored = cluster
    a, first = exported_inc_in_span_a(client, mirrored)
    with span("B") as b_id:
        second = client.submit(inc, 2)
        second.result()
    b = mirrored.by_dask_id(b_id)
    (batch,) = wait_until(lambda: mirrored.children(b))
    assert [g.name for g in mirrored.children(a)] == ["taskgroup/inc"]
    assert batch.name == "taskgroup/inc" and batch.attributes["dask.tasks.total"] == 1
    assert b.attributes["dask.span.collided"] is True
    assert [link.context.span_id for link in b.links] == [a.context.span_id]
    assert a.end_time <= batch.start_time
    assert_span_tree(mirrored.spans(), ends="inside")
    del first, second


def test_collided_work_sent_in_no_block_goes_under_the_span_of_its_graphs_new_groups(cluster):
    """A graph sent in no block: inc joins A's exported group, double-free is new
    (Dask puts it on its default span): nothing says where the graph was sent but
    Dask's span of its new group, which the inc batch joins"""
    client, mirrored = cluster
    a, first = exported_inc_in_span_a(client, mirrored)
    second = client.compute(dask.delayed(double)(dask.delayed(inc)(2), dask_key_name="double-free"))
    second.result()
    default = wait_until(lambda: next((s for s in mirrored.spans() if s.name == "default"), None))
    groups = wait_until(lambda: len(c := mirrored.children(default)) == 2 and c)
    assert sorted(g.name for g in groups) == ["taskgroup/double-free", "taskgroup/inc"]
    assert_span_tree(mirrored.spans(), ends="inside")
    del first, second


def test_collided_work_of_a_busy_block_goes_under_its_dask_otel_block(cluster):
    """In-process, the client's annotations reach the scheduler by reference: a
    second graph of a block, sent while its first runs, shows the scheduler the
    same span annotation, which an earlier graph's left there would show too. Its
    task, joining A's exported group, still goes under its block: the ``otel``
    annotation's ``entered`` names it"""
    client, mirrored = cluster
    a, first = exported_inc_in_span_a(client, mirrored)
    with dask_otel.span("B") as b_id:
        busy = client.submit(slow, 1, delay=1, key="busy-b")
        second = client.submit(inc, 2)
        second.result()
        busy.result()
    b = mirrored.by_dask_id(b_id)
    groups = wait_until(lambda: len(c := mirrored.children(b)) == 2 and c)
    assert sorted(g.name for g in groups) == ["taskgroup/busy-b", "taskgroup/inc"]
    assert_span_tree(mirrored.spans(), ends="inside")
    del first, second


def test_collided_work_of_a_block_after_its_first_graph_goes_under_it(cluster):
    """In-process (the client's annotations reach the scheduler by reference): block
    B's second graph, sent after its first finished, joins A's exported group; it
    shows the scheduler the very annotation the first did, in a computation of its
    own, so it is the block's: the batch goes under B"""
    client, mirrored = cluster
    a, first = exported_inc_in_span_a(client, mirrored)
    with span("B") as b_id:
        own = client.submit(double, 1, key="double-b")
        own.result()
        second = client.submit(inc, 2)
        second.result()
    b = mirrored.by_dask_id(b_id)
    groups = wait_until(lambda: len(c := mirrored.children(b)) == 2 and c)
    assert sorted(g.name for g in groups) == ["taskgroup/double-b", "taskgroup/inc"]
    assert_span_tree(mirrored.spans(), ends="inside")
    del first, own, second


def test_collided_work_sent_in_no_block_while_a_block_runs_is_not_put_in_that_block():
    """Worker processes. While block X's graph runs, a graph sent in no block joins A's
    exported group: the scheduler's computation still holds X's span annotation (it
    keeps what earlier graphs sent), but this graph sent none: its batch is a root of
    its own, never in X's run"""
    with otel_cluster(processes=True) as (client, mirrored):
        a, first = exported_inc_in_span_a(client, mirrored)
        with span("X") as x_id:
            busy = client.submit(slow, 1, delay=1, key="busy-x")
        second = client.submit(inc, 2)
        second.result()
        busy.result()
        x = mirrored.by_dask_id(x_id)
        root = wait_until(lambda: next((s for s in mirrored.spans() if s.name == "inc"), None))
        (batch,) = wait_until(lambda: mirrored.children(root))
        assert [g.name for g in mirrored.children(x)] == ["taskgroup/busy-x"]
        assert batch.name == "taskgroup/inc" and root.context.trace_id != x.context.trace_id
        del first, second, busy


def dask_tasks_by_group(cluster: LocalCluster) -> dict[str, int]:
    """Dask's own record: by TaskGroup name, the tasks it added to the TaskGroups of
    that name (``TaskGroup.states`` summed), over the TaskGroups of every Dask span"""
    groups = {tg for s in cluster.scheduler.extensions["spans"].spans.values() for tg in s.groups}
    out: dict[str, int] = {}
    for tg in groups:
        out[tg.name] = out.get(tg.name, 0) + sum(tg.states.values())
    return out


def batch_tasks_by_group(spans: list) -> dict[str, int]:
    """What the exported TaskGroup batches count, by TaskGroup name"""
    out: dict[str, int] = {}
    for s in spans:
        if (name := s.attributes.get("dask.taskgroup.name")) is not None:
            out[name] = out.get(name, 0) + s.attributes["dask.tasks.total"]
    return out


@pytest.mark.parametrize("block", [span, dask_otel.span], ids=["distributed", "dask_otel"])
def test_every_task_of_a_block_dask_made_no_span_of_is_counted_inside_the_blocks_span(block):
    """Worker processes. Block A submits inc and is exported; block B then submits
    inc again: Dask puts B's task on A's TaskGroup (the collision) and makes no span
    of B. Every task Dask ran is counted in exactly one exported batch, every span
    lies inside its parent, A ended before B's work began, B's trace is the one its
    id names, and B counts as a run (before: B's batch was never exported)"""
    config = {"otel.metrics.exporter": "memory", "otel.metrics.workflows": ["A", "B"]}
    with otel_cluster(config, processes=True) as (client, mirrored):
        with block("A") as a_id:
            first = client.submit(inc, 1)
            first.result()
        a = mirrored.by_dask_id(a_id)
        wait_until(lambda: mirrored.children(a))  # A's batch exported: A's work is over
        b_submitted = time.time()
        with block("B") as b_id:
            second = client.submit(inc, 2)
            second.result()
        b = mirrored.by_dask_id(b_id)
        (batch,) = wait_until(lambda: mirrored.children(b))
        ran = dask_tasks_by_group(mirrored.cluster)
        wait_until(lambda: runs_by_name(mirrored.cluster) == {("A", "ok"): 1, ("B", "ok"): 1})
        spans = mirrored.spans()
        del first, second
    assert sum(ran.values()) == 2  # both on A's TaskGroup
    assert batch_tasks_by_group(spans) == ran
    assert batch.attributes["dask.tasks.total"] == 1
    assert_span_tree(spans, ends="inside")
    assert a.end_time <= batch.start_time and a.end_time / 1e9 <= b_submitted
    assert b.context.trace_id == dask_span_ids(b_id)[0] and b.parent is None
    assert b.attributes["dask.span.collided"] is True
    assert [link.context.span_id for link in b.links] == [a.context.span_id]


def runs_by_name(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    """``dask.workflow.runs`` by workflow name and result, from the scheduler's
    in-memory reader"""
    out: dict[tuple[str, str], float] = {}
    for p in collect(metric_reader(cluster)).get("dask.workflow.runs", []):
        key = p.attributes["dask.workflow.name"], p.attributes["dask.workflow.result"]
        out[key] = out.get(key, 0) + p.value
    return out


def test_a_task_that_erred_in_a_block_dask_made_no_span_of_errs_that_blocks_run():
    """Worker processes. Block A's task erred; block B's erring task joins A's
    exported TaskGroup: B's span (the bridge's) and B's run erred, A's run is
    counted once"""
    config = {"otel.metrics.exporter": "memory", "otel.metrics.workflows": ["A", "B"]}
    with otel_cluster(config, processes=True) as (client, mirrored):
        with span("A") as a_id:
            first = client.submit(fail, 1)
            wait(first)
        a = mirrored.by_dask_id(a_id)
        wait_until(lambda: mirrored.children(a))
        with span("B") as b_id:
            second = client.submit(fail, 2)
            wait(second)
        b = mirrored.by_dask_id(b_id)
        wait_until(lambda: runs_by_name(mirrored.cluster) == {("A", "erred"): 1, ("B", "erred"): 1})
        del first, second
    assert b.status.status_code is StatusCode.ERROR and b.attributes["dask.tasks.erred"] == 1


def test_collided_work_submitted_in_no_block_is_a_root_of_its_own_linked_to_its_group():
    """A graph in no span whose every task joins A's exported TaskGroup: nothing
    says where it was submitted, A is over, so its batch is exported under a root
    of its own, named after its task prefix, marked ``dask.span.collided`` and
    linked to A, counted as a run (before: not exported)"""
    with otel_cluster({"otel.metrics.exporter": "memory"}, processes=True) as (client, mirrored):
        with span("A") as a_id:
            first = client.submit(inc, 1)
            first.result()
        a = mirrored.by_dask_id(a_id)
        wait_until(lambda: mirrored.children(a))
        second = client.submit(inc, 2)
        second.result()
        root = wait_until(lambda: next((s for s in mirrored.spans() if s.name == "inc"), None))
        (batch,) = wait_until(lambda: mirrored.children(root))
        ran = dask_tasks_by_group(mirrored.cluster)
        wait_until(lambda: sum(runs_by_name(mirrored.cluster).values()) == 2)
        spans = mirrored.spans()
        del first, second
    assert batch_tasks_by_group(spans) == ran and sum(ran.values()) == 2
    assert root.parent is None and root.attributes["dask.span.collided"] is True
    assert [link.context.span_id for link in root.links] == [a.context.span_id]
    assert a.end_time <= batch.start_time
    assert_span_tree(spans, ends="inside")


def shuffling_workflow(client: Client, pdf, right, held: list) -> str:
    """One run: a from_pandas ingest, a P2P shuffle and a merge, an array rechunk,
    an erring stage, in three levels of ``distributed.span``; what it persisted is
    kept in ``held`` (so Dask keeps its TaskGroups for the next run)"""
    da = pytest.importorskip("dask.array")
    dd = pytest.importorskip("dask.dataframe")
    with span("workflow") as root_id:
        with span("ingest"):
            df = dd.from_pandas(pdf, npartitions=4).persist()
            wait(df)
        with span("transform"):
            with span("shuffle"):
                shuffled = df.shuffle("k", shuffle_method="p2p").persist()
                wait(shuffled)
            with span("merge"):
                merged = shuffled.merge(right, on="k").persist()
                wait(merged)
        with span("arrays"):
            client.compute(da.arange(64, chunks=8).reshape(8, 8).rechunk((8, 2)).sum()).result()
        with span("erring"):
            wait(client.submit(fail, 1))
    held += [df, shuffled, merged]
    return root_id


def test_a_workflow_run_twice_counts_every_task_of_each_run_in_its_own_trace():
    """Worker processes; a deterministic dataframe workflow run twice, the first
    run's results held: run 2's ingest and its P2P barrier join run 1's TaskGroups
    (the collision; the barrier's group while run 1's batch of it still waits for
    its export). Every task Dask ran is counted once; run 2's trace has every stage
    of the workflow; nothing of run 2 lies in run 1's trace, whose spans all end
    before run 2 began (before: run 2 had no ingest, and its barrier stretched run
    1's shuffle, transform and root into run 2)"""
    pd = pytest.importorskip("pandas")
    dd = pytest.importorskip("dask.dataframe")
    pdf = pd.DataFrame({"k": [i % 7 for i in range(400)], "v": range(400)})
    # Each run's own table to merge with: a task run again (a released input of
    # what is held) counts in each batch it ran in, and this test counts tasks
    right = [dd.from_pandas(pd.DataFrame({"k": range(7), "w": [run] * 7}), npartitions=1)
             for run in range(2)]
    # Run 1's batches still wait for their export when run 2 begins (the default 2 s)
    with otel_cluster({"otel.spans.export-delay": "2s"}, processes=True, n_workers=2) as (
        client, mirrored,
    ):
        held: list = []
        run_1 = shuffling_workflow(client, pdf, right[0], held)
        second_began = time.time()
        run_2 = shuffling_workflow(client, pdf, right[1], held)
        mirrored.by_dask_id(run_2)
        mirrored.by_dask_id(run_1)
        time.sleep(3)  # every batch exported
        ran = dask_tasks_by_group(mirrored.cluster)
        spans = mirrored.spans()
        del held
    assert batch_tasks_by_group(spans) == ran
    assert_span_tree(spans, ends="inside")
    traces = [dask_span_ids(run)[0] for run in (run_1, run_2)]
    late = [s.name for s in spans
            if s.context.trace_id == traces[0] and s.end_time / 1e9 > second_began]
    assert not late, f"run 1's spans end after run 2 began: {late}"
    stages = {"workflow", "ingest", "transform", "shuffle", "merge", "arrays", "erring"}
    assert {s.name for s in spans if s.context.trace_id == traces[1]} >= stages


def test_all_erred_group_given_new_work_is_exported_once_per_batch(cluster):
    client, mirrored = cluster
    with span("A") as a_id:
        bad = client.map(fail, range(2))
        wait(bad)
    a = mirrored.by_dask_id(a_id)
    wait_until(lambda: mirrored.children(a))
    with span("B") as b_id:  # one graph: fail (A's group) and B's own group
        worse = client.compute([dask.delayed(fail)(5), dask.delayed(inc)(1, dask_key_name="inc-b")])
        wait(worse)
    b = mirrored.by_dask_id(b_id)
    groups = [*mirrored.children(a), *wait_until(lambda: len(c := mirrored.children(b)) == 2 and c)]
    groups = [g for g in groups if g.name == "taskgroup/fail"]
    assert [g.attributes["dask.tasks.total"] for g in groups] == [2, 1]
    assert [g.attributes["dask.tasks.erred"] for g in groups] == [2, 1]
    assert all(g.status.status_code is StatusCode.ERROR for g in groups)
    time.sleep(0.5)
    assert len(mirrored.children(a)) == 1 and len(mirrored.children(b)) == 2
    assert_span_tree(mirrored.spans(), ends="inside")


def test_a_workflow_run_again_while_its_groups_live_puts_each_batch_in_its_own_run():
    """Worker processes; the same two-stage workflow run twice in dask_otel.span
    blocks, the first run's results still held (so Dask keeps its TaskGroups,
    whose names the second run's keys share), the second run started after the
    first was exported: every batch lies inside the run it was submitted in"""
    stage = [("collide-load", i) for i in range(4)]
    with otel_cluster(processes=True, n_workers=2) as (client, mirrored):
        held = []
        runs = []
        for run in range(2):
            with dask_otel.span("report") as run_id:
                keys = [(k, v + 4 * run) for k, v in stage]
                loaded = client.map(slow, range(4), delay=0.1, key=keys)
                name = ("first", "second")[run]  # its own group, so Dask makes its span
                held.append(client.submit(total, loaded, key=(f"report-{name}", 0)))
                held[-1].result()
            runs.append(mirrored.by_dask_id(run_id))  # exported before the next run
        wait_until(lambda: len(mirrored.children(runs[1])) == 2)
        for run, name in zip(runs, ("first", "second")):
            names = sorted(g.name for g in mirrored.children(run))
            assert names == ["taskgroup/collide-load", f"taskgroup/report-{name}"]
        assert_span_tree(mirrored.spans(), ends="inside")


def test_a_dataframe_workflow_run_twice_keeps_every_span_inside_its_parent():
    """The user's shape: a dataframe workflow run twice on the same data in two
    dask_otel.span blocks, on worker processes, the first run's result held so that
    Dask still has its TaskGroups when the second starts (same tokens, same
    TaskGroup names): every span received lies inside its parent"""
    pd = pytest.importorskip("pandas")
    dd = pytest.importorskip("dask.dataframe")
    pdf = pd.DataFrame({"k": [i % 7 for i in range(4000)], "v": range(4000)})
    df = dd.from_pandas(pdf, npartitions=8)
    with otel_cluster(processes=True, n_workers=2) as (client, mirrored):
        held, runs = [], []
        for run in range(2):
            with dask_otel.span("report") as run_id:
                shuffled = df.shuffle("k").v
                held.append(client.compute(shuffled.sum() if run == 0 else shuffled.max()))
                held[-1].result()
            runs.append(mirrored.by_dask_id(run_id))
        # its own reduction's group ("max-tree" with dask-expr, "series-max-agg" before)
        wait_until(lambda: any(s.name.startswith("taskgroup/") and "max" in s.name
                               for s in mirrored.children(runs[1])))
        time.sleep(1)  # every later batch exported
        spans = mirrored.spans()
        nodes = assert_span_tree(spans, ends="inside")
        assert len(nodes) == len(spans)


def test_a_span_waits_the_export_delay_after_its_block_exit_whatever_its_groups():
    """otel.spans.export-delay holds for a Dask span itself: its block is left after
    its TaskGroup was exported (the group's own wait long over), and the span is
    still not exported 1.2 s after the exit (workers heartbeat every 0.5 s: the
    metrics wait alone would let it go), then it is, ending at the exit"""
    with otel_cluster({"otel.spans.export-delay": "2s"}) as (client, mirrored):
        with dask_otel.span("late-exit") as sid:
            client.submit(inc, 1, key="late-exit-0").result()
            wait_until(lambda: any(s.name == "taskgroup/late-exit" and s.parent for s in mirrored.spans()))
            exited = time.time()
        time.sleep(1.2)
        _, span_id = dask_span_ids(sid)
        assert not [s for s in mirrored.spans() if s.context.span_id == span_id]
        late = mirrored.by_dask_id(sid)
    assert late.end_time / 1e9 >= exited


def test_requesting_finished_tasks_again_exports_nothing(cluster):
    client, mirrored = cluster
    with span("once") as sid:
        x = client.submit(inc, 1, key="again-1")
        x.result()
    s = mirrored.by_dask_id(sid)
    wait_until(lambda: mirrored.children(s))
    before = len(mirrored.spans())
    client.submit(double, x, key="again2-1").result()  # x is requested as a dependency
    wait_until(lambda: len(mirrored.spans()) >= before + 2)  # the new default span
    time.sleep(0.5)
    assert len(mirrored.children(s)) == 1


# --- sampling (issue 9) ---------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.5, 0.2])
def test_ratio_sampler_keeps_or_drops_whole_traces_and_the_mirror_keeps_nothing(
    monkeypatch, ratio
):
    """A ratio sampler keeps its ratio of Dask traces (200 roots: within 0.15 of
    it, over four standard deviations), each whole or not at all; at 0.2 as well
    as 0.5, where a skewed hash can still keep half"""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", str(ratio))
    n = 200
    with otel_cluster() as (client, mirrored):
        futures, roots = [], []
        for i in range(n):
            with span(f"root {i}") as root_id:
                with span("step"):
                    # every fourth trace has a task that errs
                    futures.append(client.submit(fail if i % 4 == 0 else inc, i, key=f"sampled{i}"))
            roots.append(root_id)
        wait(futures)
        mirror = mirrored.plugin.mirror
        wait_until(
            lambda: mirror.mirrored + mirror.sampled_out == 3 * n
            and not (mirror.ledger.records or mirror.ledger.groups),
            what="every span and group exported or sampled out",
        )
        spans = mirrored.spans()
        by_trace: dict[int, list] = {}
        for s in spans:
            by_trace.setdefault(s.context.trace_id, []).append(s)
        for root_id in roots:
            kept = by_trace.get(dask_span_ids(root_id)[0], [])
            assert len(kept) in (0, 3), [s.name for s in kept]  # root, step, its group
        assert abs(len(by_trace) / n - ratio) <= 0.15, len(by_trace)
        assert len(spans) == mirror.mirrored and mirror.sampled_out == 3 * n - len(spans)
        assert not (mirror.ledger.records or mirror.ledger.groups or mirror.ledger.leaves)


# --- limits (issue 9) ---------------------------------------------------------------


def test_attribute_length_limit_zero_is_the_sdks(monkeypatch):
    oracle.waive("every-task", "the SDK's limit cuts dask.taskgroup.name and dask.tasks.total")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "0")
    with otel_cluster() as (client, mirrored):
        with span("limited") as sid:
            client.submit(inc, 1, key="limited-1").result()
        s = mirrored.by_dask_id(sid)
        assert s.attributes["dask.span.id"] == sid  # an id is never cut
        assert s.attributes["dask.span.name"] == ("",)
        assert s.attributes["dask.tasks.total"] == 1  # numbers are not cut


def test_a_length_limit_cuts_names_and_tags_but_never_ids(monkeypatch):
    """One rule (docs/traces.md): a span name is cut as its tag is, to the
    attribute value length limit; dask.span.id stays whole, on Dask spans,
    TaskGroup spans and task spans"""
    oracle.waive("every-task", "the SDK's length limit cuts dask.taskgroup.name")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "8")
    with otel_cluster({"otel.tasks.spans": True}) as (client, mirrored):
        with span("a long workflow name") as sid:
            client.submit(inc, 1, key="lengthy_prefix-1").result()
        s = mirrored.by_dask_id(sid)
        group, task = wait_until(lambda: len(c := mirrored.children(s)) == 2 and sorted(
            c, key=lambda c: "dask.task.key" in c.attributes))
    assert s.name == "a long w" and s.attributes["dask.span.name"] == ("a long w",)
    # The whole name is cut, its word included
    assert (group.name, task.name) == ("taskgrou", "run/leng")
    assert group.attributes["dask.taskgroup.prefix"] == "lengthy_"
    assert task.attributes["dask.task.key"] == "lengthy_"
    assert group.attributes["dask.span.name"] == ("a long w",)
    for each in (s, group, task):
        assert each.attributes["dask.span.id"] == sid, each.name


def test_links_keep_the_producers_id_whole():
    """Links get their attributes through the same rule as spans"""
    from opentelemetry.sdk.trace import SpanLimits

    from dask_otel.export.sink import bounded_attributes

    producer = "7f1c2b7e-3c1d-4e5f-8a9b-0c1d2e3f4a5b"
    limits = SpanLimits(max_span_attribute_length=8)
    attributes = bounded_attributes(
        {"dask.span.id": producer, "dask.span.name": ("a producer",)},
        limits.max_link_attributes, limits.max_span_attribute_length,
    )
    assert dict(attributes) == {"dask.span.name": ("a produc",), "dask.span.id": producer}


def test_attribute_count_limit_is_the_sdks(monkeypatch):
    oracle.waive("every-task", "the SDK's attribute count limit drops dask.tasks.total")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "3")
    with otel_cluster() as (client, mirrored):
        with span("counted") as sid:
            client.submit(inc, 1, key="counted-1").result()
        s = mirrored.by_dask_id(sid)
        assert len(s.attributes) == 3
        assert s.dropped_attributes > 0
        assert s.attributes["dask.span.id"] == sid  # the ids are dropped last


def exported_after(config: dict, stop_heartbeats: bool, linger: float = 0.0
                   ) -> tuple[float, float, object]:
    """Seconds from a one-task span's result to its TaskGroup's export, and from
    its block's exit (``linger`` seconds later) to its own export; and the span"""
    with otel_cluster(config, n_workers=1) as (client, mirrored):
        client.run(lambda: None)  # the worker is heard of first
        if stop_heartbeats:
            (worker,) = mirrored.cluster.workers.values()
            worker.periodic_callbacks["heartbeat"].stop()
        with dask_otel.span("timed") as sid:
            client.submit(inc, 1, key="timed-0").result()
            finished = time.monotonic()
            time.sleep(linger)
        exited = time.monotonic()
        wait_until(lambda: [s for s in mirrored.spans() if s.name == "taskgroup/timed"],
                   timeout=20, what="the TaskGroup span")
        group = time.monotonic() - finished
        s = mirrored.by_dask_id(sid, timeout=20)
        return group, time.monotonic() - exited, s


def test_a_span_waits_for_the_workers_heartbeats_until_metrics_timeout():
    """Fine metrics travel with heartbeats: a finished TaskGroup batch, and a
    finished span from its block's exit, each wait for every worker to have sent
    one since they ended, and no longer than otel.spans.metrics-timeout. The block
    is left 1.5 s after its task ended, so each wait shows on its own: the span's
    end is not its group's"""
    config = {"otel.spans.metrics-timeout": "3s"}
    _, heard, _ = exported_after(config, stop_heartbeats=False)
    group, unheard, s = exported_after(config, stop_heartbeats=True, linger=1.5)
    assert heard < 2.5, heard  # a heartbeat came (every 0.5 s), after the export delay
    # None came: the timeout, not the export delay, from each one's own end
    assert group >= 3 - 0.3, group
    assert unheard >= 3 - 0.3, unheard
    assert s.name == "timed"


def test_children_are_exported_before_their_parents():
    """So that a parent's end and subtree totals include its children's: in the
    order the SDK receives them, every span comes after all of its children"""
    with otel_cluster() as (client, mirrored):
        with span("root") as root_id:
            for i in range(2):
                with span(f"stage {i}"):
                    client.submit(inc, i, key=f"stage{i}-0").result()
                    with span(f"step {i}"):
                        client.submit(inc, i, key=f"step{i}-0").result()
        mirrored.by_dask_id(root_id)
        order = [s.context.span_id for s in mirrored.spans()]
        spans = mirrored.spans()
    assert len(spans) == 1 + 4 + 4  # Dask spans and their TaskGroups
    for s in spans:
        if s.parent is not None:
            assert order.index(s.context.span_id) < order.index(s.parent.span_id), s.name


def test_times_are_what_dask_records_bounded_by_what_the_scheduler_saw():
    """The mapping rows: a Dask span from Span.enqueued to when the scheduler heard
    of its last task (no earlier than Span.stop as bounded), its TaskGroup from
    TaskGroup.start to TaskGroup.stop, each moved into the scheduler's window:
    sent no earlier than the first processing transition, and no later than the
    last task's completion was heard"""
    with otel_cluster() as (client, mirrored):
        keys = [f"timed-{i}" for i in range(4)]
        with span("timed") as sid:
            client.gather(client.map(inc, range(4), key=keys))
            returned = time.time()
        s = mirrored.by_dask_id(sid)
        scheduler = mirrored.cluster.scheduler
        dask_span = scheduler.extensions["spans"].spans[sid]
        (tg,) = dask_span.groups
        (group,) = mirrored.children(s)
        enqueued, tg_start, tg_stop = dask_span.enqueued, tg.start, tg.stop
        # Dask logs each transition with the scheduler's time, just before the
        # plugin's hook reads the clock
        log = [(start, finish, t) for key, start, finish, _, _, t in scheduler.transition_log
               if key in keys]
    ns = lambda t: int(t * 1e9)  # noqa: E731
    sent = min(t for start, finish, t in log if finish == "processing")
    heard = max(t for start, finish, t in log if start == "processing")
    assert s.start_time == ns(enqueued)
    assert ns(heard) <= s.end_time <= ns(returned)
    # Dask's start, or moved later to when the scheduler sent the first task, or
    # earlier to when it heard of the last (a worker's clock misjudged under load
    # puts TaskGroup.start after that)
    assert group.start_time >= ns(sent)
    assert (group.start_time == ns(max(tg_start, enqueued)) or group.start_time > ns(tg_start)
            or group.start_time >= ns(heard))
    # Dask's stop, or moved earlier to when the scheduler heard of the last task, or
    # later to when it sent the first (a worker's clock misjudged under load puts
    # TaskGroup.stop before that): the hook reads the clock after Dask logs that
    # transition and before Dask logs the next
    first_sent = next(i for i, (_, finish, _) in enumerate(log) if finish == "processing")
    next_logged = log[first_sent + 1][2] if first_sent + 1 < len(log) else heard
    assert group.end_time <= s.end_time
    assert (group.end_time == ns(tg_stop) or group.end_time >= ns(heard)
            or ns(tg_stop) < group.end_time and ns(sent) <= group.end_time <= ns(next_logged))


# --- Causal times: a skewed worker clock (issue 18) ---------------------------------


@pytest.mark.parametrize("skew", [0.0, 0.5, -0.5])
def test_a_skewed_worker_clock_leaves_every_span_inside_the_schedulers_window(skew):
    """A/B: two ``dask worker`` processes whose offset Dask misjudges by ``skew``
    and by its opposite (0: none). Dask's own times then lie outside the caller's
    span; the exported spans, Dask's and the workers' task spans, do not: each
    lies inside its parent, the Dask root inside the caller's span to 1 ms."""
    from distributed import Client

    from dask_otel.client import span as otel_span
    from tests.support.callers import app_tracer
    from tests.support.otlp_receiver import OTLPReceiver
    from tests.support.processes import dask_processes
    from tests.support.span_tree import assert_span_tree

    env = {"DASK_OTEL__TASKS__SPANS": "true"}
    with OTLPReceiver("grpc") as receiver, dask_processes(
        {**receiver.env(), **env}, n_workers=0
    ) as cluster:
        for i, sign in enumerate((1, -1)):
            cluster.worker_args = ("--preload", "tests.support.skewed_worker")
            cluster.add_worker(f"skewed-{i}", env={"DASK_OTEL_TEST_SKEW": str(sign * skew)})
        app_spans, tracer = app_tracer()
        with Client(cluster.address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            with tracer.start_as_current_span("request") as request:
                with otel_span("skewed") as sid:
                    futures = client.map(slow, range(8), delay=0.05, key=[f"sk-{i}" for i in range(8)])
                    client.gather(futures)
            ended = request.end_time
            dask_stop = client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.extensions["spans"].spans[sid].stop
            )
            trace_hex = f"{request.get_span_context().trace_id:032x}"
            receiver.wait_for(lambda r: [s for s in r.spans("skewed") if s.trace_id == trace_hex])
            wait_until(lambda: len([s for s in receiver.spans() if s.trace_id == trace_hex]) >= 10)
            time.sleep(1.0)
            spans = [s for s in receiver.spans() if s.trace_id == trace_hex]
    if skew > 0:  # the skew is real: Dask's own stop lies after the caller's end
        assert dask_stop * 1e9 > ended + 0.2e9
    nodes = assert_span_tree(
        [*spans, *app_spans.get_finished_spans()], one_trace=True, dask_roots=("skewed",)
    )
    names = sorted(n.name for n in nodes.values())
    assert names.count("run/sk") == 8 and names.count("taskgroup/sk") == 1


def test_a_persisted_shuffle_persisted_again_counts_only_what_dask_ran():
    """Worker processes; a dataframe P2P shuffle persisted and held, then persisted
    again in a block: Dask runs nothing of it again (its outputs are in memory; its
    inputs, released, are not recomputed), so no batch of the block counts a task
    and every task is counted once (before: the block's batches counted the
    released inputs as run again)"""
    pd = pytest.importorskip("pandas")
    dd = pytest.importorskip("dask.dataframe")
    pdf = pd.DataFrame({"k": [i % 7 for i in range(400)], "v": range(400)})
    with otel_cluster(processes=True, n_workers=2) as (client, mirrored):
        with span("first") as first_id:
            held = client.persist(dd.from_pandas(pdf, npartitions=2).shuffle("k", shuffle_method="p2p"))
            wait(held)
        first = mirrored.by_dask_id(first_id)
        # its groups' batches ("frompandas" with dask-expr, "from_pandas" in 2024.1.0)
        wait_until(lambda: any("pandas" in s.name for s in mirrored.children(first)))
        with dask_otel.span("again") as again_id:
            again = client.persist(dd.from_pandas(pdf, npartitions=2).shuffle("k", shuffle_method="p2p"))
            wait(again)
        second = mirrored.by_dask_id(again_id)
        time.sleep(1)  # any later batch exported
        spans = mirrored.spans()
        assert [s.name for s in spans if s.parent and s.parent.span_id == second.context.span_id
                and s.name.startswith("taskgroup/")] == []
        assert batch_tasks_by_group(spans) == dask_tasks_by_group(mirrored.cluster)
        del held, again
