"""Dask itself as the oracle: after a workload, what Dask recorded against everything
the bridge exported.

Each test checks its own rule; this module checks the whole, after every test that
runs a cluster (the autouse fixture in tests/conftest.py). Dask knows every task and
second that ran: its spans extension keeps every Dask span and TaskGroup forever, the
scheduler sums the workers' fine metrics, each worker's SpillBuffer counts what it
spilled. :func:`read_dask` reads that as plain data, on the scheduler (in this process,
or through ``Client.run_on_scheduler``); :func:`compare` holds it against the spans
and metric points the bridge exported, whatever read them back (the SDK's in-memory
exporter and reader, or the OTLP test receiver).

What is compared, each a named check (a test that loses something on purpose waives
that check by name, saying why: :meth:`Oracle.waive`):

- ``tree``: every span received has a unique id, its parent exported (in its trace),
  and lies inside it (``tests.support.span_tree.assert_span_tree``);
- ``every-span``: every Dask span of a trace the sampler kept is exported exactly once
  (a trace is kept whole or not at all; with the default sampler, every trace);
- ``every-task``: every task a graph ran is counted in exactly one exported TaskGroup
  batch: by TaskGroup name, the sum of ``dask.tasks.total`` over the exported batches
  equals the tasks graphs submitted to run there, as Dask's transition log tells
  (collisions, reruns of released tasks and groups Dask made again included;
  recomputation after a worker's loss, which no graph asked for, is not a batch);
- ``fine-metrics``: each ``dask.activity.*`` figure exported at the last collection,
  by unit, context, task prefix and activity, equals Dask's
  ``Scheduler.cumulative_worker_metrics`` then;
- ``exemplars``: every exemplar of a ``dask.activity.*`` point names an exported span;
- ``spill``: each worker's ``dask.spill.*`` totals equal its SpillBuffer's counters;
- ``lost-workers``: every worker Dask removed while it processed tasks is a
  ``dask.worker.lost`` span event naming it.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tests.support.span_tree import as_node, assert_span_tree

#: The length of Dask's transition log a test's scheduler keeps (the oracle reads it)
LOG_LENGTH_KEY, LOG_LENGTH = "distributed.admin.low-level-log-length", 1_000_000

CHECKS = ("tree", "every-span", "every-task", "fine-metrics", "exemplars", "spill",
          "lost-workers")

#: Attributes the oracle reads (written out: the oracle does not import what it checks)
SPAN_ID = "dask.span.id"
TASKGROUP_NAME = "dask.taskgroup.name"
TASKS_TOTAL = "dask.tasks.total"
SCHEDULER_ADDRESS = "dask.scheduler.address"
#: dask.activity.<instrument> by the unit of Dask's keys
ACTIVITY_UNITS = {"dask.activity.time": "seconds", "dask.activity.size": "bytes",
                  "dask.activity.count": "count"}
#: dask.spill.<instrument> by the unit of SpillBuffer.cumulative_metrics' keys
SPILL_UNITS = {"count": "dask.spill.count", "bytes": "dask.spill.size", "seconds": "dask.spill.time"}


# --- what Dask recorded ------------------------------------------------------------


@dataclass
class DaskRecord:
    """What Dask recorded, as plain (picklable) data"""

    #: Dask span id -> (its root's id, its tags)
    spans: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    #: TaskGroup name -> tasks graphs submitted to run in TaskGroups of that name
    #: (``Scheduler.transition_log``: released -> waiting, on ``update-graph``),
    #: and the root Dask span ids of their spans
    tasks: dict[str, int] = field(default_factory=dict)
    task_roots: dict[str, set[str]] = field(default_factory=dict)
    #: ``Scheduler.cumulative_worker_metrics``: (unit, context, prefix or where,
    #: activity) -> value
    fine: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    #: Worker address -> SpillBuffer ``cumulative_metrics`` (label, unit) -> value
    spill: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    #: Workers Dask removed while they processed tasks (its ``remove-worker`` events)
    lost_workers: list[str] = field(default_factory=list)
    #: The scheduler's address, and whether the bridge's sampler dropped a trace
    #: (its own count: then a trace may be missing, though only whole)
    address: str = ""
    sampled_out: bool = False
    #: Dask's transition log was full: the tasks it ran cannot be counted
    log_full: bool = False


def fine_key(key: Hashable) -> tuple[str, str, str, str] | None:
    """``(unit, context, prefix or where, activity)`` of a key of Dask's fine metrics"""
    if not isinstance(key, tuple) or len(key) < 3:
        return None
    context, *middle, activity, unit = key
    where = str(middle[0]) if middle and context == "execute" else " ".join(map(str, middle))
    return str(unit), str(context), where, str(activity)


