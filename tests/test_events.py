"""Dask's events as OTel log records and span events (dask_otel.scheduler.events):
a worker killed by its task, a worker its nanny restarts over its memory limit,
distributed.print in a task, users' topics; worker processes under nannies, log
records read back from a real OTLP receiver."""

from __future__ import annotations

import time

import distributed
import pytest
from distributed import Event, KilledWorker, span, wait
from packaging.version import Version

from dask_otel.config import ConfigError, read_config
from dask_otel.scheduler.events import (
    DASK_EVENTS,
    MAX_KEYS,
    event_name,
    topics_to_export,
)
from tests.support.cluster import dask_span_ids, otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.tasks import (
    allocate_past,
    exit_once,
    exit_process,
    fail_hard,
    inc,
    print_in_task,
    wait_for_event,
    warn_in_task,
)

#: Log records exported as soon as they are emitted: tests read them while the
#: cluster runs
FAST_LOGS = {"OTEL_BLRP_SCHEDULE_DELAY": "100"}
#: The nanny logs worker-restart-memory since distributed 2024.4.2 (dask/distributed#8617)
NANNY_RESTART_EVENT = Version(distributed.__version__) >= Version("2024.4.2")
LOGS = {"otel.logs.exporter": "otlp", "otel.flush-timeout": "2s"}


def events(receiver: OTLPReceiver, topic: str) -> list:
    return [g for g in receiver.logs() if g.attributes.get("dask.event.topic") == topic]


def ids(dask_id: str) -> tuple[str, str]:
    trace_id, span_id = dask_span_ids(dask_id)
    return f"{trace_id:032x}", f"{span_id:016x}"


def lost_events(span) -> list:
    return [e for e in span.events if e.name == "dask.worker.lost"]


