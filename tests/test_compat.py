"""Tripwires for dask_otel/_compat.py: each private name the bridge reads still
exists in the installed Dask (a release that drops one fails here, not on a
user's cluster), and each version switch says what the installed version does.
Real in-process clusters (``gen_cluster``)."""

from __future__ import annotations

import asyncio

from distributed import span
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster, inc

from dask_otel import _compat


def dask_span(s, span_id):
    return s.extensions["spans"].spans[span_id]


@gen_cluster(client=True)
async def test_dask_span_keeps_its_own_fine_metrics_in_cumulative_worker_metrics(c, s, a, b):
    with span("metered") as span_id:
        await c.submit(inc, 1, key="metered-1")
    await asyncio.sleep(0)
    metered = dask_span(s, span_id)
    assert isinstance(metered._cumulative_worker_metrics, dict)
    assert _compat.span_own_metrics(metered) is metered._cumulative_worker_metrics


@gen_cluster(client=True)
async def test_dask_span_keeps_the_thread_count_history_active_cpu_seconds_reads(c, s, a, b):
    with span("threads") as span_id:
        await c.submit(inc, 1, key="threads-1")
    threads = dask_span(s, span_id)
    history, offset = _compat.span_nthreads_history(threads)
    assert history is threads._total_nthreads_history
    assert offset == threads._total_nthreads_offset and 0 <= offset < len(history)


@gen_cluster(client=True)
async def test_dask_remove_worker_lists_lost_keys_as_compat_says(c, s, a, b):
    events = []

    class Events(SchedulerPlugin):
        def log_event(self, topic, msg):
            events.append(msg)

    s.add_plugin(Events(), name="events")
    kept = c.submit(inc, 1, key="kept-1", workers=[a.address])
    await kept
    await s.remove_worker(a.address, stimulus_id="test", close=False)
    removed = next(e for e in events if isinstance(e, dict) and e.get("action") == "remove-worker")
    assert ("lost-computed-tasks" in removed) is _compat.REMOVE_WORKER_LISTS_LOST_KEYS


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_dask_task_function_finds_the_function_a_worker_runs(c, s, a):
    future = c.submit(inc, 1, key="inc-1")
    seen = []
    while not seen:
        ts = a.state.tasks.get("inc-1")
        if ts is not None:
            seen.append(_compat.task_function(ts.run_spec))
        await asyncio.sleep(0.001)
    await future
    assert seen[0] is inc
