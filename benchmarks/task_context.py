"""What the bridge costs each task on a worker: the in-task OTel context
(dask_otel.worker.execute_hook) and task spans (dask_otel.worker.task_spans) at sample ratios
0, 0.01 and 1, against the same call without the bridge, in the same process.

A micro-benchmark of the ``execute`` wrapper on a real Worker: a real scheduler
and worker run in this process, a real graph inside a ``distributed.span`` leaves
its tasks (with Dask's own annotations) in ``worker.state.tasks``, and then the
wrapper is timed around a stand-in for ``Worker.execute`` that returns the
ExecuteSuccessEvent at once, so that only what the bridge adds is measured:
looking the task up, its cached context, attach/detach, choosing by key, and
(task spans) building the ReadableSpan and handing it to a BatchSpanProcessor
whose exporter drops everything (the export thread's CPU is not on the task's
path). "none" is the stand-in awaited directly.

Target (issue 8): < 5 us per task for the context.

Usage::

    python -m benchmarks.task_context                       # 20,000 tasks, 7 rounds
    python -m benchmarks.task_context --tasks 200 --rounds 1 # a smoke run
    python -m benchmarks.task_context --block dask_otel      # tasks of a dask_otel.span
                                                            # block (an otel annotation)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from distributed import Client, Scheduler, Worker, span
from distributed.worker_state_machine import ExecuteSuccessEvent


def inc(x):
    return x + 1


class DroppingExporter:
    """A SpanExporter that accepts and forgets everything"""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def span_sink():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from dask_otel.export.sink import SpanSink, span_limits

    limits = span_limits()
    provider = TracerProvider(span_limits=limits, shutdown_on_exit=False)
    processor = BatchSpanProcessor(DroppingExporter())
    provider.add_span_processor(processor)
    return SpanSink(provider, [processor], limits), provider


def variants(worker: Worker, sink, sampler):
    """name -> an ``execute`` to time: the stand-in, bare or wrapped"""
    from dask_otel.config import read_config
    from dask_otel.worker.execute_hook import TaskContextHook
    from dask_otel.worker.task_context import TaskContexts
    from dask_otel.worker.task_spans import TaskRules, TaskSpans

    events = {}

    async def stand_in(key, *, stimulus_id):
        return events[key]

    for key in worker.state.tasks:
        events[key] = ExecuteSuccessEvent(
            key=key, run_id=1, value=None, start=time.time(), stop=time.time() + 1e-3,
            nbytes=28, type=int, stimulus_id="bench",
        )

    def wrapped(rules):
        task_spans = None if rules is None else TaskSpans(worker, sink)
        hook = TaskContextHook(worker, TaskContexts(sampler, rules), task_spans)
        hook.wrap(stand_in)
        execute = worker.execute
        del worker.execute  # each variant wraps the stand-in afresh
        return execute

    out = {"none": stand_in, "context": wrapped(None)}
    base = read_config()
    for ratio in (0.0, 0.01, 1.0):
        config = base.__class__(**{**base.__dict__, "task_spans": True,
                                   "task_sample_ratio": ratio, "task_erred": True})
        out[f"task spans, ratio {ratio:g}"] = wrapped(TaskRules.of(config))
    return out


async def time_per_task(execute, keys) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for key in keys:
            await execute(key, stimulus_id="bench")
        return (time.perf_counter() - start) / len(keys)
    finally:
        gc.enable()


async def main(n_tasks: int, rounds: int, block: str = "distributed") -> None:
    import dask_otel
    from dask_otel.worker.task_context import default_sampler

    # dask_otel.span writes the otel annotation each task then reads: with no
    # controls (sampled=, tasks=) it must cost what it did before them
    open_block = span if block == "distributed" else dask_otel.span

    async with Scheduler(dashboard_address="127.0.0.1:0", host="127.0.0.1") as scheduler:
        async with Worker(scheduler.address, nthreads=1) as worker:
            async with Client(scheduler.address, asynchronous=True) as client:
                with open_block("bench"):
                    futures = client.map(inc, range(n_tasks))
                    await client.gather(futures)
                keys = list(worker.state.tasks)
                sink, provider = span_sink()
                execs = variants(worker, sink, default_sampler())
                results: dict[str, list[float]] = {name: [] for name in execs}
                for _ in range(rounds):
                    for name, execute in execs.items():  # interleaved: drift hits all
                        results[name].append(await time_per_task(execute, keys))
                provider.shutdown()
                del futures

    none = statistics.median(results["none"])
    print(f"{len(keys)} tasks x {rounds} rounds; median (min-max) per task, "
          "and added over 'none'")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:24s} {med * 1e6:7.2f} us ({min(values) * 1e6:.2f}-{max(values) * 1e6:.2f})"
              f"  +{(med - none) * 1e6:6.2f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", choices=("distributed", "dask_otel"), default="distributed")
    args = parser.parse_args()
    asyncio.run(main(args.tasks, args.rounds, args.block))