def test_a_task_that_kills_its_worker_once(monkeypatch, tmp_path):
    """The workflow's span gets dask.worker.lost naming the worker, and the
    remove-worker record arrives with the Dask span's ids"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, processes=True, n_workers=2) as (client, mirrored):
            with span("nightly scoring") as sid:
                assert client.submit(exit_once, str(tmp_path / "died"), 7).result() == 7
            exported = mirrored.by_dask_id(sid)
            (record,) = receiver.wait_for(lambda r: events(r, "remove-worker"))
    (lost,) = lost_events(exported)
    address = lost.attributes["dask.worker.address"]
    assert address.startswith("tcp://127.0.0.1:")
    assert lost.attributes["dask.tasks.processing"] == 1
    assert exported.start_time <= lost.timestamp <= exported.end_time
    assert (record.trace_id, record.span_id) == ids(sid)
    assert record.severity_text == "WARNING"
    assert record.attributes["dask.worker.address"] == address
    assert record.attributes["dask.event.processing_tasks_count"] == 1
    assert record.attributes["dask.event.processing_tasks"][0].startswith("exit_once-")
    assert record.attributes["dask.span.tasks.processing"] == 1
    assert record.attributes["dask.span.id"] == sid
    assert record.resource["service.name"] == "dask"


def test_a_worker_over_its_memory_limit_restarted_by_its_nanny(monkeypatch):
    """worker-restart-memory is a WARNING record; the lost worker's span event
    gives that reason; the task, allowed no failure, ends erred with KilledWorker
    and its spans say so. Before distributed 2024.4.2 the nanny logs no event:
    the worker is lost all the same, without a reason"""
    limit = 300 << 20
    config = {**LOGS, "distributed.scheduler.allowed-failures": 0}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=1, memory_limit=limit) as (
            client,
            mirrored,
        ):
            with span("big join") as sid, pytest.raises(KilledWorker):
                client.submit(allocate_past, limit).result(timeout=60)
            exported = mirrored.by_dask_id(sid)
            (removed,) = receiver.wait_for(lambda r: events(r, "remove-worker"), timeout=30)
            if NANNY_RESTART_EVENT:
                (restart,) = receiver.wait_for(
                    lambda r: events(r, "worker-restart-memory"), timeout=30
                )
    assert (removed.trace_id, removed.span_id) == ids(sid)
    (lost,) = lost_events(exported)
    if NANNY_RESTART_EVENT:
        assert restart.severity_text == "WARNING"
        assert restart.attributes["dask.event.rss"] > 0.9 * limit
        assert removed.attributes["dask.worker.lost.reason"] == restart.body
        assert lost.attributes["dask.worker.lost.reason"] == restart.body
    assert exported.attributes["error.type"] == "KilledWorker"
    assert "KilledWorker" in exported.status.description
    (group,) = [s for s in mirrored.spans() if s.name == "taskgroup/allocate_past"]
    assert "KilledWorker, the workers running them died" in group.status.description


def test_a_worker_that_fails_hard_is_removed_for_its_first_reason(monkeypatch):
    """A real ``@fail_hard`` (tests.support.tasks.fail_hard): Dask logs
    worker-fail-hard, then the worker's close logs closing-worker; the first
    reason wins, on the remove-worker record and in dask.worker.removed"""
    from tests.test_outcomes import removed

    config = {**LOGS, "otel.metrics.exporter": "otlp"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {
            **receiver.env(), **FAST_LOGS, "OTEL_METRIC_EXPORT_INTERVAL": "300",
        })
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            (doomed,) = client.scheduler_info()["workers"]
            client.run(fail_hard, workers=[doomed], wait=False)
            (record,) = receiver.wait_for(lambda r: [
                g for g in events(r, "remove-worker")
                if g.attributes["dask.worker.address"] == doomed
            ], timeout=30)
            receiver.wait_for(removed, timeout=30)
    assert removed(receiver) == {"fail_hard": 1}
    (failed,) = events(receiver, "worker-fail-hard")
    (closing,) = [g for g in events(receiver, "closing-worker")
                  if g.attributes["dask.worker.address"] == doomed]
    assert failed.severity_text == "ERROR"
    assert failed.time <= closing.time  # both said why, fail-hard first
    assert "fail-hard" in closing.body
    assert record.attributes["dask.worker.lost.reason"] == failed.body
    assert "NoneType" in failed.body


def test_distributed_print_in_a_task_carries_its_dask_span(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, processes=True, n_workers=1) as (client, _):
            with span("scoring") as sid:
                client.submit(print_in_task, 5).result()
            (record,) = receiver.wait_for(lambda r: events(r, "print"))
    assert record.body == "scored partition 5"
    assert record.severity_text == "INFO"
    assert (record.trace_id, record.span_id) == ids(sid)
    assert record.attributes["dask.worker.address"].startswith("tcp://127.0.0.1:")


def test_a_print_while_tasks_of_two_spans_run_on_its_worker_carries_no_ids(monkeypatch):
    """Which task printed is ambiguous when the worker runs tasks of two Dask spans:
    the record carries no trace, span or dask.span.id (one span's would be a guess)"""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, n_workers=1, threads_per_worker=2) as (client, _):
            with span("holding"):
                held = client.submit(wait_for_event, "two-spans-go", key="held-0")
            wait_until(lambda: client.processing()[next(iter(client.processing()))])
            with span("printing"):
                client.submit(print_in_task, 6, key="printing-0").result()
            (record,) = receiver.wait_for(lambda r: events(r, "print"))
            Event("two-spans-go").set()
            held.result()
    assert record.body == "scored partition 6"
    assert (record.trace_id, record.span_id) == (None, None)
    assert "dask.span.id" not in record.attributes


def test_a_print_in_a_trace_the_sampler_drops_carries_no_ids(monkeypatch):
    """A ratio sampler (0.5): prints in Dask spans whose traces it keeps carry
    their ids, prints in those it drops carry none; batches of spans until there
    is one of each"""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, n_workers=1) as (client, mirrored):
            sids: dict[int, str] = {}
            kept: set[str] = set()
            while (not kept or kept == set(sids.values())) and len(sids) < 40:
                for _ in range(4):
                    with span(f"scoring {len(sids)}") as sid:
                        client.submit(print_in_task, len(sids), key=f"p{len(sids)}-0").result()
                    sids[len(sids)] = sid
                mirror = mirrored.plugin.mirror

                def exported() -> tuple[set[str]] | None:
                    # every span (a root and its TaskGroup's, each run) handed to the SDK
                    # or sampled out, and what was handed exported: the builder is a thread
                    spans = mirrored.spans()
                    if mirror.mirrored + mirror.sampled_out < 2 * len(sids) or (
                            len(spans) < mirror.mirrored):
                        return None
                    return ({s.attributes["dask.span.id"] for s in spans
                             if s.name.startswith("scoring")},)

                (kept,) = wait_until(exported, what="every span exported or sampled out")
            receiver.wait_for(lambda r: len(events(r, "print")) == len(sids))
            assert kept and kept != set(sids.values())
            for record in events(receiver, "print"):
                sid = sids[int(record.body.split()[-1])]
                assert record.attributes["dask.span.id"] == sid
                expected = ids(sid) if sid in kept else (None, None)
                assert (record.trace_id, record.span_id) == expected, (sid in kept)


