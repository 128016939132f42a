"""The OTel context code inside a task runs in (dask_otel.task_context): the task's
Dask span, with the ids the scheduler's mirror exports, on real LocalClusters."""

from __future__ import annotations

import logging
import time

import pytest
from distributed import Worker, span
from opentelemetry import trace

from tests.support.callers import caller_carrier
from tests.support.cluster import dask_span_ids, otel_cluster
from tests.support.otlp_receiver import OTLPReceiver, set_otel_env
from tests.support.processes import dask_processes
from tests.support.tasks import (
    current_ids,
    current_ids_async,
    fail_with_ids,
    global_provider_type,
    ids_and_baggage,
    log_and_trace_in_task,
    root_ids,
    submit_subtask,
    subtask_ids_and_baggage,
    user_work,
)


def expected(root_id: str, own_id: str) -> tuple[int, int, bool]:
    return dask_span_ids(root_id)[0], dask_span_ids(own_id)[1], True


def mirrored_ids(mirrored, dask_id: str) -> tuple[int, int, bool]:
    context = mirrored.by_dask_id(dask_id).context
    return context.trace_id, context.span_id, context.trace_flags.sampled


@pytest.mark.parametrize("processes", [False, True])
def test_task_current_span_is_its_dask_span(processes):
    with otel_cluster(processes=processes) as (client, mirrored):
        with span("workflow") as root_id:
            with span("stage") as stage_id:
                in_stage = client.gather(client.map(current_ids, range(4)))
            in_root = client.submit(root_ids, "root").result()
        assert in_stage == [expected(root_id, stage_id)] * 4
        assert in_root == expected(root_id, root_id)
        # exactly what the scheduler's mirror exports
        assert in_stage[0] == mirrored_ids(mirrored, stage_id)
        assert in_root == mirrored_ids(mirrored, root_id)


@pytest.mark.parametrize("processes", [False, True])
def test_coroutine_task_current_span_is_its_dask_span(processes):
    with otel_cluster(processes=processes) as (client, _):
        with span("async work") as root_id:
            result = client.submit(current_ids_async, 1).result()
        assert result == expected(root_id, root_id)


def test_threads_each_see_their_own_task_span():
    with otel_cluster(n_workers=1, threads_per_worker=4) as (client, _):
        with span("a") as a_id:
            a = client.map(current_ids, range(20), key=[f"a-{i}" for i in range(20)])
        with span("b") as b_id:
            b = client.map(current_ids, range(20), key=[f"b-{i}" for i in range(20)])
        assert client.gather(a) == [expected(a_id, a_id)] * 20
        assert client.gather(b) == [expected(b_id, b_id)] * 20


@pytest.mark.parametrize("processes", [False, True])
def test_worker_client_subtask_runs_in_the_same_dask_span(processes):
    with otel_cluster(processes=processes) as (client, _):
        with span("fan out") as root_id:
            result = client.submit(submit_subtask, 1).result()
        assert result == expected(root_id, root_id)


@pytest.mark.parametrize("sampled", [True, False])
def test_carrier_puts_tasks_in_the_callers_trace_with_its_baggage(sampled):
    import dask

    caller_trace, caller_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    carrier = caller_carrier(caller_trace, caller_span, sampled)
    with otel_cluster(processes=True) as (client, _):
        # as dask_otel.span writes it: the root's block among "entered"
        with span("joined") as root_id, dask.annotate(
            otel={"carrier": carrier, "entered": {root_id: time.time()}}
        ):
            direct = client.submit(ids_and_baggage, 1).result()
            sub = client.submit(subtask_ids_and_baggage, 1).result()
        own = dask_span_ids(root_id)[1]
        # parent-based sampling (the SDK default) follows the caller's decision
        assert direct == ((caller_trace, own, sampled), "acme")
        assert sub == direct


def test_erred_task_ran_in_its_span_and_nothing_leaks():
    with otel_cluster(n_workers=1) as (client, _):
        with span("doomed") as doomed_id:
            future = client.submit(fail_with_ids, 1)
            with pytest.raises(ValueError) as info:
                future.result()
        trace_id, span_id, _ = expected(doomed_id, doomed_id)
        assert str(info.value) == f"{trace_id:032x} {span_id:016x}"
        # the same (only) thread, next task: its own span, not the erred one's
        with span("next") as next_id:
            assert client.submit(current_ids, 2).result() == expected(next_id, next_id)
        # and outside tasks, no context at all
        outside = client.run(lambda: trace.get_current_span().get_span_context().is_valid)
        assert not any(outside.values())


