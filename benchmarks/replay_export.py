"""Scheduler thread time per span of the mirror's export path, replayed: steadier
than one pass.

Runs the overhead workload (harness.Workload) on a LocalCluster with worker
processes and the bridge, with ``otel.spans.export-delay: 1h`` so that nothing is
exported while it runs. Then, on the scheduler's event loop, with the export delay
set to 0, it copies the mirror's state, and ``--repeats`` times: puts the copy
back, collects garbage, and polls with the garbage collector off until everything
is exported, timed with ``time.thread_time``. The SDK's span processors are set
aside meanwhile (ReadableSpans are built, not queued), so each pass is the same
work on the same Dask objects. Prints min and median us per OTel span.

Unlike mirror_profile.py this reads and writes the mirror's internals, so it
must follow them when they change. Since the "one house" layout the mirror keeps
what is open in one ``Ledger``, which a pass consumes and the script copies
(:func:`saved_ledger`); before it (for before/after figures), the names in
``STATE`` and the ``GroupBatch`` objects in ``open_groups``. Either way it stops
with a message if a pass does not export every span and group that was open, and
on the old layout also if the mirror or a ``GroupBatch`` holds an attribute it
does not know.

Usage::

    python -m benchmarks.replay_export               # 15 passes
    PYTHONPATH=<a checkout>:. python -P -m benchmarks.replay_export   # another commit's dask_otel
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
from typing import Any

import dask
from distributed import Client, LocalCluster
from benchmarks.harness import (
    PLUGIN_NAME,
    ReceiverProcess,
    Workload,
    print_machine,
    quiet_logs,
    run_on_loop,
    use_otel_env,
)
from benchmarks.mirror_profile import poll_until_exported

#: The mirror's per-span state, restored before each pass (present ones only)
STATE = (
    "open_spans", "open_groups", "erred", "ends", "open_children", "open_groups_of",
    "idle", "folded", "remote_parents", "reopened_parents", "entered", "links",
)
#: The mirror's other attributes: wiring, config, counters, per-poll caches
#: (cleared by every poll), and ``spans_seen`` (no span is created while replaying)
NOT_STATE = frozenset({
    "scheduler", "telemetry", "config", "spans_seen", "mirrored", "sampled_out",
    "reopened", "_metrics", "_heads", "_sink", "_random", "builder", "_batch",
})
#: ``GroupBatch`` fields (``open_groups``' values), copied batch by batch: a poll
#: writes ``busy`` and ``wake``, and ``wake`` was worked out with the 1h export
#: delay (``end + 1h``), so it is reset to 0 ("look at it at the next poll")
BATCH_FIELDS = frozenset({
    "busy", "duration", "erred", "failed", "metrics", "nbytes", "since", "span",
    "started", "states", "total", "wake",
})


class ReplayError(RuntimeError):
    """The replay does not do what it should: the script must follow the mirror"""


def check_known(mirror: Any) -> None:
    """Stop if the mirror or a GroupBatch keeps something this script does not
    restore: a pass would not redo the same work (or any)"""
    unknown = sorted(set(getattr(mirror, "__dict__", ())) - set(STATE) - NOT_STATE)
    if not hasattr(mirror, "__dict__") or unknown:
        raise ReplayError(
            f"SpanMirror has attributes replay_export.py does not know: {unknown or '(slots)'}; "
            "add per-span state to STATE (restored before each pass), the rest to NOT_STATE"
        )
    for batch in getattr(mirror, "open_groups", {}).values():
        fields = set(getattr(type(batch), "__slots__", ())) | set(getattr(batch, "__dict__", ()))
        if fields - BATCH_FIELDS:
            raise ReplayError(
                f"GroupBatch has fields replay_export.py does not know: "
                f"{sorted(fields - BATCH_FIELDS)}; see whether a poll writes them or they "
                "depend on the export delay, and add them to BATCH_FIELDS"
            )
        break


def saved_batch(batch: Any) -> Any:
    """A copy of a GroupBatch as a mirror with export delay 0 would hold it"""
    batch = copy.copy(batch)
    if hasattr(batch, "wake"):
        batch.wake = 0.0
    return batch


def restore(mirror: Any, saved: dict[str, Any]) -> None:
    """Put the saved per-span state back: fresh containers (polls pop from them),
    fresh GroupBatch objects (polls write some fields), fresh Totals in ``folded``
    (sub-spans' totals are summed into them); Dask's own objects are shared"""
    for name, value in saved.items():
        if name == "folded":
            value = copy.deepcopy(value)
        elif name == "open_groups":
            value = {tg: copy.copy(batch) for tg, batch in value.items()}
        else:
            value = copy.copy(value)
        setattr(mirror, name, value)


def saved_ledger(ledger: Any) -> Any:
    """A copy of the mirror's Ledger that a pass can consume: fresh SpanRecords
    and GroupBatches (polls write them), fresh Totals in ``folded`` (sub-spans'
    totals are summed into them), fresh containers; Dask's own objects are
    shared. Batches get ``wake`` 0, as a mirror with export delay 0 would hold
    them."""
    out = copy.copy(ledger)
    out.records = {span_id: copy.copy(record) for span_id, record in ledger.records.items()}
    for record in out.records.values():
        if hasattr(record, "folded"):  # before issue 38 (now the builder thread's)
            record.folded = copy.deepcopy(record.folded)
        record.links = dict(record.links) if record.links else record.links
    out.leaves = {span_id: out.records[span_id] for span_id in ledger.leaves}
    out.groups = {tg: saved_batch(batch) for tg, batch in ledger.groups.items()}
    out.reopened_parents = dict(ledger.reopened_parents)
    return out


def timed_passes(
    mirror: Any, repeats: int, restore: Any, expected: int, left_open: Any
) -> list[float]:
    """``repeats`` passes, each after ``restore()``: scheduler thread time per
    exported span (us), GC off; stops if a pass does not export ``expected``"""
    out = []
    for i in range(repeats):
        restore()
        gc.collect()
        gc.disable()
        try:
            seconds, n = poll_until_exported(mirror, None)
        finally:
            gc.enable()
        if n <= 0 or n != expected:
            raise ReplayError(
                f"pass {i + 1} exported {n} OTel spans, expected {expected} (the open "
                f"Dask spans and TaskGroups); left open: {left_open()}. The mirror keeps "
                "some state this script does not restore or reset"
            )
        out.append(seconds / n * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    print("dask_otel: the span mirror's export path, replayed")
    print_machine()
    workload = Workload(spans=200, outer=20, prefixes=5, tasks=20_000)
    with quiet_logs(), ReceiverProcess() as receiver:
        use_otel_env(receiver.env)
        config = {"distributed.scheduler.preload": ["dask_otel"],
                  "otel.spans.export-delay": "1h"}
        with dask.config.set(config):
            cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                   host="127.0.0.1", dashboard_address="127.0.0.1:0")
        try:
            with Client(cluster.scheduler_address) as client:
                mirror = cluster.scheduler.plugins[PLUGIN_NAME].mirror
                workload.run(client)
                time.sleep(1.5)  # a heartbeat from every worker: fine metrics are in
                mirror.config = dataclasses.replace(mirror.config, export_delay=0.0)

                def passes() -> tuple[list[float], int]:
                    if hasattr(mirror, "ledger"):
                        return ledger_passes()
                    # Taken on the event loop, between polls
                    check_known(mirror)
                    names = [n for n in STATE if hasattr(mirror, n)]
                    saved = {n: copy.copy(getattr(mirror, n)) for n in names}
                    if "open_groups" in saved:
                        saved["open_groups"] = {
                            tg: saved_batch(b) for tg, b in saved["open_groups"].items()
                        }
                    # Every open span and group is exported once per pass (the
                    # workload's traces are all sampled)
                    expected = len(saved["open_spans"]) + len(saved.get("open_groups", ()))
                    return timed_passes(
                        mirror, args.repeats, lambda: restore(mirror, saved), expected,
                        lambda: f"{len(mirror.open_spans)} spans, "
                        f"{len(getattr(mirror, 'open_groups', ()))} groups (see STATE, "
                        "NOT_STATE and BATCH_FIELDS)",
                    ), expected

                def ledger_passes() -> tuple[list[float], int]:
                    # Taken on the event loop, between polls
                    saved = saved_ledger(mirror.ledger)
                    expected = len(saved.records) + len(saved.groups)

                    def restore_ledger() -> None:
                        mirror.ledger = saved_ledger(saved)

                    return timed_passes(
                        mirror, args.repeats, restore_ledger, expected,
                        lambda: f"{len(mirror.ledger.records)} spans, "
                        f"{len(mirror.ledger.groups)} groups (state outside the Ledger?)",
                    ), expected

                sink = mirror.sink
                processors, sink.processors = sink.processors, []
                try:
                    per_span, n = run_on_loop(cluster, passes)
                except ReplayError as e:
                    print(f"\nreplay_export.py: {e}", file=sys.stderr)
                    return 1
                finally:
                    sink.processors = processors
        finally:
            cluster.close()
    print(f"\n== {n} OTel spans exported per pass, {len(per_span)} passes, GC off ==")
    print(f"  us per span: min {min(per_span):.1f}, median {statistics.median(per_span):.1f}, "
          f"max {max(per_span):.1f}")
    print("  passes: " + " ".join(f"{x:.1f}" for x in per_span))
    return 0


if __name__ == "__main__":
    sys.exit(main())
