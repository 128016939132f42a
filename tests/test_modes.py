"""Modes, combined: every capability users read about, in each way to switch the
bridge on and to configure it, with each set of signals users run, on real
``dask scheduler``/``dask worker`` processes and a real OTLP receiver.

The factors:

- **switch**: the preload key (``DASK_DISTRIBUTED__SCHEDULER__PRELOAD``),
  ``dask_otel.instrument(client)`` on a cluster started without it, or
  ``opentelemetry-instrument`` (the ``dask`` instrumentor, no dask config);
- **config**: the standard ``OTEL_*`` variables, or ``OTEL_CONFIG_FILE`` (with
  ``OTEL_*`` variables set to values the file must override: a wrong endpoint,
  a wrong service name, export intervals of a minute);
- **signals**: traces only, metrics only, logs only, or all three;
- **messages**: ``otel.errors.messages`` true (the default) or false, set as the
  cell's config says: a ``DASK_OTEL__*`` variable, or a dask config file
  (``DASK_CONFIG``) beside ``OTEL_CONFIG_FILE``.

:data:`CELLS` is a covering array of strength 2: every pair of levels of two
factors is in some cell (12 cells, not the 48 of the full product;
``test_the_cells_cover_every_pair`` checks it). One cluster per cell serves every
capability (:data:`CAPABILITIES`): where the cell's signals carry it, it must work
as the README and docs/ say; where they do not, nothing of it may arrive and
``status()`` must say the signal is off. Each cell reports every capability that
failed, not only the first.

The outage policy and its recovery run last in every cell: the receiver goes
away, a workflow and a log line are dropped, one WARNING per signal names the
outage (the SDK's own per-retry lines held back), and once the receiver is back
data flows again within :data:`RECOVERY` seconds (docs/deploy.md, "When
telemetry fails": one probe per export interval).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from distributed import Client, Event, span, wait

import dask_otel
from dask_otel.attributes import WORKER_ADDRESS
from dask_otel.stalls import GC_SHARE, STALL_DURATION, STALL_EVENT, STALL_TOPIC
from tests.support import oracle
from tests.support.cluster import wait_until
from tests.support.otlp_receiver import OTLPReceiver
from tests.support.processes import FAST_ENV, PRELOAD_ENV, DaskProcesses
from tests.support.tasks import (
    double, fail, inc, log_in_task, make_chunk, sleep_on_loop, wait_for_event,
)

SWITCHES = ("preload", "client", "zero-code")
CONFIGS = ("env", "file")
MESSAGES = (True, False)
SIGNALS = {
    "traces": ("traces",),
    "metrics": ("metrics",),
    "logs": ("logs",),
    "all": ("traces", "metrics", "logs"),
}


@dataclass(frozen=True)
class Cell:
    switch: str
    config: str
    signals: str
    messages: bool = True  # otel.errors.messages

    @property
    def exported(self) -> tuple[str, ...]:
        return SIGNALS[self.signals]

    def __str__(self) -> str:
        return f"{self.switch}-{self.config}-{self.signals}" + ("" if self.messages else "-quiet")


#: A covering array of strength 2 over (switch, config, signals, messages): each
#: switch meets each signal set once, and each switch and each signal set meets
#: both configs and both values of otel.errors.messages
CELLS = [
    Cell("preload", "env", "traces"),
    Cell("preload", "file", "metrics"),
    Cell("preload", "env", "logs", messages=False),
    Cell("preload", "file", "all", messages=False),
    Cell("client", "file", "traces", messages=False),
    Cell("client", "env", "metrics", messages=False),
    Cell("client", "file", "logs"),
    Cell("client", "env", "all"),
    Cell("zero-code", "env", "traces", messages=False),
    Cell("zero-code", "file", "metrics"),
    Cell("zero-code", "file", "logs", messages=False),
    Cell("zero-code", "env", "all"),
]

#: What each capability needs exported to apply (README, docs/traces.md,
#: docs/metrics.md, docs/logs.md, docs/events.md, docs/deploy.md)
CAPABILITIES = {
    "mirrored spans": "traces",
    "task spans": "traces",
    "per-workflow controls": "traces",
    "fine metrics": "metrics",
    "spill": "metrics",
    "Dask's families": "metrics",
    "workflow outcomes": "metrics",
    "open runs": "metrics",
    "removed workers": "metrics",
    "Dask's log lines and task logs": "logs",
    "events": "logs",
    "run started": "logs",
    "stalls on spans": "traces",
    "stall histogram": "metrics",
    "stall record": "logs",
    "failed runs": "traces",
    "failed tasks' log lines": "logs",
}

#: Seconds within which data flows again once the collector is back: one probe per
#: export interval (200 ms for spans and logs, 500 ms for metrics here), and gRPC's
#: reconnection, with room for a loaded machine. The SDK's own retries (a backoff
#: up to 32 s) or an interval of OTEL_* instead of the file's (60 s) would not fit.
RECOVERY = 15

#: The workflow every cell runs: a named workflow whose block asks for its task spans
WORKFLOW = "modes-run"
#: ... and a sibling that asks for nothing (otel.tasks.spans stays false)
PLAIN = "modes-plain"
#: ... and a run whose tasks all fail (ValueError("bad <i>")), keyed FAILED_KEYS
#: (their TaskGroup: taskgroup/modes-bad)
FAILED = "modes-failed"
FAILED_KEYS = [f"modes-bad-{i}" for i in range(5)]
#: Dask's tick limit in the cells' processes (docs/events.md "Blocked event
#: loops"), and how long WORKFLOW blocks a worker's loop (a user's function given
#: to ``Client.run``) while one of its tasks runs there: a stall, told on its spans,
#: in a log record and the histogram, whose stack names the function
TICK_LIMIT, BLOCK, CLOCK = 1.0, 2.5, 0.01
STALL_STACK = "in sleep_on_loop\n    time.sleep(seconds)\n"
#: The service name the cell's configuration gives (the file's, or OTEL_SERVICE_NAME)
SERVICE = {"env": "modes-env", "file": "modes-file"}
#: What the variables say in file mode, which the file must override: an endpoint
#: nothing listens on, another service name, export intervals of a minute
OVERRIDDEN_BY_THE_FILE = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    "OTEL_EXPORTER_OTLP_INSECURE": "true",
    "OTEL_SERVICE_NAME": "from-the-variables",
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_LOGS_EXPORTER": "otlp",
    "OTEL_BSP_SCHEDULE_DELAY": "60000",
    "OTEL_BLRP_SCHEDULE_DELAY": "60000",
    "OTEL_METRIC_EXPORT_INTERVAL": "60000",
}
#: Workers spill past 10 MB of data (memory limit 100 MB); the memory monitor's
#: thresholds are off, so that a worker process's own size does not pause it
SPILL_ENV = {
    "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "0.1",
    "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE": "False",
}
WORKER_ARGS = ("--memory-limit", "100MB")
#: What the SDK's OTLP exporters log per failed export and per retry: the bridge
#: holds them back and logs one WARNING per outage instead (docs/deploy.md)
SDK_EXPORT_LINES = re.compile(r"encountered while exporting|Failed to export")


def test_the_cells_cover_every_pair():
    levels = {"switch": SWITCHES, "config": CONFIGS, "signals": tuple(SIGNALS),
              "messages": MESSAGES}
    for a, b in itertools.combinations(levels, 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in CELLS}
        assert seen == set(itertools.product(levels[a], levels[b])), (a, b)


# --- the cluster of a cell -----------------------------------------------------------


def config_file(path: Path, receiver: OTLPReceiver, signals: tuple[str, ...]) -> str:
    """A declarative configuration file exporting ``signals`` to ``receiver``, fast"""
    exporter = f'exporter: {{otlp_grpc: {{endpoint: "{receiver.endpoint}"}}}}'
    batch = f"  processors:\n    - batch: {{schedule_delay: 200, {exporter}}}\n"
    text = (
        'file_format: "1.1"\n'
        f"resource:\n  attributes:\n    - {{name: service.name, value: {SERVICE['file']}}}\n"
    )
    if "traces" in signals:
        text += f"tracer_provider:\n{batch}"
    if "metrics" in signals:
        text += f"meter_provider:\n  readers:\n    - periodic: {{interval: 500, {exporter}}}\n"
    if "logs" in signals:
        text += f"logger_provider:\n{batch}"
    path.write_text(text)
    return str(path)


def cell_env(cell: Cell, receiver: OTLPReceiver, tmp_path: Path) -> dict[str, str]:
    env = {
        **FAST_ENV,
        **SPILL_ENV,
        "OTEL_BLRP_SCHEDULE_DELAY": "200",
        "DASK_OTEL__METRICS__DASK": "true",
        # what docs/zero-code.md advises for Dask servers (only read there)
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "click,asyncio,tornado",
    }
    if cell.switch == "preload":
        env.update(PRELOAD_ENV)
    if cell.config == "env":
        env.update(receiver.env())
        env["OTEL_SERVICE_NAME"] = SERVICE["env"]
        for signal, variable in (("traces", "OTEL_TRACES_EXPORTER"),
                                 ("metrics", "OTEL_METRICS_EXPORTER"),
                                 ("logs", "OTEL_LOGS_EXPORTER")):
            env[variable] = "otlp" if signal in cell.exported else "none"
    else:
        env.update(OVERRIDDEN_BY_THE_FILE)
        env["OTEL_CONFIG_FILE"] = config_file(tmp_path / "otel.yaml", receiver, cell.exported)
    # the tick limit and otel.errors.messages: variables, or a dask config file
    dask_keys = {"DISTRIBUTED__ADMIN__TICK__LIMIT": f"{TICK_LIMIT}s",
                 "OTEL__ERRORS__MESSAGES": str(cell.messages).lower()}
    if cell.config == "env":
        env.update({f"DASK_{k}": v for k, v in dask_keys.items()})
    else:
        (tmp_path / "dask").mkdir()
        (tmp_path / "dask" / "dask.yaml").write_text(
            f"distributed: {{admin: {{tick: {{limit: {TICK_LIMIT}s}}}}}}\n"
            f"otel: {{errors: {{messages: {str(cell.messages).lower()}}}}}\n")
        env["DASK_CONFIG"] = str(tmp_path / "dask")
    return env


class CellProcesses(DaskProcesses):
    """DaskProcesses with only the cell's OTEL_* and DASK_* variables (none of the
    test process's), under ``opentelemetry-instrument`` for zero-code"""

    def __init__(self, cell: Cell, env: dict[str, str]):
        super().__init__(env, n_workers=2, worker_args=WORKER_ARGS)
        self.env = {
            k: v for k, v in self.env.items()
            if not k.startswith(("OTEL_", "DASK_")) or k in env
        }
        self.zero_code = cell.switch == "zero-code"

    def _spawn(self, name, cmd):
        if self.zero_code:
            from tests.test_instrumentor import OPENTELEMETRY_INSTRUMENT

            cmd = [*OPENTELEMETRY_INSTRUMENT, *cmd]
        return super()._spawn(name, cmd)