def read_dask(dask_scheduler: Any) -> DaskRecord:
    """Dask's own record on ``dask_scheduler`` (runs there: ``run_on_scheduler``)"""
    from distributed.utils import key_split_group

    mirror = getattr(dask_scheduler.plugins.get("dask-otel"), "mirror", None)
    record = DaskRecord(address=dask_scheduler.address,
                        sampled_out=bool(getattr(mirror, "sampled_out", 0)))
    ext = dask_scheduler.extensions.get("spans")
    groups: dict[int, Any] = {}
    for span in list(ext.spans.values()) if ext is not None else ():
        root = span
        while root.parent is not None:
            root = root.parent
        record.spans[span.id] = (root.id, tuple(span.name))
        for tg in span.groups:
            groups[id(tg)] = (tg, root.id)
    for tg, root_id in groups.values():
        record.task_roots.setdefault(tg.name, set()).add(root_id)
    # Tasks a graph submitted to run: a new task, or one released since it ran
    # (TaskGroup.states counts task states, not runs: a rerun adds nothing there)
    log = dask_scheduler.transition_log
    if len(log) == log.maxlen:
        record.tasks = {}  # the log forgot some: what it holds proves nothing
        record.log_full = True
    else:
        runs = Counter(key_split_group(t[0]) for t in log
                       if t[1] == "released" and t[2] != "forgotten"
                       and str(t[4]).startswith("update-graph"))
        record.tasks = {name: runs.get(name, 0) for name in record.task_roots}
    for _, msg in dask_scheduler.get_events("all"):
        if isinstance(msg, dict) and msg.get("action") == "remove-worker" and msg.get(
                "processing-tasks") and "worker" in msg:
            record.lost_workers.append(msg["worker"])
    for key, value in dict(dask_scheduler.cumulative_worker_metrics).items():
        if (k := fine_key(key)) is not None:
            record.fine[k] = record.fine.get(k, 0.0) + value
    return record


def read_spill(workers: Iterable[Any]) -> dict[str, dict[tuple[str, str], float]]:
    """Each running in-process worker's SpillBuffer counters"""
    from distributed.spill import SpillBuffer

    out = {}
    for worker in workers:
        if isinstance(worker.data, SpillBuffer) and worker.status.name == "running":
            try:  # one a test broke on purpose is not compared
                metrics = dict(worker.data.cumulative_metrics)
            except Exception:
                continue
            out[worker.address] = {tuple(map(str, k)): v for k, v in dict(metrics).items()}
    return out


# --- what the bridge exported ------------------------------------------------------


@dataclass
class Exported:
    """What the bridge exported, read back: spans (any source of
    ``span_tree.as_node``) and, per metric, the points of the last collection as
    ``(attributes, value, exemplars as (trace id hex, span id hex))``"""

    spans: list[Any] = field(default_factory=list)
    #: None: metrics were not read back (off, or not readable)
    points: dict[str, list[tuple[dict, float, tuple]]] | None = None
    #: Whether traces were exported where they were read (else only metrics are compared)
    traces: bool = True


def attributes_of(span: Any) -> Mapping[str, Any]:
    return span.attributes or {}


def resource_of(span: Any) -> Mapping[str, Any]:
    """The resource attributes of an SDK span or an OTLP receiver's span"""
    resource = getattr(span, "resource", None)
    return getattr(resource, "attributes", resource) or {}