def test_distributed_warn_in_a_task_is_a_warning_with_its_message(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, n_workers=1) as (client, _):
            with span("skew check") as sid:
                client.submit(warn_in_task, 3).result()
            (record,) = receiver.wait_for(lambda r: events(r, "warn"))
    assert record.severity_text == "WARNING"
    assert record.body == "partition 3 is skewed"
    assert record.attributes["dask.event.category"] == "UserWarning"
    assert (record.trace_id, record.span_id) == ids(sid)


def test_users_topics_are_exported_only_when_listed(monkeypatch):
    config = {**LOGS, "otel.events.topics": "dask, inventory"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=1) as (client, _):
            client.log_event("chatter", {"note": "not listed"})
            client.log_event("inventory", {"sku": "a1", "count": 3})
            (record,) = receiver.wait_for(lambda r: events(r, "inventory"))
            client.log_event("chatter", "still not listed")
            client.submit(print_in_task, 1).result()  # after the chatter, on the same path
            receiver.wait_for(lambda r: events(r, "print"))
    assert record.attributes["dask.event.sku"] == "a1"
    assert record.attributes["dask.event.count"] == 3
    assert record.severity_text == "INFO"
    assert record.trace_id is None
    assert not events(receiver, "chatter")


def test_event_names_and_topics():
    assert topics_to_export(["dask", "mine"]) == {*DASK_EVENTS, "mine"}
    assert event_name("all", {"action": "remove-worker"}) == "remove-worker"
    assert event_name("all", {"action": "add-worker"}) is None
    # the address copy of remove-worker is not counted twice
    assert event_name("tcp://127.0.0.1:1", {"action": "remove-worker"}) is None
    assert event_name("tcp://127.0.0.1:1", {"action": "closing-worker"}) == "closing-worker"
    assert event_name("stealing", ("request", "x")) == "stealing"
    assert "stealing" not in topics_to_export(["dask"])
    assert MAX_KEYS == 20  # docs/events.md says so


@pytest.mark.parametrize("value", [5, ["dask", 3], [""], True])
def test_bad_topics_name_the_key(value):
    import dask

    with dask.config.set({"otel.events.topics": value}), pytest.raises(
        ConfigError, match="otel.events.topics"
    ):
        read_config()



