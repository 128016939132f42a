"""Event loops blocked past Dask's limit, tied to the workflows they hit
(dask_otel.stalls): ``dask scheduler`` and ``dask worker`` processes whose
distributed.admin.tick.limit is set low (Dask reads it once, at import, the bridge
when it starts: only a process started with it has it), a scheduler blocked by
``run_on_scheduler(time.sleep)`` and a worker blocked by a task holding the GIL;
spans and metric points read back from a real OTLP receiver. docs/events.md."""

from __future__ import annotations

import time

import dask_otel
from tests.support.cluster import dask_span_ids
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.tasks import (
    full_collection, hold_gil, inc, make_cycles, nap, sleep_on_loop, slow_inc, wait_for_event,
)

#: Dask's limit in these processes, seconds: a loop blocked longer is a stall.
#: Their ``distributed`` loggers drop Dask's "Event loop was unresponsive" (INFO):
#: the bridge must not hang on it
LIMIT = 1.0
ENV = {"DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": f"{LIMIT}s", "DASK_LOGGING__DISTRIBUTED": "error"}
#: Logs on too: a stall is also a log record (topic dask_otel.event-loop-blocked)
LOGS = {"OTEL_LOGS_EXPORTER": "otlp", "OTEL_BLRP_SCHEDULE_DELAY": "100"}
STACK, GC_SHARE = "code.stacktrace", "dask.event_loop.blocked.gc_share"
#: A block under the limit, though over half of it: no stall
SHORT = 0.6
#: How long the tests block a loop: well past the limit, so that a stall the
#: machine's load makes on its own (past 1 s, and shorter) is told apart
BLOCK = 2.5
#: Dask's tick reads a wall clock: it cannot measure less than the block, but
#: for the clock's own step
CLOCK = 0.01


def blocked_events(receiver: OTLPReceiver, dask_id: str, name: str) -> list[dict]:
    """The dask.event_loop.blocked events of the exported span of ``dask_id``"""
    span_hex = f"{dask_span_ids(dask_id)[1]:016x}"
    (span,) = receiver.wait_for(
        lambda r: [s for s in r.spans(name) if s.span_id == span_hex], timeout=30
    )
    return [a for event, _, a in span.events if event == "dask.event_loop.blocked"]


def blocked_records(receiver: OTLPReceiver, wanted, timeout: float = 60) -> list:
    """The log records of stalls, once one is ``wanted`` (a predicate of its attributes)"""
    def records(r):
        return [g for g in r.logs()
                if g.attributes.get("dask.event.topic") == "dask_otel.event-loop-blocked"]
    return receiver.wait_for(lambda r: [g for g in records(r) if wanted(g.attributes)]
                             and records(r), timeout=timeout)


def trace_hex(dask_id: str) -> str:
    return f"{dask_span_ids(dask_id)[0]:032x}"


def blocked_point(receiver: OTLPReceiver, kind: str, dask_id: str):
    """The first point of the histogram, for ``kind``, whose exemplar is of the
    trace of root Dask span ``dask_id``"""
    trace = trace_hex(dask_id)
    return receiver.wait_for(lambda r: [
        p for p in r.metric_points("dask.event_loop.blocked.duration")
        if p.attributes.get("dask.server.kind") == kind and trace in {t for t, _ in p.exemplars}
    ], timeout=30)[0]


def test_a_blocked_scheduler_is_told_on_the_spans_with_tasks_in_flight():
    """A sleep on the scheduler's loop while workflow "busy" has a task processing
    and workflow "idle" has none (its block still open): busy and its sub-span get
    the event with the sleep's length, idle none; the histogram's scheduler point
    has busy's trace as exemplar. A shorter sleep, under the limit, is no stall. The
    user's function sleeping is on the event's stack (``code.stacktrace``), and on the
    log record of the stall, in busy's trace; the collector took no part of it"""
    with OTLPReceiver("grpc") as receiver, \
            dask_processes({**receiver.env(), **ENV, **LOGS}) as cluster:
        with cluster.client() as client:
            with dask_otel.span("busy") as busy_id, dask_otel.span("step") as step_id:
                running = client.submit(nap, BLOCK + 3)
            with dask_otel.span("idle") as idle_id:
                assert client.submit(inc, 1).result() == 2
                client.run_on_scheduler(sleep_on_loop, SHORT)
                client.run_on_scheduler(sleep_on_loop, BLOCK)
            assert running.result() == BLOCK + 3
            busy = blocked_events(receiver, busy_id, "busy")
            step = blocked_events(receiver, step_id, "step")
            idle = blocked_events(receiver, idle_id, "idle")
            for events in (busy, step):
                (event,) = [a for a in events
                            if a["dask.event_loop.blocked.duration"] >= BLOCK - CLOCK]
                assert event["dask.server.kind"] == "scheduler"
                assert "dask.worker.address" not in event
                assert "in sleep_on_loop\n    time.sleep(seconds)\n" in event[STACK], event[STACK]
                assert event[GC_SHARE] < 0.5
            assert not [a for a in idle if a["dask.event_loop.blocked.duration"] >= BLOCK - CLOCK]
            assert all(a["dask.event_loop.blocked.duration"] > LIMIT for a in busy + step + idle)
            # the receiver's wait, after the spans': the rules above fail on their own
            point = blocked_point(receiver, "scheduler", busy_id)
            assert point.max >= BLOCK - CLOCK
            (record,) = [g for g in blocked_records(receiver, lambda a: STACK in a)
                         if g.attributes["dask.event_loop.blocked.duration"] >= BLOCK - CLOCK]
            assert record.trace_id == trace_hex(busy_id)
            assert record.attributes[STACK] == event[STACK]
            assert record.severity_text == "WARNING"