def test_status_reports_the_hook():
    import dask_otel

    with otel_cluster() as (client, _):
        workers = dask_otel.status(client)["workers"]
        assert workers and all(w["task_context"] for w in workers.values())
        # off by default, and no block asked for them: none exported yet
        assert all(w["task_spans"] == 0 for w in workers.values())


class SyncExecuteWorker(Worker):
    """A Worker whose execute is not a coroutine function, as a future distributed
    might have it: the hook's feature detection must refuse it"""

    def execute(self, key, *, stimulus_id):
        return super().execute(key, stimulus_id=stimulus_id)


class Records(logging.Handler):
    """Records logged on one logger (caplog misses records of the worker threads'
    loggers with distributed 2024.1, whose logging setup replaces root handlers)"""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_unhookable_worker_runs_tasks_without_context_and_says_so_once(monkeypatch):
    import dask_otel
    from dask_otel.worker import execute_hook

    monkeypatch.setattr(execute_hook, "_told_unhookable", False)
    handler = Records()
    logger = logging.getLogger("dask_otel")
    # setLevel, not the attribute: it also clears the loggers' cached decisions,
    # which an earlier test in this process may have left at "INFO is off"
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with otel_cluster(worker_class=SyncExecuteWorker) as (client, _):
            with span("plain"):
                results = client.gather(client.map(current_ids, range(4)))
            assert results == [(0, 0, False)] * 4
            workers = dask_otel.status(client)["workers"]
            assert len(workers) == 2
            assert not any(w["task_context"] for w in workers.values())
            assert all(w["error"] is None for w in workers.values())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    told = [r for r in handler.records if "without an OpenTelemetry context" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.INFO
    assert "Worker.execute is not a coroutine function" in told[0].getMessage()


# --- user spans inside tasks: the bridge's TracerProvider as the global one -----

#: Spans over OTLP from the scheduler (the mirror) and the workers, batched fast
OTLP_CONFIG = {"otel.traces.exporter": "otlp", "otel.flush-timeout": "2s"}
FAST_EXPORT_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}


def test_user_span_in_task_is_exported_as_child_of_dask_span(monkeypatch):
    with OTLPReceiver("grpc") as receiver:
        set_otel_env(monkeypatch, {**receiver.env(), **FAST_EXPORT_ENV})
        with otel_cluster(OTLP_CONFIG, processes=True) as (client, _):
            with span("report") as root_id:
                in_user_span = client.submit(user_work, 1).result()
            providers = set(client.run(global_provider_type).values())
            trace_id, dask_span_id, _ = expected(root_id, root_id)
            (user,) = receiver.wait_for(lambda r: r.spans("user work"))
            (dask_span,) = receiver.wait_for(lambda r: r.spans("report"))
    assert providers == {"dask_otel.export.global_provider.TelemetryTracerProvider"}
    assert user.trace_id == dask_span.trace_id == f"{trace_id:032x}"
    assert user.parent_span_id == dask_span.span_id == f"{dask_span_id:016x}"
    assert in_user_span[0] == trace_id and f"{in_user_span[1]:016x}" == user.span_id
    assert user.resource["service.name"] == "dask"
    assert dask_span.start <= user.start <= user.end <= dask_span.end


def test_application_tracer_provider_is_never_replaced(monkeypatch):
    # the workers' "application" configures its own provider through the OTel API's
    # environment variable, before the bridge looks
    monkeypatch.setenv("OTEL_PYTHON_TRACER_PROVIDER", "sdk_tracer_provider")
    with otel_cluster(OTLP_CONFIG | {"otel.traces.exporter": "memory"}, processes=True) as (client, _):
        with span("app owned") as root_id:
            # the app's provider made the user span, in the task's trace
            assert client.submit(user_work, 1).result()[0] == expected(root_id, root_id)[0]
        providers = set(client.run(global_provider_type).values())
    assert providers == {"opentelemetry.sdk.trace.TracerProvider"}