def test_event_records_below_the_logs_level_are_not_exported(monkeypatch, tmp_path):
    """otel.logs.level holds for Dask's events as for Python's log records: at
    WARNING, the closing-worker records (INFO) of a cluster's close are not
    exported, a lost worker with a task processing (WARNING) is; the span event
    is not a log record and stays"""
    config = {**LOGS, "otel.logs.level": "WARNING"}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=2) as (client, mirrored):
            with span("nightly scoring") as sid:
                assert client.submit(exit_once, str(tmp_path / "died"), 7).result() == 7
            exported = mirrored.by_dask_id(sid)
            receiver.wait_for(lambda r: events(r, "remove-worker"))
            # A worker retired on purpose: its closing-worker and remove-worker
            # records are INFO, and would arrive within the export delay (100 ms)
            client.cluster.scale(1)
            wait_until(lambda: len(client.scheduler_info()["workers"]) == 1)
            time.sleep(1.0)
    assert lost_events(exported)
    records = [g for g in receiver.logs() if "dask.event.topic" in g.attributes]
    assert {g.attributes["dask.event.topic"] for g in records} >= {"remove-worker"}
    assert all(g.severity_number >= 13 for g in records), [
        (g.attributes["dask.event.topic"], g.severity_text) for g in records
    ]


@pytest.mark.parametrize(
    "lost, severity", [("scattered", "ERROR"), ("computed", "WARNING"), ("nothing", "INFO")]
)
def test_a_worker_lost_holding_data_is_logged_at_its_severity(monkeypatch, lost, severity):
    """remove-worker of a worker that ran nothing but held 25 keys: scattered data
    (gone for good) is ERROR, computed results (Dask recomputes them) WARNING; the
    record lists the first 20 keys and counts all 25. Nothing was processing, so
    neither severity comes from the processing rule. A worker that held nothing:
    INFO."""
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(LOGS, processes=True, n_workers=2) as (client, _):
            doomed = sorted(client.scheduler_info()["workers"])[0]
            if lost == "nothing":
                held = []
            elif lost == "scattered":
                held = client.scatter(list(range(1000, 1025)), workers=[doomed])
            else:
                held = client.map(inc, range(25), workers=[doomed])
                wait(held)
            client.run(exit_process, workers=[doomed], wait=False)
            records = receiver.wait_for(lambda r: [
                g for g in events(r, "remove-worker")
                if g.attributes["dask.worker.address"] == doomed
            ])
    field = f"dask.event.lost_{lost}_tasks"
    for record in records:
        assert record.severity_text == severity
        assert record.attributes["dask.event.processing_tasks_count"] == 0
        if lost == "nothing":
            assert record.attributes["dask.event.lost_computed_tasks_count"] == 0
            assert record.attributes["dask.event.lost_scattered_tasks_count"] == 0
            continue
        assert record.attributes[f"{field}_count"] == 25
        assert len(record.attributes[field]) == 20
        assert set(record.attributes[field]) <= {str(f.key) for f in held}


def test_a_lost_worker_is_told_to_at_most_16_spans_and_a_span_gets_at_most_16_events(
    monkeypatch,
):
    """docs/events.md: one remove-worker record per Dask span the lost results
    belong to, at most 16; at most 16 dask.worker.lost events per span. 18 workers
    close (Worker.close: Dask's own remove-worker events), the first holding
    results of 17 Dask spans, each of the 17 others one result of one span"""
    config = {**LOGS, "otel.spans.export-delay": "60s"}  # open until the close
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, n_workers=18) as (client, mirrored):
            first, *others = sorted(client.scheduler_info()["workers"])
            held = []
            for i in range(17):
                with span(f"part {i}"):
                    held.append(client.submit(inc, i, key=f"part{i}-0", workers=[first]))
            with span("shared"):
                held += [client.submit(inc, i, key=f"shared-{i}", workers=[w])
                         for i, w in enumerate(others)]
            wait(held)
            client.run(_close_itself, workers=[first, *others], wait=False)
            receiver.wait_for(lambda r: len(events(r, "remove-worker")) >= 16 + 17)
            time.sleep(0.3)
        spans = {s.name: s for s in mirrored.spans()}
    one_worker = [g for g in events(receiver, "remove-worker")
                  if g.attributes["dask.worker.address"] == first]
    assert len(one_worker) == 16
    assert len({g.attributes["dask.span.id"] for g in one_worker}) == 16
    assert all(g.attributes["dask.event.lost_computed_tasks_count"] == 17 for g in one_worker)
    assert len(lost_events(spans["shared"])) == 16


