"""The functions tests run as Dask tasks, defined once.

Dask names a TaskGroup (and so its OTel span) after the function's name: tests
assert on these names. Worker processes unpickle tasks by reference, so this
module imports nothing of the tests' own and only what a worker has (``dask
worker`` processes get the repository root on their ``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import numpy as np
from opentelemetry import trace

# --- arithmetic ---------------------------------------------------------------------


def inc(x):
    return x + 1


def double(x):
    return 2 * x


def square(x):
    return x * x


def total(xs):
    return sum(xs)


def slow(x, delay=0.5):
    time.sleep(delay)
    return x


def slow_inc(x, delay=0.2):
    time.sleep(delay)
    return x + 1


def nap(seconds):
    time.sleep(seconds)
    return seconds


def hold_gil(seconds):
    """Sleep in C holding the GIL (ctypes.PyDLL calls do not release it): the
    worker's event loop, in another thread of the process, cannot run"""
    import ctypes

    ctypes.PyDLL(None).usleep(int(seconds * 1e6))
    return seconds


def sleep_on_loop(seconds):
    """What a user's ``run_on_scheduler``/``Client.run`` of a blocking call does:
    sleeps in the event loop's thread, the function and its line on its stack"""
    time.sleep(seconds)
    return seconds


#: The objects of :func:`make_cycles`, until :func:`full_collection`
_CYCLES: list = []


def make_cycles(n):
    """``n`` pairs of lists in reference cycles, kept: a heap the collector must walk"""
    for _ in range(n):
        a, b = [], []
        a.append(b)
        b.append(a)
        _CYCLES.append(a)
    return len(_CYCLES)


def full_collection():
    """Drops what :func:`make_cycles` kept and runs a full collection: the
    collector frees every cycle (on the event loop, run by ``run_on_scheduler``)"""
    import gc

    _CYCLES.clear()
    return gc.collect()


def wait_for_event(name):
    """Block until the cluster's ``distributed.Event(name)`` is set"""
    from distributed import Event

    Event(name).wait()
    return name


# --- failures -----------------------------------------------------------------------


def fail(x):
    raise ValueError(f"bad {x}")


def fail_slowly(x, delay=0.3):
    time.sleep(delay)
    raise ValueError(f"bad {x}")


def die_once(marker: str) -> str:
    """Kill this worker process mid-task the first time; finish the second time"""
    from distributed import get_worker

    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(get_worker().address)
        os.kill(os.getpid(), signal.SIGKILL)
    return get_worker().address


# --- a small workflow (tests/test_wire.py) ------------------------------------------


def load(i):
    time.sleep(0.05)
    return list(range(i * 100))


def clean(xs):
    return [x for x in xs if x % 2]


def fit(parts):
    time.sleep(0.05)
    return sum(map(len, parts))


def broken(x):
    raise RuntimeError("diverged")


# --- data that spills: 4 MB chunks ----------------------------------------------------

#: One chunk of data: 4 MB, so that three of them pass a 10 MB spill target
CHUNK_BYTES = 4_000_000