def _events(span: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """``(name, attributes)`` of a span's events, from the SDK or the receiver"""
    return [(e.name, e.attributes or {}) if hasattr(e, "name") else (e[0], e[2])
            for e in span.events or ()]


def sdk_points(data: Any) -> dict[str, list[tuple[dict, float, tuple]]]:
    """The points of one collection of an SDK metric reader (``MetricsData``)"""
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(
                    (dict(p.attributes), getattr(p, "value", getattr(p, "sum", 0)),
                     tuple((f"{e.trace_id:032x}", f"{e.span_id:016x}")
                           for e in getattr(p, "exemplars", None) or ()))
                    for p in metric.data.data_points
                )
    return out


def received_points(points: Iterable[Any]) -> dict[str, list[tuple[dict, float, tuple]]]:
    """The last point of each series the OTLP test receiver got"""
    last: dict[tuple, Any] = {}
    for p in points:
        series = (p.name, tuple(sorted((k, str(v)) for k, v in p.attributes.items())),
                  tuple(sorted(map(str, p.resource.items()))))
        if series not in last or p.time >= last[series].time:
            last[series] = p
    out: dict[str, list] = {}
    for p in last.values():
        out.setdefault(p.name, []).append((p.attributes, p.value, tuple(p.exemplars)))
    return out


# --- the comparison ----------------------------------------------------------------


def compare(dask: DaskRecord, exported: Exported,
            waived: Mapping[str, frozenset[str] | None] = {}) -> list[str]:
    """Every difference between Dask's record and the export, one line each, under
    the name of the check it fails (none: the whole is accounted for). ``waived``:
    checks not made, for the runs of the root Dask spans named (None: any)"""
    problems: list[str] = []

    def check(name: str, ok: bool, message: str, roots: Iterable[str] = ()) -> None:
        if ok or (name in waived and (waived[name] is None or waived[name] & {
                dask.spans[r][1][0] for r in roots if r in dask.spans})):
            return
        problems.append(f"{name}: {message}")

    # Two clusters of one process share its exporters, and a block whose tasks went
    # to both is a Dask span on each, mirrored by each with the same ids: compare
    # the spans whose resource names this scheduler (or no scheduler)
    spans = [s for s in exported.spans
             if resource_of(s).get(SCHEDULER_ADDRESS, dask.address) == dask.address]
    if waived.get("tree", ()) is not None:
        try:
            assert_span_tree(_callers_remote(spans, dask), ends="inside-if-exported-first")
        except AssertionError as e:
            problems.append(f"tree: {e}")
    # Dask spans as exported: their own OTel span, and their TaskGroup batches
    own: Counter[str] = Counter()
    batches: defaultdict[str, int] = defaultdict(int)
    for span in spans:
        attributes = attributes_of(span)
        if (span_id := attributes.get(SPAN_ID)) not in dask.spans:
            continue  # another cluster's, or not the bridge's
        if (group := attributes.get(TASKGROUP_NAME)) is not None:
            batches[str(group)] += int(attributes.get(TASKS_TOTAL, 0))
        else:
            if as_node(span).span_id == f"{int(span_id.replace('-', ''), 16) & (2**64 - 1):016x}":
                own[span_id] += 1
    if exported.traces:
        # A trace is kept whole or not at all; dropped only by a sampler
        kept_roots = {dask.spans[s][0] for s in own}
        every = not dask.sampled_out
        for span_id, (root, tags) in dask.spans.items():
            if every or root in kept_roots:
                n = own.get(span_id, 0)
                check("every-span", n == 1, f"Dask span {tags} ({span_id}) exported {n} times"
                      + ("" if every else ", in a kept trace"), [root])
        for name, n in dask.tasks.items():
            if every or dask.task_roots[name] & kept_roots:
                got = batches.get(name, 0)
                check("every-task", got == n, f"TaskGroup {name!r}: graphs ran {n} tasks, the "
                      f"exported batches count {got}", dask.task_roots[name])
        for name in set(batches) - set(dask.tasks):
            check("every-task", False, f"batches of TaskGroup {name!r}, unknown to Dask")
        check("every-task", not dask.log_full, "Dask's transition log is full: raise "
              "distributed.admin.low-level-log-length (tests/support/cluster.py)")
    if spans and dask.lost_workers:
        told = {str(a.get("dask.worker.address")) for span in spans for name, a in _events(span)
                if name == "dask.worker.lost"}
        for address in dask.lost_workers:
            check("lost-workers", address in told,
                  f"worker {address} was lost processing tasks: no dask.worker.lost event")
    if exported.points is not None:
        _compare_metrics(dask, exported, spans, check)
    return problems


def _callers_remote(spans: list, dask: DaskRecord) -> list:
    """The spans as ``Node``, the parent of each root Dask span marked remote: the
    caller's span it continues is the application's to export, not the bridge's"""
    roots = {f"{int(i.replace('-', ''), 16) & (2**64 - 1):016x}"
             for i, (root, _) in dask.spans.items() if i == root}
    nodes = [as_node(s) for s in spans]
    return [replace(n, remote_parent=True) if n.span_id in roots and n.parent_id else n
            for n in nodes]


def _compare_metrics(dask: DaskRecord, exported: Exported, spans: list, check: Any) -> None:
    # Two schedulers in one process share the MeterProvider: the resource names the
    # first, the other's points carry its address
    every = exported.points or {}
    ours = any(a.get(SCHEDULER_ADDRESS) == dask.address for ps in every.values() for a, _, _ in ps)
    points = {name: [p for p in ps if p[0].get(SCHEDULER_ADDRESS) == (dask.address if ours else None)]
              for name, ps in every.items()}
    fine: defaultdict[tuple, float] = defaultdict(float)
    overflow: defaultdict[str, float] = defaultdict(float)
    exported_ids = {(n.trace_id, n.span_id) for n in map(as_node, spans)}
    for name, unit in ACTIVITY_UNITS.items():
        for attributes, value, exemplars in points.get(name, ()):
            if attributes.get("otel.metric.overflow"):
                overflow[unit] += value
            else:
                where = attributes.get("dask.task.prefix", attributes.get("dask.activity.where", ""))
                key = (unit, str(attributes.get("dask.activity.context")), str(where),
                       str(attributes.get("dask.activity.name")))
                fine[key] += value
            for exemplar in exemplars:
                check("exemplars", exemplar in exported_ids,
                      f"{name} {attributes}: exemplar {exemplar} names no exported span")
    if points.get("dask.activity.time") is not None or dask.fine:
        for unit in set(ACTIVITY_UNITS.values()):
            want = {k: v for k, v in dask.fine.items() if k[0] == unit}
            got = {k: v for k, v in fine.items() if k[0] == unit}
            if overflow[unit]:  # past the series limit: the whole, not each series
                check("fine-metrics", _close(sum(got.values()) + overflow[unit],
                                             sum(want.values())),
                      f"{unit}: exported {sum(got.values()) + overflow[unit]}, Dask "
                      f"{sum(want.values())}")
                continue
            for key in want.keys() | got.keys():
                check("fine-metrics", _close(got.get(key, 0.0), want.get(key, 0.0)),
                      f"{key}: exported {got.get(key, 0.0)}, Dask {want.get(key, 0.0)}")
    for address, counters in dask.spill.items():
        for (label, unit), value in counters.items():
            name = SPILL_UNITS[unit]
            got = [v for a, v, _ in points.get(name, ())
                   if a.get("dask.worker.address") == address and a.get("dask.activity.name") == label]
            check("spill", _close(sum(got), value),
                  f"{address} {name} {label}: exported {got}, SpillBuffer {value}")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# --- the fixture's side --------------------------------------------------------------


@dataclass
class Oracle:
    """One test's oracle: every cluster the test ran, compared once it closed
    (:func:`tests.support.cluster.otel_cluster`, :class:`DaskProcesses`, and at the
    end of the test any other scheduler of this process: :meth:`finish`), and the
    checks the test waived"""

    #: Check -> the root Dask span names whose runs it spares (None: every run)
    waived: dict[str, frozenset[str] | None] = field(default_factory=dict)
    #: The OTLP test receivers started in the test: a cluster whose exporters
    #: point at one is compared with what it received
    receivers: list[Any] = field(default_factory=list)
    #: Schedulers of this process already compared (by ``id``), and the lines of
    #: every comparison so far
    compared: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def waive(self, check: str, why: str, roots: Iterable[str] | None = None) -> None:
        """This test loses what ``check`` compares on purpose, for the reason ``why``:
        in the runs of the root Dask spans named ``roots`` only, or in any"""
        assert check in CHECKS, f"no oracle check {check!r}: {CHECKS}"
        assert why, "say why"
        self.waived[check] = None if roots is None else frozenset(roots)

    def compare(self, dask: DaskRecord, exported: Exported, where: str) -> list[str]:
        """Compare, keep and return the differences found"""
        found = [f"{where}: {line}" for line in compare(dask, exported, self.waived)]
        self.problems += found
        return found

    def compare_now(self, dask: DaskRecord, exported: Exported, where: str) -> None:
        """Compare a cluster that just closed: its test fails here, not at its teardown"""
        if found := self.compare(dask, exported, where):
            self.problems = [p for p in self.problems if p not in found]
            raise AssertionError("Dask's own record and the export differ:\n" + "\n".join(found[:40]))

    def receiver_for(self, env: Mapping[str, str]) -> Any:
        """The receiver the exporters configured by ``env`` send to (None: none)"""
        values = [v for k, v in env.items() if k.startswith("OTEL_EXPORTER_OTLP_")]
        return next((r for r in self.receivers
                     if r.running and any(v.startswith(r.endpoint) for v in values)), None)

    def exported_by(self, plugin: Any, env: Mapping[str, str], points: Any = None) -> Exported | None:
        """What a scheduler's bridge exported, from its in-memory exporter or the
        receiver its environment points at (None: nothing readable)"""
        telemetry = getattr(plugin, "telemetry", None)
        exporters = list(getattr(telemetry, "span_exporters", ()) or ())
        if exporters and all(hasattr(e, "get_finished_spans") for e in exporters):
            spans = [s for e in exporters for s in e.get_finished_spans()]
            return Exported(spans, points)
        if (receiver := self.receiver_for(env)) is not None:
            got, spans = receiver.metric_points(), receiver.spans()
            return Exported(spans, received_points(got) if got else points, bool(spans))
        return Exported([], points, traces=False) if points is not None else None

    def finish(self, schedulers: Iterable[Any], env: Mapping[str, str]) -> None:
        """Compare the closed schedulers of this process not compared yet (one
        still running, a module's fixture, has not exported all it will)"""
        for scheduler in schedulers:
            plugin = scheduler.plugins.get("dask-otel")
            if id(scheduler) in self.compared or plugin is None or scheduler.status.name != "closed":
                continue
            self.compared.add(id(scheduler))
            if (exported := self.exported_by(plugin, env)) is not None:
                self.compare(read_dask(scheduler), exported, f"scheduler {scheduler.address}")

    def assert_whole(self) -> None:
        assert not self.problems, "Dask's own record and the export differ:\n" + "\n".join(
            self.problems[:40])


#: The running test's oracle (set by the autouse fixture; None outside tests)
current: Oracle | None = None


def waive(check: str, why: str, roots: Iterable[str] | None = None) -> None:
    """:meth:`Oracle.waive` on the running test's oracle"""
    assert current is not None, "no oracle: not inside a test"
    current.waive(check, why, roots)


def metrics_before_close(cluster: Any) -> tuple[DaskRecord, dict] | None:
    """Dask's fine metrics and SpillBuffer counters, and one collection of the
    in-memory metric reader of an in-process scheduler's bridge, at one moment
    (read again if a heartbeat came between); None: no in-memory reader"""
    scheduler = cluster.scheduler
    telemetry = getattr(scheduler.plugins.get("dask-otel"), "telemetry", None)
    readers = [r for r in getattr(telemetry, "metric_readers", ()) or ()
               if type(r).__name__ == "InMemoryMetricReader"]
    if not readers:
        return None
    workers = [w for w in cluster.workers.values() if hasattr(w, "data")]
    for _ in range(10):
        try:
            before = read_dask(scheduler).fine, read_spill(workers)
            points = sdk_points(readers[0].get_metrics_data())
            dask = read_dask(scheduler)
            dask.spill = read_spill(workers)
        except RuntimeError:  # a mapping changed size while read (the loop's thread)
            continue
        if (dask.fine, dask.spill) == before:
            return dask, points
    raise AssertionError("Dask's metrics kept changing while the oracle read them")


def in_process(cluster: Any, before_close: tuple[DaskRecord, dict] | None) -> None:
    """Compare a closed in-process cluster (``otel_cluster``): its spans now, its
    metrics as :func:`metrics_before_close` read them"""
    import os

    oracle = current if current is not None else Oracle()
    scheduler = cluster.scheduler
    oracle.compared.add(id(scheduler))
    plugin = scheduler.plugins.get("dask-otel")
    points = before_close[1] if before_close is not None else None
    if plugin is None or (exported := oracle.exported_by(plugin, os.environ, points)) is None:
        return
    dask = read_dask(scheduler)
    if before_close is not None:
        dask.fine, dask.spill = before_close[0].fine, before_close[0].spill
    oracle.compare_now(dask, exported, f"cluster {scheduler.address}")


def read_remote(address: str) -> DaskRecord | None:
    """Dask's own record on the scheduler at ``address`` (another process); None if
    it cannot be read (the scheduler is gone)"""
    from distributed import Client

    try:
        with Client(address, timeout=10) as client:
            dask = client.run_on_scheduler(read_dask)
            # The workers' next heartbeats may still carry the fine metrics of the last
            # tasks, which the bridge's flush on close then exports: read again after
            # every worker heartbeated, until nothing changed
            for _ in range(10):
                since = client.run_on_scheduler(_scheduler_time)
                deadline = time.monotonic() + 10
                while (not client.run_on_scheduler(_heard_from_all, since)
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
                again = client.run_on_scheduler(read_dask)
                if again.fine == dask.fine:
                    return again
                dask = again
            return dask
    except Exception:
        return None


def _scheduler_time(dask_scheduler: Any) -> float:
    from distributed.metrics import time as dask_time

    return dask_time()


def _heard_from_all(since: float, dask_scheduler: Any) -> bool:
    """Every worker heartbeated after ``since`` (the scheduler's clock)"""
    return all(ws.last_seen > since for ws in dask_scheduler.workers.values())


def processes_closed(dask: DaskRecord | None, env: Mapping[str, str], where: str) -> None:
    """Compare a cluster of ``dask scheduler``/``dask worker`` processes, stopped,
    with what the receiver its environment points at got"""
    if current is None or dask is None:
        return
    if (exported := current.exported_by(None, env)) is not None:
        current.compare_now(dask, exported, where)