def test_dask_worker_processes_enabled_by_the_preload_alone():
    """`dask scheduler` + `dask worker` processes, the bridge on by the preload
    env var only: a user span and a log line made in a task join the Dask span"""
    with OTLPReceiver("grpc") as receiver:
        env = {**receiver.env(), "OTEL_LOGS_EXPORTER": "otlp", "OTEL_BLRP_SCHEDULE_DELAY": "200"}
        with dask_processes(env, n_workers=1) as cluster, cluster.client() as client:
            with span("cli workflow") as root_id:
                client.submit(log_and_trace_in_task, 1).result()
            (user,) = receiver.wait_for(lambda r: r.spans("user work"))
            (dask_span,) = receiver.wait_for(lambda r: r.spans("cli workflow"))
            (line,) = receiver.wait_for(lambda r: [g for g in r.logs() if g.body == "inside the task"])
    trace_id, span_id, _ = expected(root_id, root_id)
    assert user.trace_id == dask_span.trace_id == line.trace_id == f"{trace_id:032x}"
    assert user.parent_span_id == dask_span.span_id == line.span_id == f"{span_id:016x}"


def test_a_foreign_otel_annotation_changes_nothing():
    """An ``otel`` annotation dask_otel did not write (another library's, or a
    malformed one) is ignored, as the scheduler ignores it: tasks run in their
    Dask span, and nothing is counted as an error"""
    import dask

    import dask_otel

    with otel_cluster(n_workers=1) as (client, _):
        for otel in ("not a dict", {"carrier": 5}, {"entered": {}, "carrier": {"x": 1}}):
            with span("foreign") as root_id, dask.annotate(otel=otel):
                results = client.gather(client.map(current_ids, range(2), key=[f"f{len(str(otel))}-{i}" for i in range(2)]))
            assert results == [expected(root_id, root_id)] * 2, otel
        (status,) = dask_otel.status(client)["workers"].values()
    assert status["task_context_errors"] == 0


def test_a_failure_to_build_a_context_runs_the_task_without_one_logged_once(monkeypatch):
    """Whatever goes wrong in the bridge, the task runs (without context), and the
    worker says so once, then counts"""
    import dask_otel
    from dask_otel.worker.task_context import TaskContexts

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(TaskContexts, "_build", broken)
    handler = Records()
    logger = logging.getLogger("dask_otel")
    logger.addHandler(handler)
    try:
        with otel_cluster(n_workers=1) as (client, _):
            with span("broken"):
                results = client.gather(client.map(current_ids, range(3)))
            (status,) = dask_otel.status(client)["workers"].values()
    finally:
        logger.removeHandler(handler)
    assert results == [(0, 0, False)] * 3
    assert status["task_context_errors"] == 3
    told = [r for r in handler.records if r.levelno >= logging.ERROR]
    assert len(told) == 1

def test_under_a_ratio_sampler_tasks_and_the_mirror_make_the_same_decision(monkeypatch):
    """docs/traces.md, "Sampling": every process asks its own sampler the same
    question and gets the same answer. At ratio 0.5 some traces are kept and some
    dropped; a task's context is sampled exactly in the traces the scheduler
    exported, and only those have task spans."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    n = 24
    with otel_cluster({"otel.tasks.spans": True}) as (client, mirrored):
        in_task = {}
        for i in range(n):
            with span(f"root {i}") as root_id:
                in_task[root_id] = client.submit(current_ids, i, key=f"ids{i}-0").result()
        time.sleep(1.5)  # every root exported or dropped (export delay 200 ms)
        spans = mirrored.spans()
    sampled_in_task = {dask_span_ids(r)[0] for r, (_, _, sampled) in in_task.items() if sampled}
    exported_roots = {s.context.trace_id for s in spans if s.name.startswith("root ")}
    task_spans = {s.context.trace_id for s in spans if "dask.task.key" in s.attributes}
    assert 0 < len(exported_roots) < n, len(exported_roots)
    assert sampled_in_task == exported_roots
    assert task_spans == exported_roots
    # every task ran in its root's trace, kept or not
    assert all(trace_id == dask_span_ids(r)[0] for r, (trace_id, _, _) in in_task.items())