@dataclass
class Ran:
    """What a cell's workload did, for the checks to compare with what arrived"""

    run: str  # the Dask span id of WORKFLOW
    plain: str  # ... of PLAIN
    failed: str  # ... of FAILED
    spiller: str  # the worker that spilled
    retired: str  # the worker retired
    spilled: int  # bytes the spiller's SpillBuffer wrote to disk
    scheduler_pid: int
    status: dict
    chunks: list  # the spilled data, held until the checks are done


def run_workload(client: Client) -> Ran:
    spiller, retired = sorted(client.scheduler_info()["workers"])
    with dask_otel.span(WORKFLOW, workflow=True, tasks={"spans": True}) as run:
        with span("load"):
            assert client.gather(client.map(log_in_task, range(2))) == [0, 1]
        # 16 MB on one worker whose target is 10 MB
        chunks = client.map(make_chunk, range(4), workers=[spiller])
        wait(chunks)
        # the run stays open (its block) over two metric collections, and stalls
        # the retired worker's loop while its task runs there
        stall(client, retired)
    with dask_otel.span(PLAIN) as plain:
        assert client.submit(double, 1).result() == 2
    with dask_otel.span(FAILED) as failed:
        wait(client.map(fail, range(len(FAILED_KEYS)), key=FAILED_KEYS))
    spilled = client.run(
        lambda dask_worker: dask_worker.data.spilled_total.disk, workers=[spiller]
    )[spiller]
    client.run_on_scheduler(
        lambda: logging.getLogger("distributed.scheduler").warning("from the scheduler")
    )
    client.retire_workers([retired])
    wait_until(lambda: client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.workers))
               == 1, 30, "the retirement")
    return Ran(run, plain, failed, spiller, retired, spilled,
               client.run_on_scheduler(os.getpid), dask_otel.status(client), chunks)