# --- event names and the worker address (issue 25 items 4 and 6) ---------------------


def named_records(receiver: OTLPReceiver) -> list[tuple[str, dict]]:
    """``(event_name, attributes)`` of every event record received (the
    ``dask_otel.events`` logger's), as sent"""
    from tests.support.otlp_receiver import decode_attributes

    return [
        (record.event_name, decode_attributes(record.attributes))
        for signal, request in receiver.raw_requests if signal == "logs"
        for resource_logs in request.resource_logs
        for scope_logs in resource_logs.scope_logs if scope_logs.scope.name == "dask_otel.events"
        for record in scope_logs.log_records
    ]


async def _close_itself(dask_worker):
    dask_worker.loop.add_callback(dask_worker.close, nanny=True, reason="closed-by-test")


def test_every_dask_event_record_has_its_fixed_name_and_its_workers_address(monkeypatch):
    """Worker processes under nannies: print, warn, a user's topic, a worker
    restarted over its memory limit, a retired worker and one that closes itself.
    Every record carries the event_name of its topic (docs/events.md), with no
    dynamic value in it, and each of Dask's records the worker's address"""
    from dask_otel.scheduler.events import USER_EVENT

    limit = 300 << 20
    config = {**LOGS, "otel.events.topics": "dask, inventory",
              "distributed.scheduler.allowed-failures": 0}
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_LOGS})
        with otel_cluster(config, processes=True, n_workers=3, memory_limit=limit) as (
            client, _,
        ):
            client.wait_for_workers(3)
            client.submit(print_in_task, 1).result()
            client.submit(warn_in_task, 2).result()
            client.log_event("inventory", {"sku": "a1"})
            with pytest.raises(KilledWorker):
                client.submit(allocate_past, limit).result(timeout=60)
            workers = sorted(client.scheduler_info()["workers"])
            client.retire_workers(workers[:1], close_workers=True)
            client.run(_close_itself, workers=workers[1:2], wait=False)
            wanted = {"print", "warn", "inventory", "remove-worker", "closing-worker"}
            if NANNY_RESTART_EVENT:
                wanted.add("worker-restart-memory")
            receiver.wait_for(
                lambda r: wanted <= {a.get("dask.event.topic") for _, a in named_records(r)}
                and len(events(r, "remove-worker")) >= 3,
                timeout=30,
            )
    records = named_records(receiver)
    assert {a["dask.event.topic"] for _, a in records} >= wanted
    for name, attributes in records:
        topic = attributes["dask.event.topic"]
        row = DASK_EVENTS.get(topic)
        assert name == (row.event_name if row else USER_EVENT), (topic, name)
        if topic not in ("inventory", "workflow-started"):  # no worker concerned
            assert attributes["dask.worker.address"].startswith("tcp://127.0.0.1:"), topic
    assert "dask.worker.address" not in dict(records)[USER_EVENT]


def test_docs_table_is_the_code_table():
    """docs/events.md's table of events gives each of Dask's events its event_name
    and its severity (remove-worker's, raised by what the worker held, from INFO)"""
    import logging
    import re
    from pathlib import Path

    from dask_otel.scheduler.events import USER_EVENT

    text = (Path(__file__).parent.parent / "docs" / "events.md").read_text()
    rows = re.findall(r"^\| `([\w.-]+)` \| `([\w.]+)` \| [^|]+ \| ([^|]+) \|", text, re.M)
    assert {name: event for name, event, _ in rows} == {
        name: row.event_name for name, row in DASK_EVENTS.items()
    }
    for name, _, severity in rows:
        level = logging.getLevelName(DASK_EVENTS[name].severity)
        assert severity.strip().endswith(level), (name, severity)
    assert f"`{USER_EVENT}`" in text
