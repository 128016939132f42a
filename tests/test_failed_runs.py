"""What failed, without task spans (issue 39 item 5), and ``otel.errors.messages:
false`` (item 4): docs/traces.md "Errors", docs/privacy.md."""

from __future__ import annotations

from distributed import span, wait

from tests.support.cluster import otel_cluster, wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import dask_processes
from tests.support.tasks import fail, fail_hard


def exceptions(events) -> list[dict]:
    return [dict(e.attributes) for e in events if e.name == "exception"]


def test_a_failed_stage_and_its_run_say_which_tasks_failed_and_why():
    """Task spans off (the default): the failed TaskGroup's span and the run's root
    each carry an ``exception`` event for the first 3 of its 5 erred tasks, with the
    task's key, its worker, the message and the traceback"""
    with otel_cluster(processes=True, n_workers=2) as (client, mirrored):
        workers = set(client.scheduler_info()["workers"])
        keys = [f"bad-{i}" for i in range(5)]
        with span("nightly") as root_id, span("stage") as stage_id:
            wait(client.map(fail, range(5), key=keys))
        stage = mirrored.by_dask_id(stage_id)
        (group,) = wait_until(lambda: mirrored.children(stage))
        root = mirrored.by_dask_id(root_id)
    assert exceptions(stage.events) == []  # neither the run's root nor a TaskGroup
    for each in (group, root):
        got = exceptions(each.events)
        assert len(got) == 3, each.name  # the first 3 (record.MAX_FAILURE_EVENTS)
        for event in got:
            i = keys.index(event["dask.task.key"])
            assert event["exception.type"] == "ValueError"
            assert event["exception.message"] == f"bad {i}"
            assert 'raise ValueError(f"bad {x}")' in event["exception.stacktrace"]
            assert event["dask.worker.address"] in workers
        assert len({e["dask.task.key"] for e in got}) == 3
        for e in each.events:
            assert each.start_time <= e.timestamp <= each.end_time, each.name


def test_without_messages_no_exception_text_leaves_the_processes():
    """``dask scheduler``/``dask worker`` with DASK_OTEL__ERRORS__MESSAGES=false, task
    spans and logs on: the exception events keep the type and the key; no message or
    traceback in any span, event, status or log record: not the task spans' (the
    workers read the switch), not the TaskGroup's, not worker-fail-hard's"""
    with OTLPReceiver("grpc") as receiver:
        env = {**receiver.env(), "DASK_OTEL__ERRORS__MESSAGES": "false",
               "DASK_OTEL__TASKS__SPANS": "true", "OTEL_LOGS_EXPORTER": "otlp",
               "OTEL_BLRP_SCHEDULE_DELAY": "100", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with dask_processes(env) as cluster, cluster.client() as client:
            with span("quiet") as sid:
                future = client.submit(fail, 7)
                wait(future)
            receiver.wait_for(lambda r: r.spans("quiet") and r.spans("run/fail"), timeout=60)
            doomed = next(iter(client.scheduler_info()["workers"]))
            client.run(fail_hard, workers=[doomed], wait=False)
            receiver.wait_for(lambda r: [g for g in r.logs() if g.attributes.get(
                "dask.event.topic") == "worker-fail-hard"], timeout=60)
        spans = receiver.spans()
        logs = receiver.logs()
    group, task = receiver.spans("taskgroup/fail")[0], receiver.spans("run/fail")[0]
    for each in (group, task, receiver.spans("quiet")[0]):
        (event,) = [attrs for name, _, attrs in each.events if name == "exception"]
        assert event["exception.type"] == "ValueError", each.name
        assert "exception.message" not in event and "exception.stacktrace" not in event
    assert task.attributes["dask.task.key"] == event["dask.task.key"] == str(future.key)
    assert task.status_message == "ValueError"
    # a repr of everything exported: the message ("bad 7") and its traceback are
    # nowhere, Python's log records (distributed's "Compute Failed") as their
    # templates; Dask's fail-hard text ("'NoneType' object ...") is in none of its
    # events (asyncio's own record built its message before the call: as it is)
    exported = repr([(s.name, s.attributes, s.events, s.status_message) for s in spans]
                    + [(g.body, g.attributes) for g in logs])
    dask_events = repr([(g.body, g.attributes) for g in logs if "dask.event.topic" in g.attributes])
    for text, where in (("bad 7", exported), ("raise ValueError", exported),
                        ("NoneType", dask_events)):
        assert text not in where, (text, [x for x in where.split("), (") if text in x])
    assert any(g.body.startswith("Compute Failed") for g in logs)
    assert group.attributes["dask.span.id"] == sid
