"""The span mirror driven directly, as distributed tests its spans extension: a
``gen_cluster`` (scheduler and two workers in this process), the plugin's hooks
wired to a :class:`~dask_otel.spans.SpanMirror` whose spans go to an in-memory
exporter, and polls called by the test. The arithmetic and timing rules, without
waiting for poll intervals or starting processes; the end-to-end shapes are in
test_spans.py and test_wire.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
from dask.utils import key_split
from distributed import span
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time as scheduler_time
from distributed.utils_test import gen_cluster, inc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from dask_otel.config import read_config
from dask_otel.export.sink import SpanSink, span_limits
from dask_otel.scheduler.builder import IDLE_EXIT, SpanBuilder
from dask_otel.scheduler.plugin import OtelSchedulerPlugin
from dask_otel.scheduler.totals import SpanMetrics
from dask_otel.span_context import otel_span_id
from dask_otel.spans import SpanMirror
from tests.support.span_tree import assert_span_tree

NOW = {"export_delay": 0.0, "metrics_timeout": 0.0}


class Exported:
    """The in-memory exporter, read once the mirror's builder thread has handed
    the SDK every span the polls so far queued"""

    def __init__(self, mirror: SpanMirror, exporter: InMemorySpanExporter):
        self.mirror, self.exporter = mirror, exporter

    def get_finished_spans(self):
        self.mirror.builder.drain(5)
        return self.exporter.get_finished_spans()


def mirror_on(scheduler, **config) -> tuple[SpanMirror, Exported]:
    """A mirror of ``scheduler``'s spans, fed by the scheduler plugin's own hooks,
    exporting to memory; ``config`` overrides ``otel.*`` values (OtelConfig fields)"""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    processor = SimpleSpanProcessor(exporter)
    sink = SpanSink(provider, [processor], span_limits())
    mirror = SpanMirror(scheduler, sink, dataclasses.replace(read_config(), **config))
    plugin = OtelSchedulerPlugin()
    plugin.mirror = mirror  # the hooks only; no telemetry, no poller
    scheduler.add_plugin(plugin, name=f"dask-otel-hooks-{id(mirror)}")
    return mirror, Exported(mirror, exporter)


async def poll_until_open(mirror: SpanMirror, open_spans: int = 0, timeout: float = 5) -> None:
    """Poll as the plugin does until at most ``open_spans`` Dask spans are open.
    A task's end, shifted by the worker's clock offset, may lie a hair after the
    scheduler's now: a poll right after it waits for the next."""
    for _ in range(int(timeout / 0.01)):
        mirror.poll()
        if len(mirror.ledger.records) <= open_spans and not mirror.ledger.groups:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still open: {mirror.ledger.records}, {mirror.ledger.groups}")


def fail(x):
    raise ValueError(x)


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


@gen_cluster(client=True)
async def test_each_span_and_group_exported_once_and_then_forgotten(c, s, a, b):
    mirror, exporter = mirror_on(s, **NOW)
    with span("outer") as outer_id:
        with span("inner") as inner_id:
            await c.submit(inc, 1, key="in-inner")
        await c.submit(inc, 2, key="in-outer")
    await poll_until_open(mirror)
    spans = by_name(exporter)
    assert set(spans) == {"outer", "inner", "taskgroup/" + key_split("in-inner"),
                          "taskgroup/" + key_split("in-outer")}
    assert spans["outer"].context.span_id == otel_span_id(outer_id)
    assert spans["inner"].parent.span_id == otel_span_id(outer_id)
    assert spans["inner"].context.span_id == otel_span_id(inner_id)
    assert mirror.mirrored == len(spans) == 4
    assert not (mirror.ledger.records or mirror.ledger.groups or mirror.ledger.leaves)
    mirror.poll()
    assert len(exporter.get_finished_spans()) == 4  # nothing twice
    assert_span_tree(exporter.get_finished_spans(), ends="inside-if-exported-first")