def test_a_worker_blocked_by_a_task_holding_the_gil_is_told_on_its_spans():
    """A task holding the GIL on worker A inside span "hold" (under root "gil job")
    while workflow "elsewhere" runs a task on worker B: hold and its root get the
    event naming A and the task, elsewhere gets none from A; the histogram's
    worker point has the gil job's trace as exemplar. The block's length is in
    seconds: at least the hold, and less than the test has lasted. The report carries
    its cause: a user's function sleeping on A's loop (``Client.run``) is on the
    stack of the log record of A's stall"""
    began = time.monotonic()
    with OTLPReceiver("grpc") as receiver, \
            dask_processes({**receiver.env(), **ENV, **LOGS}) as cluster:
        with cluster.client() as client:
            a, b = sorted(client.scheduler_info()["workers"])
            with dask_otel.span("elsewhere") as elsewhere_id:
                running = client.submit(nap, BLOCK + 3, workers=[b])
            with dask_otel.span("gil job") as root_id, dask_otel.span("hold") as leaf_id:
                held = client.submit(hold_gil, BLOCK, workers=[a])
                assert held.result() == BLOCK
            assert running.result() == BLOCK + 3
            root = blocked_events(receiver, root_id, "gil job")
            leaf = blocked_events(receiver, leaf_id, "hold")
            elsewhere = blocked_events(receiver, elsewhere_id, "elsewhere")
            for events in (root, leaf):
                (event,) = [e for e in events if e.get("dask.worker.address") == a
                            and e["dask.event_loop.blocked.duration"] >= BLOCK - CLOCK]
                assert event["dask.server.kind"] == "worker"
                assert event["dask.tasks.running"] == (held.key,)
                assert event["dask.tasks.running_count"] == 1
                assert event["dask.event_loop.blocked.duration"] < time.monotonic() - began
            assert not [e for e in elsewhere if e.get("dask.worker.address") == a]
            point = blocked_point(receiver, "worker", root_id)
            assert BLOCK - CLOCK <= point.max < time.monotonic() - began
            assert all(0 <= e[GC_SHARE] < 0.5 for e in root)
            client.run(sleep_on_loop, BLOCK, workers=[a])
            (record, *_) = [g.attributes for g in blocked_records(
                receiver, lambda x: x.get("dask.worker.address") == a and STACK in x)
                if g.attributes.get("dask.worker.address") == a and STACK in g.attributes]
            assert "in sleep_on_loop\n    time.sleep(seconds)\n" in record[STACK], record
            assert record["dask.server.kind"] == "worker" and record[GC_SHARE] < 0.5


#: Pairs of lists in cycles: their full collection blocks the loop past the limit
CYCLES = 5_000_000
#: Tasks of the huge graph: its submission alone blocks the scheduler's loop past
#: the limit (Dask's update_graph builds their states on the loop: 3.5 s here idle on
#: distributed 2024.1 and 2026.x). Not more: a stall of tens of seconds, on a loaded
#: machine, once cost the client its scheduler stream on distributed 2024.1
HUGE = 100_000


def test_a_stall_names_its_cause_a_full_collection_or_a_huge_graph():
    """A full collection of CYCLES cycles run on the scheduler's loop: the collector's
    share is most of the stall, and its stack is the function that asked for it. A
    graph of HUGE tasks submitted (waiting on a task that never ends: none runs):
    the stall's stack is in Dask's update_graph, the collector a small part of it"""
    with OTLPReceiver("grpc") as receiver, \
            dask_processes({**receiver.env(), **ENV, **LOGS}) as cluster:
        with cluster.client() as client:
            assert client.run_on_scheduler(make_cycles, CYCLES) == CYCLES
            # the loop ticks in between: the collection is a stall of its own, not
            # one with the allocation's (whose stack may weigh more on a loaded machine)
            time.sleep(LIMIT)
            assert client.run_on_scheduler(full_collection) >= CYCLES
            records = blocked_records(receiver, lambda a: "full_collection" in a.get(STACK, ""))
            (collection,) = [g.attributes for g in records
                             if "full_collection" in g.attributes.get(STACK, "")]
            assert collection[GC_SHARE] > 0.5, collection
            assert "gc.collect()" in collection[STACK]
            with dask_otel.span("huge"):
                gate = client.submit(wait_for_event, "never")
                client.map(slow_inc, range(HUGE), delay=gate)
            records = blocked_records(receiver, lambda a: "update_graph" in a.get(STACK, ""))
            (graph, *_) = [g.attributes for g in records
                           if "update_graph" in g.attributes.get(STACK, "")]
            assert graph[GC_SHARE] < 0.5, graph