def make_chunk(seed: int) -> np.ndarray:
    """4 MB of random floats (incompressible, so pickled size ~ sizeof)"""
    return np.random.default_rng(seed).random(CHUNK_BYTES // 8)


def sum_chunks(chunks: list[np.ndarray]) -> float:
    """Reads every chunk (unspilling those on disk)"""
    return float(sum(chunk.sum() for chunk in chunks))


# --- the OTel context a task runs in ---------------------------------------------------


def current_ids(*_):
    """(trace id, span id, sampled) of the current OTel span where this runs"""
    context = trace.get_current_span().get_span_context()
    return context.trace_id, context.span_id, context.trace_flags.sampled


def root_ids(*_):
    """current_ids under another key prefix: Dask attaches a task prefix to the span
    it was first submitted under (ARCHITECTURE: TaskGroup collision)"""
    return current_ids()


async def current_ids_async(*_):
    await asyncio.sleep(0)
    return current_ids()


def current_span_id(x):
    return trace.get_current_span().get_span_context().span_id


def fail_with_ids(*_):
    trace_id, span_id, _ = current_ids()
    raise ValueError(f"{trace_id:032x} {span_id:016x}")


def submit_subtask(*_):
    from distributed import worker_client

    with worker_client() as client:
        return client.submit(current_ids, "sub", pure=False).result()


def ids_and_baggage(*_):
    from opentelemetry import baggage

    return current_ids(), baggage.get_baggage("tenant")


def subtask_ids_and_baggage(*_):
    from distributed import worker_client

    with worker_client() as client:
        return client.submit(ids_and_baggage, "sub", pure=False).result()


def user_work(*_):
    """A span the task's own code makes, with the global TracerProvider"""
    with trace.get_tracer("x").start_as_current_span("user work"):
        return current_ids()


def global_provider_type(*_):
    provider = trace.get_tracer_provider()
    return f"{type(provider).__module__}.{type(provider).__name__}"


# --- log records written in tasks ---------------------------------------------------


def log_in_task(x):
    logging.getLogger("report").warning("scored partition %d", x)
    return x


def log_info_in_task(x):
    logger = logging.getLogger("report.info")
    logger.setLevel(logging.INFO)
    logger.info("quiet detail %d", x)
    return x


def warn_to(logger_name: str, message: str) -> str:
    """A WARNING to the logger ``logger_name``, from a task"""
    logging.getLogger(logger_name).warning(message)
    return message


def log_and_trace_in_task(*_):
    logging.getLogger("report").warning("inside the task")
    return user_work()


def warn_to_distributed_worker(x):
    """A line to Dask's own ``distributed.worker`` logger, which does not propagate"""
    logging.getLogger("distributed.worker").warning("task %d saw a slow disk", x)
    return x


# --- an instrumented HTTP call (tests/test_end_to_end.py) ----------------------------


def fetch_and_score(item: int, catalog: str) -> dict:
    """A task: an instrumented HTTP call to the catalog service, then some scoring.

    Returns the OTel context the task ran in and the one the call was made in.
    """
    import requests
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    RequestsInstrumentor().instrument()  # once per worker process; later calls are no-ops
    task_context = trace.get_current_span().get_span_context()
    price = requests.get(f"{catalog}/items/{item}", timeout=10).json()["price"]
    time.sleep(0.05)  # scoring
    return {"item": item, "score": price * 2, "task_span_id": f"{task_context.span_id:016x}"}


# --- Dask's events (tests/test_events.py) ---------------------------------------------


def exit_once(marker: str, x: int) -> int:
    """Kills its worker process (os._exit) the first time it runs, as a segfault in
    native code would; the rerun elsewhere returns ``x``"""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return x


async def exit_process(code: int = 1) -> None:
    """Kills the worker process it runs in, for ``Client.run(..., wait=False)``
    (which takes coroutine functions only): a worker lost with no task running"""
    os._exit(code)


def allocate_past(limit: int) -> int:
    """Grows its worker's resident memory to twice ``limit`` bytes, 16 MiB at a
    time, and holds it: its nanny terminates the worker on the way"""
    held = []
    while sum(map(len, held)) < 2 * limit:
        held.append(b"\x01" * (16 << 20))  # written: resident, unlike bytearray(n)
        time.sleep(0.02)
    time.sleep(30)
    return len(held)


def print_in_task(x: int) -> int:
    """distributed.print: logged as a ``print`` event on the scheduler"""
    import distributed

    distributed.print("scored partition", x)
    return x


def warn_in_task(x: int) -> int:
    """distributed.warn: logged as a ``warn`` event on the scheduler"""
    import distributed

    distributed.warn(f"partition {x} is skewed", UserWarning)
    return x



async def fail_hard(dask_worker) -> None:
    """Hands the worker's state machine a stimulus it cannot handle (free-keys
    without keys): ``Worker.handle_stimulus`` is ``@fail_hard``, so distributed
    logs ``worker-fail-hard``, then closes the worker, which logs ``closing-worker``
    (distributed 2024.1.0 to 2026.8.0 alike). For ``Client.run(..., wait=False)``"""
    from distributed.worker_state_machine import FreeKeysEvent

    dask_worker.handle_stimulus(FreeKeysEvent(keys=None, stimulus_id="fail-hard-test"))
