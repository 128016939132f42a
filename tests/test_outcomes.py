"""Workflow outcomes and removed workers as metrics (dask_otel.scheduler.outcomes):
runs and their durations by workflow name and result, each point with an
exemplar of its run's trace; workers removed by why they left. Real clusters,
spans and metrics read back from a real OTLP receiver."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import dask
import distributed
import pytest
from distributed import Client, Event, span
from opentelemetry.sdk.metrics import MeterProvider
from packaging.version import Version

import dask_otel
from dask_otel.annotation import BLOCK_EXIT
from dask_otel.config import ConfigError, read_config
from dask_otel.scheduler.outcomes import MAX_WORKFLOW_NAMES, OTHER, Outcomes
from tests.support.callers import app_tracer
from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import allocate_past, fail, fail_hard, inc, slow, wait_for_event
from tests.test_metrics import EXEMPLARS_CONFIG, EXEMPLARS_ENV

#: Metrics collected every 300 ms and spans sent every 100 ms, over OTLP
ENV = EXEMPLARS_ENV
#: Spans and metrics to the OTLP receiver, spans exported 100 ms after they finish
CONFIG = {**EXEMPLARS_CONFIG, "otel.flush-timeout": "2s"}
#: The nanny logs worker-restart-memory since distributed 2024.4.2 (dask/distributed#8617)
NANNY_RESTART_EVENT = Version(distributed.__version__) >= Version("2024.4.2")


def runs(receiver: OTLPReceiver) -> dict[tuple[str, str], float]:
    """The latest ``dask.workflow.runs`` value of each (name, result)"""
    out = {}
    for p in receiver.metric_points("dask.workflow.runs"):
        out[p.attributes["dask.workflow.name"], p.attributes["dask.workflow.result"]] = p.value
    return out


def removed(receiver: OTLPReceiver) -> dict[str, float]:
    """The latest ``dask.worker.removed`` value of each reason"""
    return {
        p.attributes["dask.worker.removed.reason"]: p.value
        for p in receiver.metric_points("dask.worker.removed")
    }


def test_an_ok_run_and_an_erred_run_carry_exemplars_of_their_traces(monkeypatch):
    """Worker processes; names matched by otel.metrics.workflows: one run each,
    ok and erred, a duration point each, and every exemplar's trace is the run's
    exported root span's"""
    config = {**CONFIG, "otel.metrics.workflows": ["nightly-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            with span("nightly-etl") as ok_id:
                assert client.submit(inc, 1).result() == 2
            with span("nightly-score") as erred_id, pytest.raises(ValueError):
                client.submit(fail, 1).result()
            receiver.wait_for(
                lambda r: runs(r) == {("nightly-etl", "ok"): 1, ("nightly-score", "erred"): 1},
                timeout=30,
            )
            roots = receiver.wait_for(
                lambda r: {s.name: s for s in r.spans() if s.parent_span_id is None
                           and s.name.startswith("nightly")} if len(
                    {s.name for s in r.spans() if s.parent_span_id is None}) >= 2 else None
            )
    traces = {"nightly-etl": ok_id.replace("-", ""), "nightly-score": erred_id.replace("-", "")}
    assert {name: s.trace_id for name, s in roots.items()} == traces
    assert roots["nightly-score"].status_code == "ERROR"
    for metric in ("dask.workflow.runs", "dask.workflow.duration"):
        points = receiver.metric_points(metric)
        by_name = {p.attributes["dask.workflow.name"]: p for p in points if p.exemplars}
        assert set(by_name) == set(traces), metric
        for name, point in by_name.items():
            assert {t for t, _ in point.exemplars} == {traces[name]}, (metric, name)
            assert {s for _, s in point.exemplars} == {roots[name].span_id}
    (duration,) = {
        p.count for p in receiver.metric_points("dask.workflow.duration")
        if p.attributes["dask.workflow.name"] == "nightly-etl"
    }
    assert duration == 1
    last = [p for p in receiver.metric_points("dask.workflow.duration")
            if p.attributes["dask.workflow.name"] == "nightly-etl"][-1]
    assert last.unit == "s"
    assert 0 < last.value <= roots["nightly-etl"].duration + 1e-6


def test_with_traces_off_runs_and_durations_are_still_recorded(monkeypatch):
    """A Prometheus-only user (OTEL_TRACES_EXPORTER=none), worker processes: an
    ok run whose only task runs 0.4 s in a sub-span, and an erred run, are
    counted, the ok run's duration no shorter than its sub-span's task; no span
    is exported and status() says traces are off"""
    config = {**CONFIG, "otel.traces.exporter": "OTEL_TRACES_EXPORTER",
              "otel.metrics.workflows": ["nightly-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV, "OTEL_TRACES_EXPORTER": "none"})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            with span("nightly-etl"), span("load"):
                client.submit(slow, 1, 0.4).result()
            with span("nightly-score"), pytest.raises(ValueError):
                client.submit(fail, 1).result()
            receiver.wait_for(
                lambda r: runs(r) == {("nightly-etl", "ok"): 1, ("nightly-score", "erred"): 1},
                timeout=30,
            )
            status = dask_otel.status(client)["scheduler"]
    assert (status["traces"], status["metrics"]) == (False, True)
    (etl,) = [p for p in receiver.metric_points("dask.workflow.duration")
              if p.attributes["dask.workflow.name"] == "nightly-etl"][-1:]
    assert etl.count == 1 and etl.value >= 0.4
    assert not receiver.spans()


def test_the_duration_is_the_root_spans_from_the_blocks_entry(monkeypatch):
    """dask.workflow.duration is the root OTel span's duration: from the block's
    entry (0.3 s before its first task) to its end, so no shorter than what the
    client saw inside the block"""
    config = {**CONFIG, "otel.metrics.workflows": ["nightly-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, n_workers=1) as (client, _):
            with dask_otel.span("nightly-etl"):
                inside = time.time()
                time.sleep(0.3)
                client.submit(slow, 1, 0.1).result()
                inside = time.time() - inside
            receiver.wait_for(lambda r: runs(r) == {("nightly-etl", "ok"): 1}, timeout=30)
            (root,) = receiver.wait_for(lambda r: r.spans("nightly-etl"), timeout=30)
    (point,) = receiver.metric_points("dask.workflow.duration")[-1:]
    assert point.count == 1
    assert point.value == pytest.approx(root.duration, abs=1e-5)
    assert point.value >= inside


def test_an_erred_task_in_a_sub_span_errs_the_run_with_own_totals(monkeypatch):
    """otel.spans.totals: own: the root's own span counts no erred task, its run
    is ``erred`` all the same"""
    config = {**CONFIG, "otel.spans.totals": "own", "otel.metrics.workflows": ["nightly-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, n_workers=1) as (client, _):
            with span("nightly-score"):
                client.submit(inc, 1).result()
                with span("step"), pytest.raises(ValueError):
                    client.submit(fail, 1).result()
            receiver.wait_for(lambda r: runs(r) == {("nightly-score", "erred"): 1}, timeout=30)
            (root,) = receiver.wait_for(lambda r: r.spans("nightly-score"), timeout=30)
    assert "dask.tasks.erred" not in root.attributes


def test_a_root_named_by_its_annotation_keeps_its_name_and_others_are_other(monkeypatch):
    """A root whose tasks say ``workflow: True`` in their otel annotation (what
    ``dask_otel.span(..., workflow=True)`` writes) is named; one that does not, and
    matches no pattern, counts as ``other``; work outside any span is a run of
    Dask's ``default`` span"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(CONFIG, n_workers=1) as (client, _):
            with span("adhoc-7f3a"), dask.annotate(otel={"workflow": True}):
                client.submit(inc, 1, key="named-0").result()
            with span("adhoc-9c1e"):
                client.submit(inc, 2, key="unnamed-0").result()
            client.submit(inc, 3, key="spanless-0").result()
            receiver.wait_for(
                lambda r: runs(r) == {
                    ("adhoc-7f3a", "ok"): 1, (OTHER, "ok"): 1, ("default", "ok"): 1,
                },
                timeout=30,
            )


def test_a_client_that_leaves_inside_its_block_cancels_the_run(monkeypatch):
    """The client that opened a dask_otel.span block closes while in it, its task
    still running: the run is ``cancelled``. A run whose future is released in
    its block, which the client then leaves, is ``ok``: Dask does not tell it
    from one that finished"""
    config = {**CONFIG, "otel.metrics.workflows": "hourly-*"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, processes=True, n_workers=1) as (client, mirrored):
            leaving = Client(mirrored.cluster)
            with dask_otel.span("hourly-sync"):
                future = leaving.submit(slow, 1, 3)
                wait_until(lambda: any(leaving.processing().values()))
                leaving.close()
            del future
            receiver.wait_for(lambda r: runs(r) == {("hourly-sync", "cancelled"): 1}, timeout=30)
            with dask_otel.span("hourly-drop"):
                future = client.submit(slow, 2, 3)
                wait_until(lambda: any(client.processing().values()))
                del future
            receiver.wait_for(
                lambda r: runs(r) == {("hourly-sync", "cancelled"): 1, ("hourly-drop", "ok"): 1},
                timeout=30,
            )


@contextmanager
def leaving_client(monkeypatch, config: dict) -> Iterator[tuple]:
    """Worker processes, a second client that will leave them, and the block exits a
    client would send, held back for the test to send: (receiver, client, leaving,
    held, scheduler)"""
    held: list[dict] = []
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, processes=True, n_workers=1) as (client, mirrored):
            leaving = Client(mirrored.cluster)
            monkeypatch.setattr("dask_otel.client._announce_exit", lambda msg, _: held.append(msg))
            yield receiver, client, leaving, held, mirrored.cluster.scheduler


def test_an_exit_another_client_sends_after_the_close_still_cancels(monkeypatch):
    """A client closes inside its block, its task done. The block's exit, as the
    client would have sent it, comes after the scheduler removed the client, sent by
    another client (an exit names its sender): the run is ``cancelled``. Only the
    block's own client, or an old client whose exit names no sender, ends its block
    after its close"""
    config = {**CONFIG, "otel.metrics.workflows": "hourly-*"}
    with leaving_client(monkeypatch, config) as (receiver, client, leaving, held, scheduler):
        with dask_otel.span("hourly-merge"):
            assert leaving.submit(inc, 1).result() == 2
            leaving.close()
            wait_until(lambda: leaving.id not in scheduler.clients, what="the client removed")
        (exit_msg,) = held
        client.log_event(BLOCK_EXIT, {**exit_msg, "client": client.id})
        receiver.wait_for(lambda r: runs(r) == {("hourly-merge", "cancelled"): 1}, timeout=30)


def test_an_exit_heard_just_after_its_client_left_is_no_cancellation(monkeypatch):
    """A client leaves its block and closes at once. Its exit goes out on the
    scheduler's rpc, its close on its own stream: the exit can come second (seen on
    a loaded machine). Here it comes 0.2 s after the scheduler removed the client:
    the run is ``ok``, and its span ends at the exit, not at the close."""
    with leaving_client(monkeypatch, CONFIG) as (receiver, client, leaving, held, scheduler):
        with dask_otel.span("nightly-etl", workflow=True):
            leaving.submit(inc, 1).result()
        closed = time.time()
        leaving.close()
        wait_until(lambda: leaving.id not in scheduler.clients, what="the client removed")
        time.sleep(0.2)
        (exit_msg,) = held
        client.log_event(BLOCK_EXIT, exit_msg)
        receiver.wait_for(lambda r: runs(r) == {("nightly-etl", "ok"): 1}, timeout=30)
        (root,) = receiver.wait_for(lambda r: r.spans("nightly-etl"), timeout=30)
    assert abs(root.end - exit_msg["exited"]) < 1e-6
    assert exit_msg["exited"] < closed


def test_a_run_the_scheduler_closes_under_is_cancelled(monkeypatch):
    """The scheduler shuts down while a run's task is running (its client still
    connected): the scheduler's last flush counts the run ``cancelled``"""
    config = {**CONFIG, "otel.metrics.workflows": ["long-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, n_workers=1) as (client, _):
            with span("long-backfill"):
                future = client.submit(slow, 1, 10)
                wait_until(lambda: any(client.processing().values()))
            client.shutdown()
            del future
        receiver.wait_for(lambda r: runs(r) == {("long-backfill", "cancelled"): 1}, timeout=30)


def test_a_run_whose_trace_is_sampled_out_is_counted_without_an_exemplar(monkeypatch):
    """The sampler keeps no trace: the run is counted all the same, its points
    carry no exemplar"""
    config = {**CONFIG, "otel.metrics.workflows": ["daily-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV, "OTEL_TRACES_SAMPLER": "always_off"})
        with otel_cluster(config, n_workers=1) as (client, _):
            with span("daily-report"):
                client.submit(inc, 1).result()
            receiver.wait_for(lambda r: runs(r) == {("daily-report", "ok"): 1}, timeout=30)
    assert not receiver.spans()
    assert not any(p.exemplars for name in ("dask.workflow.runs", "dask.workflow.duration")
                   for p in receiver.metric_points(name))


def test_workers_removed_count_a_retired_and_a_memory_restarted_worker(monkeypatch):
    """Nannies: a worker retired by the client, a worker its nanny restarts past
    its memory limit (lost without a word before distributed 2024.4.2, whose
    nanny logs no event)"""
    limit = 300 << 20
    config = {**CONFIG, "distributed.scheduler.allowed-failures": 0}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, processes=True, n_workers=2, memory_limit=limit) as (
            client, _,
        ):
            client.wait_for_workers(2)
            retiring = sorted(client.scheduler_info()["workers"])[0]
            client.retire_workers([retiring], close_workers=True)
            receiver.wait_for(lambda r: removed(r) == {"retired": 1}, timeout=30)
            with pytest.raises(distributed.KilledWorker):
                client.submit(allocate_past, limit).result(timeout=60)
            reason = "memory_restart" if NANNY_RESTART_EVENT else "lost"
            receiver.wait_for(lambda r: removed(r) == {"retired": 1, reason: 1}, timeout=30)
    point = receiver.metric_points("dask.worker.removed")[-1]
    assert point.unit == "{worker}"
    assert point.monotonic


def test_workers_that_close_fail_hard_or_die_are_closed_fail_hard_and_lost(monkeypatch):
    """A worker closed by its own ``Worker.close`` says so first (closing-worker):
    ``closed``; one whose ``@fail_hard`` method raised (worker-fail-hard, then its
    close's closing-worker): ``fail_hard``; one whose process ends without a word:
    ``lost``. Counted with remove-worker not among otel.events.topics"""
    config = {**CONFIG, "otel.events.topics": "print"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, processes=True, n_workers=3) as (client, _):
            client.wait_for_workers(3)
            first, second, third = sorted(client.scheduler_info()["workers"])
            client.run(_close_worker, workers=[first])
            receiver.wait_for(lambda r: removed(r) == {"closed": 1}, timeout=30)
            client.run(fail_hard, workers=[second], wait=False)
            receiver.wait_for(lambda r: removed(r) == {"closed": 1, "fail_hard": 1}, timeout=30)
            client.run(_exit_process, workers=[third], wait=False)
            receiver.wait_for(
                lambda r: removed(r) == {"closed": 1, "fail_hard": 1, "lost": 1}, timeout=30
            )


def _close_worker(dask_worker):
    # no nanny restart: the worker's own close, with its closing-worker event
    dask_worker.loop.add_callback(dask_worker.close, nanny=True, reason="closed-by-test")


async def _exit_process():
    import os

    os._exit(1)


def test_prometheus_names_through_a_collector():
    """The names docs/metrics.md gives, as a collector's prometheus exporter names
    the instruments"""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from tests.support.deploy_checks import collector_prometheus_name

    from dask_otel.export.instruments import of_provider
    from dask_otel.stalls import _histogram

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    outcomes = Outcomes(provider, {})  # type: ignore[arg-type]
    outcomes.instruments.runs.add(1)
    outcomes.instruments.duration.record(1.0)
    outcomes.worker_removed("lost")
    of_provider(_histogram, provider).record(2.0)  # dask_otel.stalls' histogram
    (scope,) = reader.get_metrics_data().resource_metrics[0].scope_metrics
    names = set()
    for metric in scope.metrics:
        kind = "histogram" if hasattr(metric.data, "aggregation_temporality") and not hasattr(
            metric.data, "is_monotonic") else "sum"
        names.add(collector_prometheus_name(
            metric.name, metric.unit, kind, getattr(metric.data, "is_monotonic", None)))
    assert names == {
        "dask_workflow_duration_seconds", "dask_workflow_runs_total", "dask_worker_removed_total",
        "dask_event_loop_blocked_duration_seconds",
    }


def test_names_past_the_limit_are_other():
    """At most MAX_WORKFLOW_NAMES names; a name given keeps its series"""
    outcomes = Outcomes(MeterProvider(), {})  # type: ignore[arg-type]
    names = [outcomes.workflow_name(f"etl-{i}", named=True) for i in range(MAX_WORKFLOW_NAMES + 5)]
    assert names[:MAX_WORKFLOW_NAMES] == [f"etl-{i}" for i in range(MAX_WORKFLOW_NAMES)]
    assert set(names[MAX_WORKFLOW_NAMES:]) == {OTHER}
    assert outcomes.workflow_name("etl-0", named=False) == "etl-0"
    assert outcomes.workflow_name("adhoc", named=False) == OTHER


@pytest.mark.parametrize("value", [5, ["nightly-*", 3], [""], True])
def test_bad_workflow_patterns_name_the_key(value):
    with dask.config.set({"otel.metrics.workflows": value}), pytest.raises(
        ConfigError, match="otel.metrics.workflows"
    ):
        read_config()


def test_workflow_patterns_take_a_list_or_a_comma_separated_string():
    with dask.config.set({"otel.metrics.workflows": "nightly-*, hourly-?"}):
        assert read_config().workflows == {"nightly-*", "hourly-?"}
    with dask.config.set({"otel.metrics.workflows": ["etl"]}):
        assert read_config().workflows == {"etl"}


# --- runs watched while they run (issue 39) -------------------------------------------

#: Logs through the bridge, exported 100 ms after they are emitted
LOGS = {"otel.logs.exporter": "otlp"}
FAST_LOGS = {"OTEL_BLRP_SCHEDULE_DELAY": "100"}


def gauge_after(receiver: OTLPReceiver, name: str, after: float, **attributes) -> dict:
    """The values of the first collection of gauge ``name`` after ``after`` whose
    points include ``attributes`` (keyword ``a_b`` means ``a.b``), by
    ``dask.task.state`` (None for ``dask.workflow.active``); {} if none yet"""
    wanted = {k.replace("_", "."): v for k, v in attributes.items()}
    points = [p for p in receiver.metric_points(name) if p.time > after
              and all(p.attributes.get(k) == v for k, v in wanted.items())]
    first = min((p.time for p in points), default=None)
    return {p.attributes.get("dask.task.state"): p.value for p in points if p.time == first}


def started(receiver: OTLPReceiver, dask_id: str | None) -> list:
    """The workflow-started records of root ``dask_id`` (None: all)"""
    return [g for g in receiver.logs() if g.attributes.get("dask.event.topic") == "workflow-started"
            and dask_id in (None, g.attributes.get("dask.span.id"))]


def test_a_run_is_watched_while_it_runs(monkeypatch):
    """Worker processes; a run under a caller's span, held open by tasks of a sub-span
    blocked on a distributed.Event: while it runs, dask.workflow.active is 1 for its
    workflow (a sub-span is no run) and dask.workflow.tasks has the counts Dask's
    Span.states of its root gives then (its whole tree); one "run started" record came
    with the trace and span ids of the root span that arrives at the end (the
    caller's trace). After it, 0s."""
    config = {**CONFIG, **LOGS, "otel.metrics.workflows": ["nightly-*"]}
    _, tracer = app_tracer()
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV, **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            with tracer.start_as_current_span("request") as request, \
                    dask_otel.span("nightly-etl") as run_id:
                assert client.submit(inc, 1).result() == 2
                with span("hold"):
                    held = client.map(wait_for_event, ["hold"] * 3, pure=False)
                    after = client.submit(len, held)

                def states():
                    return client.run_on_scheduler(
                        lambda dask_scheduler, i=run_id: dict(
                            dask_scheduler.extensions["spans"].spans[i].states))

                now = wait_until(lambda: (s := states())["processing"] and s["waiting"] and s, 30)
                time.sleep(0.5)  # the worker took what it takes: nothing moves until the Event
                assert states() == now, now
                read = time.time()
                assert receiver.wait_for(
                    lambda r: gauge_after(r, "dask.workflow.active", read,
                                          dask_workflow_name="nightly-etl")) == {None: 1}
                by_state = receiver.wait_for(
                    lambda r: gauge_after(r, "dask.workflow.tasks", read,
                                          dask_workflow_name="nightly-etl"))
                assert by_state == now and states() == now, (by_state, now)
                (record,) = receiver.wait_for(lambda r: started(r, run_id), timeout=10)
                assert not receiver.spans("nightly-etl")  # the root is still to come
                Event("hold", client=client).set()
                after.result()
            (root,) = receiver.wait_for(lambda r: r.spans("nightly-etl"), timeout=30)
            ended = time.time()
            assert receiver.wait_for(
                lambda r: gauge_after(r, "dask.workflow.active", ended,
                                      dask_workflow_name="nightly-etl")) == {None: 0}
            tasks = receiver.wait_for(lambda r: gauge_after(r, "dask.workflow.tasks", ended,
                                                            dask_workflow_name="nightly-etl"))
    assert (record.trace_id, record.span_id) == (root.trace_id, root.span_id)
    assert root.trace_id == f"{request.get_span_context().trace_id:032x}" != run_id.replace("-", "")
    assert record.body == "run of 'nightly-etl' started" and record.severity_text == "INFO"
    assert len(started(receiver, None)) == 1  # the sub-span opened no run
    assert set(tasks.values()) == {0} and set(tasks) == set(now)


def test_the_open_runs_of_a_workflow_are_summed(monkeypatch):
    """Two runs of one workflow open at once, and one of another: 2 and 1 open runs,
    and each workflow's tasks by state the sum of its runs' Span.states"""
    config = {**CONFIG, "otel.metrics.workflows": ["nightly-*"]}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **ENV})
        with otel_cluster(config, n_workers=1) as (client, _):
            runs_by_name: dict[str, list[str]] = {"nightly-etl": [], "nightly-score": []}
            held = []
            for name, prefix in (("nightly-etl", "a"), ("nightly-etl", "b"), ("nightly-score", "c")):
                with span(name) as run_id:  # a prefix each: no TaskGroup collision
                    held.append(client.submit(wait_for_event, "summed", key=f"hold_{prefix}-0"))
                    runs_by_name[name].append(run_id)

            def states() -> dict[str, dict]:
                def read(dask_scheduler, ids=runs_by_name):
                    spans = dask_scheduler.extensions["spans"].spans
                    if not all(i in spans for run_ids in ids.values() for i in run_ids):
                        return {}  # a graph still on its way
                    return {name: dict(sum((Counter(spans[i].states) for i in run_ids),
                                           Counter())) for name, run_ids in ids.items()}
                return client.run_on_scheduler(read)

            now = wait_until(lambda: (s := states()) and sum(
                s[n].get("processing", 0) + s[n].get("queued", 0) for n in s) == 3 and s, 30)
            time.sleep(0.5)
            assert states() == now, now
            read = time.time()
            for name, n in (("nightly-etl", 2), ("nightly-score", 1)):
                assert receiver.wait_for(lambda r, name=name: gauge_after(
                    r, "dask.workflow.active", read, dask_workflow_name=name)) == {None: n}
                by_state = receiver.wait_for(lambda r, name=name: gauge_after(
                    r, "dask.workflow.tasks", read, dask_workflow_name=name))
                assert {s: v for s, v in by_state.items() if v} == now[name], (name, by_state)
            Event("summed", client=client).set()
            client.gather(held)