@gen_cluster(client=True)
async def test_a_full_builder_queue_drops_and_counts_what_does_not_fit(c, s, a, b):
    """The builder thread's queue is bounded: the spans of a poll past it are
    dropped and counted, the loop never waits. A queue of one here; a Dask span and
    its three TaskGroups, all finished before the first poll, which hands over
    all four at once (two or more even if the poll's time budget cut it short)"""
    mirror, exporter = mirror_on(s, **NOW)
    mirror.builder.capacity = 1
    with span("full"):
        await c.gather([c.submit(inc, i, key=f"full{i}-0") for i in range(3)])
    await poll_until_open(mirror)
    spans = exporter.get_finished_spans()
    dropped = mirror.builder.dropped
    assert dropped >= 1 and len(spans) + dropped == 4, (len(spans), dropped)
    assert mirror.mirrored == len(spans)


def test_in_a_forked_child_the_builder_builds():
    """os.fork after the builder thread started (idle, waiting for spans): in the
    child that thread is gone; the child's next spans start one there, as the SDK's
    BatchProcessor does, and reach the SDK's exporter"""
    exporter = InMemorySpanExporter()
    sink = SpanSink(TracerProvider(shutdown_on_exit=False), [SimpleSpanProcessor(exporter)],
                    span_limits())
    builder = SpanBuilder(sink)

    def one(name: str) -> list:
        context = SpanContext(1, int.from_bytes(name.encode(), "big"), False,
                              TraceFlags(TraceFlags.SAMPLED))
        return [sink.span(name, context, None, time.time(), time.time(), {})]

    builder.hand_over(one("parent"))
    deadline = time.monotonic() + 20
    while builder.emitted < 1:
        assert time.monotonic() < deadline, "the parent's span was not built"
        time.sleep(0.01)
    assert builder._thread is not None and builder._thread.is_alive()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it built, and leave at once
        try:
            builder.hand_over(one("child"))
            while builder.emitted < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            names = ",".join(s.name for s in exporter.get_finished_spans())
            os.write(write, names.encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as out:
        assert out.read() == "parent,child"
    assert [s.name for s in exporter.get_finished_spans()] == ["parent"]


@gen_cluster(client=True)
async def test_the_builder_queue_empties_as_its_thread_builds(c, s, a, b):
    """The queue's capacity is of spans handed over and not yet built: four here,
    and three workflows one after the other, each a Dask span and its TaskGroup,
    each built before the next is handed over: six spans, none dropped"""
    mirror, exporter = mirror_on(s, **NOW)
    mirror.builder.capacity = 4
    for run in range(3):
        with span(f"run {run}"):
            await c.submit(inc, run, key=f"run{run}-0")
        await poll_until_open(mirror)
        mirror.builder.drain(5)
    assert mirror.builder.dropped == 0
    assert len(exporter.get_finished_spans()) == mirror.mirrored == 6


@gen_cluster(client=True)
async def test_the_builder_thread_ends_when_idle_and_the_next_spans_start_another(c, s, a, b):
    """No thread of the bridge outlives its work, drained by a close or not: idle
    for IDLE_EXIT, the builder thread ends; the next poll's spans start a new one"""
    mirror, exporter = mirror_on(s, **NOW)
    for run in ("first", "second"):
        with span(run):
            await c.submit(inc, 1, key=f"{run}-0")
        await poll_until_open(mirror)
        thread = mirror.builder._thread
        assert thread is not None and thread.is_alive()
        deadline = time.monotonic() + IDLE_EXIT + 10
        while thread.is_alive():  # not drained: it ends on its own
            assert time.monotonic() < deadline, "the builder thread outlived its work"
            await asyncio.sleep(0.05)
        assert run in {s.name for s in exporter.exporter.get_finished_spans()}


@gen_cluster(client=True)
async def test_subtree_totals_sum_the_sub_spans_own_totals_do_not(c, s, a, b):
    mirror, exporter = mirror_on(s, **NOW)
    own_mirror, own_exporter = mirror_on(s, span_totals="own", **NOW)
    with span("pipeline"):
        for step in range(3):
            with span(f"step {step}"):
                await c.gather(c.map(inc, range(4), key=[f"s{step}-{i}" for i in range(4)]))
    await poll_until_open(mirror)
    await poll_until_open(own_mirror)
    subtree, own = by_name(exporter), by_name(own_exporter)
    assert subtree["pipeline"].attributes["dask.tasks.total"] == 12
    assert "dask.tasks.total" not in own["pipeline"].attributes or (
        own["pipeline"].attributes["dask.tasks.total"] == 0
    )
    for step in range(3):
        assert subtree[f"step {step}"].attributes["dask.tasks.total"] == 4
        assert own[f"step {step}"].attributes["dask.tasks.total"] == 4
    duration = sum(subtree[f"step {i}"].attributes["dask.duration"] for i in range(3))
    assert subtree["pipeline"].attributes["dask.duration"] == pytest.approx(duration, rel=1e-9)


@gen_cluster(client=True)
async def test_a_span_waits_for_its_export_delay(c, s, a, b):
    mirror, exporter = mirror_on(s, export_delay=0.5, metrics_timeout=0.0)
    with span("wait"):
        await c.submit(inc, 1, key="wait-task")
    assert not mirror.poll() and not exporter.get_finished_spans()
    assert mirror.ledger.records  # still open, kept
    await asyncio.sleep(0.5)
    await poll_until_open(mirror)
    assert {s.name for s in exporter.get_finished_spans()} == {"wait", "taskgroup/" + key_split("wait-task")}


@gen_cluster(client=True)
async def test_a_span_waits_for_a_heartbeat_until_the_metrics_timeout(c, s, a, b):
    mirror, exporter = mirror_on(s, export_delay=0.0, metrics_timeout=30.0)
    with span("metrics"):
        await c.submit(inc, 1, key="metrics-task")
    await asyncio.sleep(0.05)  # the task's end is past, whatever the clock offset
    for ws in s.workers.values():
        ws.last_seen -= 3600  # the heartbeats that came meanwhile did not happen
    for _ in range(3):
        mirror.poll()
    assert not exporter.get_finished_spans()
    assert mirror.ledger.records and mirror.ledger.groups
    mirror.config = dataclasses.replace(mirror.config, metrics_timeout=0.0)
    await poll_until_open(mirror)
    assert {s.name for s in exporter.get_finished_spans()} == {"metrics", "taskgroup/" + key_split("metrics-task")}


def fail_slowly(x):
    time.sleep(0.5)
    raise ValueError(x)


class Failures(SchedulerPlugin):
    """The run of each erred task as its worker reported it (``startstops``, on
    the scheduler's clock), and when the scheduler heard of the failure (after
    the mirror's hooks: added after them)"""

    def __init__(self):
        self.computes: dict = {}
        self.heard: dict = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "erred":
            self.heard[key] = scheduler_time()
        for startstop in kwargs.get("startstops") or ():
            if finish == "erred" and startstop.get("action") == "compute":
                self.computes[key] = startstop


@gen_cluster(client=True)
async def test_erred_tasks_end_their_group_and_span_when_they_failed(c, s, a, b):
    """Dask records no run time for an erred task (its TaskGroup's stop stays 0):
    the group runs from the task's start to its failure as the worker reported
    them, and its Dask spans end no earlier, not when they are exported"""
    mirror, exporter = mirror_on(s, **NOW)
    failures = Failures()
    s.add_plugin(failures, name="failures")
    with span("outer"):
        with span("failing"):
            future = c.submit(fail_slowly, 1, key="fail-task")
            with pytest.raises(ValueError):
                await future
    await asyncio.sleep(0.5)  # exported well after the failure
    await poll_until_open(mirror)
    spans = by_name(exporter)
    failing, outer = spans["failing"], spans["outer"]
    group = spans["taskgroup/" + key_split("fail-task")]
    for erred in (failing, group, outer):
        assert erred.status.description == "1 tasks erred"
        assert erred.attributes["dask.tasks.erred"] == 1
    compute, heard = failures.computes["fail-task"], failures.heard["fail-task"]
    # the task ran 0.5 s: its start and failure are told apart from each other
    # and from the export, 0.5 s after the scheduler heard of the failure
    assert group.start_time / 1e9 == pytest.approx(compute["start"], abs=0.1)
    assert group.end_time / 1e9 == pytest.approx(compute["stop"], abs=0.1)
    for dask_span in (failing, outer):
        # no earlier than the failure, no later than the scheduler heard of it
        assert group.end_time <= dask_span.end_time <= heard * 1e9
    assert_span_tree(exporter.get_finished_spans(), ends="inside-if-exported-first")


@gen_cluster(client=True)
async def test_flush_exports_what_is_open_as_unfinished(c, s, a, b):
    mirror, exporter = mirror_on(s, export_delay=3600.0)

    async def wait_for_ever():
        await asyncio.sleep(3600)

    with span("running"):
        running = c.submit(wait_for_ever, key="never-ends")
        while not s.tasks.get("never-ends") or s.tasks["never-ends"].state != "processing":
            await asyncio.sleep(0.01)
    mirror.flush()  # the scheduler's release then drains the builder (test_spans.py)
    spans = by_name(exporter)
    assert spans["running"].attributes["dask.span.unfinished"] is True
    assert "taskgroup/" + key_split("never-ends") in spans
    assert not (mirror.ledger.records or mirror.ledger.groups or mirror.ledger.leaves)
    del running


@pytest.mark.parametrize("skew", [1.0, -1.0])
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_task_times_are_bounded_by_what_the_scheduler_saw(c, s, a, skew):
    """A worker whose offset Dask misjudges by ``skew`` seconds reports task times
    that far off; the mirror moves them into the window the scheduler saw: no
    earlier than it sent the first task, no later than it heard of the last"""
    mirror, exporter = mirror_on(s, **NOW)
    a.scheduler_delay = skew  # until the next heartbeat: the tasks take milliseconds
    with span("skewed"):
        before = time.time()
        await c.gather(c.map(inc, range(4), key=[f"skew-{i}" for i in range(4)]))
        after = time.time()
    (tg,) = [tg for tg in s.task_groups.values() if tg.name == "skew"]
    # Dask's own times lie outside, as the worker reported them
    assert tg.stop > after if skew > 0 else tg.start < before
    await poll_until_open(mirror)
    spans = by_name(exporter)
    group, dask_span = spans["taskgroup/skew"], spans["skewed"]
    assert before * 1e9 <= group.start_time <= group.end_time <= after * 1e9
    assert dask_span.start_time <= group.start_time and group.end_time <= dask_span.end_time
    assert dask_span.end_time <= after * 1e9


@gen_cluster(client=True)
async def test_a_span_a_full_queue_drops_still_counts_in_its_parents_subtree(c, s, a, b):
    """A full builder queue drops a span (counted), never its part of its parent's
    subtree: the parent's fine metrics are Dask's for the whole subtree. A queue of
    one; two steps, each with a TaskGroup of its own, finished before one poll: the
    first step's group is kept, the second's group and span are dropped, the first
    step and the parent are kept (their children were)"""
    mirror, exporter = mirror_on(s, **NOW)
    mirror.builder.capacity = 1
    with span("parent") as parent_id:
        for step in ("kept", "dropped"):
            with span(step):
                await c.gather(c.map(inc, range(3), key=[f"{step}-{i}" for i in range(3)]))
    await asyncio.gather(a.heartbeat(), b.heartbeat())  # the fine metrics, to Dask's spans
    dask_parent = s.extensions["spans"].spans[parent_id]
    # Dask's own less its "idle or other spans", which the bridge works out itself
    expected = {k: v for k, v in SpanMetrics.of(dask_parent.cumulative_worker_metrics).total.items()
                if "idle" not in k}
    assert len(expected) >= 2 and all(expected.values()), expected
    await poll_until_open(mirror)
    spans = by_name(exporter)
    assert "dropped" not in spans and mirror.builder.dropped == 2, (set(spans), mirror.builder.dropped)
    got = {k: v for k, v in spans["parent"].attributes.items()
           if k.startswith("dask.metrics.") and "idle" not in k}
    assert got == pytest.approx(expected, rel=1e-9)
    assert spans["parent"].attributes["dask.tasks.total"] == 6