def stall(client: Client, worker: str) -> None:
    """Block ``worker``'s loop for BLOCK seconds while a task runs there"""
    gate = client.submit(wait_for_event, "modes-stall", workers=[worker])
    wait_until(lambda: client.run(lambda dask_worker: len(dask_worker.state.executing),
                                  workers=[worker])[worker] == 1, 30, "the task's start")
    client.run(sleep_on_loop, BLOCK, workers=[worker])
    Event("modes-stall", client=client).set()
    assert gate.result() == "modes-stall"


# --- the capabilities ----------------------------------------------------------------


def hex_of(dask_id: str) -> tuple[str, str]:
    """(trace id, span id) in hex of the span mirroring a root Dask span"""
    trace_id = dask_id.replace("-", "")
    return trace_id, trace_id[16:]


def mirrored_spans(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    trace_id, span_id = hex_of(ran.run)
    root = r.wait_for(lambda r: [s for s in r.spans(WORKFLOW) if s.span_id == span_id])[0]
    assert root.trace_id == trace_id and root.parent_span_id is None
    (load,) = r.wait_for(lambda r: r.spans("load"))
    assert load.parent_span_id == span_id and load.trace_id == trace_id
    assert root.resource["service.name"] == SERVICE[cell.config], root.resource


def task_spans(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    (load,) = r.wait_for(lambda r: r.spans("load"))
    tasks = r.wait_for(lambda r: len(s := task_spans_of(r, "run/log_in_task")) == 2 and s)
    for task in tasks:
        assert task.parent_span_id == load.span_id and task.trace_id == load.trace_id
        assert task.resource["process.pid"] != ran.scheduler_pid  # from the workers
        assert task.resource["service.name"] == SERVICE[cell.config], task.resource


def task_spans_of(r: OTLPReceiver, prefix: str) -> list:
    return [s for s in r.spans(prefix) if "dask.task.key" in s.attributes]


def per_workflow_controls(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """The block's ``tasks={"spans": True}`` exported its tasks (above) while the
    workers' otel.tasks.spans is false; its sibling's tasks are not exported"""
    r.wait_for(lambda r: task_spans_of(r, "run/make_chunk"))
    # the sibling's TaskGroup span arrived (so its tasks were done long before)
    (group,) = r.wait_for(lambda r: r.spans("taskgroup/double"))
    assert group.trace_id == hex_of(ran.plain)[0]
    assert task_spans_of(r, "run/double") == []


def latest(r: OTLPReceiver, name: str, **attributes) -> float | None:
    """The value of the newest point of ``name`` whose attributes include
    ``attributes`` (keyword ``a_b`` means ``a.b``)"""
    wanted = {k.replace("_", "."): v for k, v in attributes.items()}
    points = [p for p in r.metric_points(name)
              if all(p.attributes.get(k) == v for k, v in wanted.items())]
    return points[-1].value if points else None


def fine_metrics(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    r.wait_for(lambda r: (latest(r, "dask.activity.time", dask_task_prefix="log_in_task",
                                 dask_activity_name="thread-cpu") or 0) > 0)
    point = r.metric_points("dask.activity.time")[-1]
    assert point.resource["service.name"] == SERVICE[cell.config], point.resource


def spill(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    assert ran.spilled > 0
    r.wait_for(lambda r: latest(r, "dask.spill.disk.size",
                                dask_worker_address=ran.spiller) == ran.spilled)


def dask_families(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    # the scheduler's and a worker's, under Dask's names
    r.wait_for(lambda r: r.metric_points("dask.scheduler.tasks"))
    r.wait_for(lambda r: latest(r, "dask.worker.threads", dask_worker_address=ran.spiller) == 1)


def workflow_outcomes(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    r.wait_for(lambda r: latest(r, "dask.workflow.runs", dask_workflow_name=WORKFLOW,
                                dask_workflow_result="ok") == 1, timeout=20)
    r.wait_for(lambda r: latest(r, "dask.workflow.runs", dask_workflow_name="other",
                                dask_workflow_result="ok") == 1, timeout=5)


def open_runs(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """The run was seen open while its block was, then not"""
    def active(r: OTLPReceiver) -> list:
        return [p.value for p in r.metric_points("dask.workflow.active")
                if p.attributes.get("dask.workflow.name") == WORKFLOW]

    r.wait_for(lambda r: 1 in active(r) and active(r)[-1] == 0, timeout=20)
    states = {p.attributes["dask.task.state"] for p in r.metric_points("dask.workflow.tasks")
              if p.attributes.get("dask.workflow.name") == WORKFLOW}
    assert {"memory", "processing", "released"} <= states, states


def run_started(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """A record when the run opened, in its trace where traces are on"""
    (record,) = r.wait_for(lambda r: [x for x in r.logs()
                                      if x.attributes.get("dask.event.topic") == "workflow-started"
                                      and x.attributes.get("dask.span.id") == ran.run])
    ids = hex_of(ran.run) if "traces" in cell.exported else (None, None)
    assert (record.trace_id, record.span_id) == ids, record


def is_the_stall(attributes, ran: Ran) -> bool:
    return (attributes.get(WORKER_ADDRESS) == ran.retired
            and attributes.get(STALL_DURATION, 0) >= BLOCK - CLOCK)


def stalls_on_spans(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """The worker's stall on the run's root, with its stack and its collector's share"""
    span_id = hex_of(ran.run)[1]
    root = r.wait_for(lambda r: [s for s in r.spans(WORKFLOW) if s.span_id == span_id])[0]
    stalls = [a for name, _, a in root.events if name == STALL_EVENT and is_the_stall(a, ran)]
    # (any of them: the machine's load may block that loop as long, though hardly)
    assert any(a["dask.server.kind"] == "worker" and a["dask.tasks.running_count"] == 1
               and STALL_STACK in a.get("code.stacktrace", "") and 0 <= a.get(GC_SHARE, -1) <= 1
               for a in stalls), stalls


def stall_histogram(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """A worker's point at least the block, with the run's trace as exemplar
    where traces are on"""
    trace_id = hex_of(ran.run)[0]
    (point, *_) = r.wait_for(lambda r: [
        p for p in r.metric_points(STALL_DURATION)
        if p.attributes.get("dask.server.kind") == "worker" and (p.max or 0) >= BLOCK - CLOCK
        and ("traces" not in cell.exported or trace_id in {t for t, _ in p.exemplars})])
    assert point.resource["service.name"] == SERVICE[cell.config], point.resource


def stall_record(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """The stall's log record, with the stack, in the run's trace where traces are on"""
    records = r.wait_for(lambda r: [
        x for x in r.logs()
        if x.attributes.get("dask.event.topic") == STALL_TOPIC and is_the_stall(x.attributes, ran)])
    ids = hex_of(ran.run) if "traces" in cell.exported else (None, None)
    assert any(STALL_STACK in x.attributes.get("code.stacktrace", "")
               and 0 <= x.attributes.get(GC_SHARE, -1) <= 1 and (x.trace_id, x.span_id) == ids
               for x in records), records


#: What no exported span or record may carry without messages: the exceptions' texts
FAILED_TEXTS = [f"bad {i}" for i in range(len(FAILED_KEYS))] + ["raise ValueError"]


def failed_runs(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """The failed TaskGroup's span and the run's root: an exception event for each of
    the first 3 erred tasks, with its key and worker, and its message and traceback
    unless otel.errors.messages is false"""
    trace_id, span_id = hex_of(ran.failed)
    (root,) = r.wait_for(lambda r: [s for s in r.spans(FAILED) if s.span_id == span_id])
    (group,) = r.wait_for(lambda r: [s for s in r.spans("taskgroup/modes-bad")
                                     if s.trace_id == trace_id])
    for each in (group, root):
        got = [a for name, _, a in each.events if name == "exception"]
        assert len(got) == 3 and len({a["dask.task.key"] for a in got}) == 3, (each.name, got)
        for event in got:
            assert event.get("exception.type") == "ValueError", event
            i = FAILED_KEYS.index(event["dask.task.key"])
            assert event.get(WORKER_ADDRESS) in (ran.spiller, ran.retired), event
            if cell.messages:
                assert event.get("exception.message") == f"bad {i}", event
                assert 'raise ValueError(f"bad {x}")' in event.get("exception.stacktrace", ""), event
            else:
                assert "exception.message" not in event, event
                assert "exception.stacktrace" not in event, event
    if not cell.messages:
        exported = repr([(s.name, s.attributes, s.events, s.status_message) for s in r.spans()])
        assert not [t for t in FAILED_TEXTS if t in exported], exported[:400]


def failed_task_logs(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    """distributed's "Compute Failed" warnings of the failed tasks: with the
    exception's text, or as their templates without messages (docs/privacy.md);
    no record, the stall's included, carries the text then"""
    records = r.wait_for(lambda r: len(x := [g for g in r.logs()
                                              if str(g.body).startswith("Compute Failed")])
                         >= len(FAILED_KEYS) and x)
    texts = [t for t in FAILED_TEXTS if t in repr([(g.body, g.attributes) for g in r.logs()])]
    if cell.messages:
        assert any("bad " in str(g.body) for g in records), records[0]
    else:
        assert texts == [], texts


def removed_workers(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    r.wait_for(lambda r: latest(r, "dask.worker.removed",
                                dask_worker_removed_reason="retired") == 1)


def log_lines(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    def lines(body):
        return [x for x in r.logs() if x.body == body]

    (scheduler,) = r.wait_for(lambda r: lines("from the scheduler"))
    assert scheduler.resource["process.pid"] == ran.scheduler_pid
    assert scheduler.resource["service.name"] == SERVICE[cell.config], scheduler.resource
    # without messages, each record's template (docs/privacy.md); under
    # opentelemetry-instrument, the root logger's records are its handler's, as it
    # exports them (docs/logs.md "Each record once"): the switch is not its
    bodies = ["scored partition 0", "scored partition 1"]
    if not cell.messages and cell.switch != "zero-code":
        bodies = ["scored partition %d"]
    tasks = r.wait_for(lambda r: len(x := sum(map(lines, bodies), [])) == 2 and x)
    # in their task's trace
    assert {x.trace_id for x in tasks} == {hex_of(ran.run)[0]}, tasks


def events(r: OTLPReceiver, ran: Ran, cell: Cell) -> None:
    r.wait_for(lambda r: [x for x in r.logs()
                          if x.attributes.get("dask.event.topic") == "remove-worker"
                          and x.attributes.get("dask.worker.address") == ran.retired])


CHECKS: dict[str, Callable[[OTLPReceiver, Ran, Cell], None]] = {
    "mirrored spans": mirrored_spans,
    "task spans": task_spans,
    "per-workflow controls": per_workflow_controls,
    "fine metrics": fine_metrics,
    "spill": spill,
    "Dask's families": dask_families,
    "workflow outcomes": workflow_outcomes,
    "open runs": open_runs,
    "removed workers": removed_workers,
    "Dask's log lines and task logs": log_lines,
    "events": events,
    "run started": run_started,
    "stalls on spans": stalls_on_spans,
    "stall histogram": stall_histogram,
    "stall record": stall_record,
    "failed runs": failed_runs,
    "failed tasks' log lines": failed_task_logs,
}


def signal_is_off(r: OTLPReceiver, ran: Ran, cell: Cell, signal: str) -> None:
    """Nothing of ``signal`` arrived, and status() says it is off where it says"""
    received = {"traces": r.spans, "metrics": r.metric_points, "logs": r.logs}[signal]()
    assert received == [], f"{signal} are off, yet {len(received)} arrived"
    scheduler = ran.status["scheduler"]
    if signal in ("traces", "metrics"):
        assert scheduler[signal] is False, scheduler
    if signal == "metrics":
        assert all(w["metrics"] is False for w in ran.status["workers"].values())
    for server in (scheduler, *ran.status["workers"].values()):
        # export: None for a signal the server's process does not export, with the
        # variables or the file (so of logs, which has no flag of its own)
        assert server["export"][{"traces": "spans"}.get(signal, signal)] is None, server


# --- the outage ----------------------------------------------------------------------


def outage(r: OTLPReceiver, client: Client, procs: CellProcesses, cell: Cell) -> None:
    """docs/deploy.md, "When telemetry fails": the collector goes away; one WARNING
    per signal when the outage starts, the SDK's own per-retry lines held back"""
    r.stop()
    with dask_otel.span("modes-outage"):
        client.submit(inc, 10).result()
    client.run_on_scheduler(
        lambda: logging.getLogger("distributed.scheduler").warning("during the outage"))
    for signal in outage_signals(cell):
        warning = wait_until(lambda: re.search(f".*cannot export {signal}.*", procs.log("scheduler")),
                             30, f"the scheduler's WARNING that {signal} cannot be exported")
        # with its reason: a refused connection is UNAVAILABLE to gRPC
        assert "UNAVAILABLE" in warning.group(), warning.group()
    held = [f"{name}: {line}" for name in procs.logs for line in procs.log(name).splitlines()
            if SDK_EXPORT_LINES.search(line) and "dask_otel" not in line]
    assert not held, f"the SDK's own export lines reached the console: {held[:3]}"


def recovery(r: OTLPReceiver, client: Client, procs: CellProcesses, cell: Cell) -> None:
    """... and once it is back, data again within RECOVERY seconds, and one WARNING
    per signal that says so"""
    r.start()
    back = time.time()
    with dask_otel.span("modes-after"):
        client.submit(inc, 20).result()
    client.run_on_scheduler(
        lambda: logging.getLogger("distributed.scheduler").warning("after the outage"))
    arrived = {
        "spans": lambda r: r.spans("modes-after"),
        "metrics": lambda r: [p for p in r.metric_points("dask.otel.export.failures")
                              if p.time > back],
        "logs": lambda r: [x for x in r.logs() if x.body == "after the outage"],
    }
    late = []
    for signal in outage_signals(cell):
        with contextlib.suppress(AssertionError):
            r.wait_for(arrived[signal], timeout=max(RECOVERY - (time.time() - back), 0.1))
            continue
        late.append(signal)
    assert not late, f"{late} did not arrive within {RECOVERY} s of the collector's return"
    log = procs.log("scheduler")
    for signal in outage_signals(cell):
        assert log.count(f"cannot export {signal}") == 1, log
        wait_until(lambda: f"{signal} export recovered" in procs.log("scheduler"), 5,
                   f"the scheduler's WARNING that {signal} export recovered")


def outage_signals(cell: Cell) -> list[str]:
    """The accounting's names of the signals the cell exports"""
    return [{"traces": "spans"}.get(s, s) for s in cell.exported]


# --- the cells -----------------------------------------------------------------------


@contextlib.contextmanager
def cell_cluster(cell: Cell, tmp_path: Path) -> Iterator[tuple]:
    if cell.switch == "zero-code":
        from tests.test_instrumentor import entry_point_installed

        if not entry_point_installed() and not os.environ.get("CI"):  # as test_instrumentor
            pytest.skip("the dask entry point of opentelemetry_instrumentor is not installed")
    if cell.config == "file":
        pytest.importorskip("opentelemetry.configuration",
                            reason="dask-otel[config] not installed")
    with OTLPReceiver("grpc") as receiver:
        with CellProcesses(cell, cell_env(cell, receiver, tmp_path)) as procs:
            with procs.client() as client:
                if cell.switch == "client":
                    dask_otel.instrument(client)
                yield receiver, procs, client


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_every_capability_works_or_says_it_does_not_apply(cell, tmp_path):
    oracle.waive("every-task",
                 "the outage capability's run is sent to a refusing collector", roots=('modes-outage',))
    oracle.waive("every-span",
                 "the outage capability's run is sent to a refusing collector", roots=('modes-outage',))
    failed: dict[str, str] = {}

    def check(name: str, run: Callable[[], None]) -> None:
        try:
            run()
        except AssertionError as e:
            failed[name] = str(e)[:400]

    with cell_cluster(cell, tmp_path) as (receiver, procs, client):
        ran = run_workload(client)
        scheduler = ran.status["scheduler"]
        assert scheduler is not None and scheduler["error"] is None, ran.status
        assert scheduler["paths"] == [
            {"preload": "preload", "client": "client", "zero-code": "instrumentor"}[cell.switch]
        ]
        for status in (scheduler, *ran.status["workers"].values()):
            assert status["error"] is None, status
            assert status["service_name"]["name"] == SERVICE[cell.config], status
            assert (status["config_file"] is None) == (cell.config == "env"), status
            assert status["config"]["otel.errors.messages"] is cell.messages, status
        for name, signal in CAPABILITIES.items():
            if signal in cell.exported:
                check(name, lambda: CHECKS[name](receiver, ran, cell))
        time.sleep(1)  # what a signal that is off would send comes within its interval
        for signal in SIGNALS["all"]:
            if signal not in cell.exported:
                check(f"{signal} off", lambda: signal_is_off(receiver, ran, cell, signal))
        ran.chunks.clear()
        check("outage", lambda: outage(receiver, client, procs, cell))
        check("recovery", lambda: recovery(receiver, client, procs, cell))
    assert not failed, "\n".join(f"{name}: {why}" for name, why in failed.items())
