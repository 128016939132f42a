"""Event loops blocked past Dask's limit and their cause, measured on every server
(:class:`LoopWatch`), a worker's told to the scheduler, where each is a span event on
the Dask spans it hit, a log record and a point of a histogram (:class:`Stalls`).
Every name of a stall is spelled here. docs/events.md "Blocked event loops"."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from itertools import islice
from time import monotonic, time_ns
from traceback import format_stack
from typing import TYPE_CHECKING, Any

import dask.config
import distributed.core
from dask.utils import parse_timedelta
from opentelemetry.context import Context
from opentelemetry.semconv.attributes.code_attributes import CODE_STACKTRACE
from tornado.ioloop import PeriodicCallback

from dask_otel.attributes import WORKER_ADDRESS
from dask_otel.export.instruments import of_provider
from dask_otel.log import logger
from dask_otel.span_context import in_context

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from distributed import Worker
    from opentelemetry.metrics import Histogram, Meter, MeterProvider

    from dask_otel.spans import SpanMirror

#: The span event; its length in seconds, also the histogram; whose loop
#: (``scheduler``, ``worker``); the keys a blocked worker was running (the first
#: :data:`MAX_KEYS`; ``_count``: all); the collector's pauses' share of it; the
#: loop thread's stack (``code.stacktrace``): its innermost :data:`MAX_FRAMES` frames
STALL_EVENT, STALL_DURATION = "dask.event_loop.blocked", "dask.event_loop.blocked.duration"
SERVER_KIND, TASKS_RUNNING, MAX_KEYS = "dask.server.kind", "dask.tasks.running", 20
GC_SHARE, MAX_FRAMES = "dask.event_loop.blocked.gc_share", 16
#: Topic of a worker's report (``Worker.log_event``) and of a stall's log record:
#: ``{"duration": seconds, "tasks": [keys], "spans": [their span ids], "cause": {...}}``
STALL_TOPIC = "dask_otel.event-loop-blocked"
#: The histogram's bucket bounds, seconds: from a limit set low to a stall that
#: loses workers (distributed.comm.timeouts)
BUCKETS = (0.5, 1, 2, 3, 5, 10, 30, 60, 120, 300)


class LoopWatch(PeriodicCallback):
    """Dask's own measurement, by a callback of the bridge's every tick interval on the
    current loop: ``blocked(seconds, cause)`` when one comes past the tick limit after
    the one before. The cause: the loop thread's longest-lasting stack, read by a
    watchdog thread asleep until a tick is overdue, then each time the stall grew by a
    quarter (or where a collection past the limit ran on the loop's thread), and the
    collector's pauses' share (a ``gc.callbacks`` entry). Nothing more on the loop."""

    def __init__(self, blocked: Callable[[float, dict[str, Any]], None]):
        # Dask's limit as distributed read it at import (a Nanny's worker gets its config
        # later): a stall here is one Dask logs as "Event loop was unresponsive"
        self.limit, self.last = distributed.core.tick_maximum_delay, monotonic()
        self.blocked, self.thread, self.done = blocked, threading.get_ident(), threading.Event()
        self.stacks: list[tuple[float, str, float]] = []  # (the tick before, stack, seconds)
        self.gc_began = self.gc_ended = self.gc_seconds = 0.0
        interval = parse_timedelta(dask.config.get("distributed.admin.tick.interval"), "ms")
        super().__init__(self.measure, interval * 1000)
        gc.callbacks.append(self.timed)
        threading.Thread(target=self.watch, name="dask_otel-stalls", daemon=True).start()
        self.start()

    def measure(self) -> None:
        now = monotonic()
        began, self.last = self.last, now
        if now - began > self.limit:
            weights: dict[str, float] = {}  # stack -> the seconds it stands for
            for at, stack, seconds in self.stacks:
                weights[stack] = weights.get(stack, 0.0) + seconds * (at == began)
            self.stacks, stack = [], max(weights, key=weights.__getitem__, default="")
            paused = self.gc_seconds if self.gc_ended > began else 0.0
            try:
                self.blocked(now - began, {GC_SHARE: round(min(paused / (now - began), 1), 3), **(
                    {CODE_STACKTRACE: stack} if weights.get(stack) else {})})
            except Exception:  # never into the loop
                logger.exception("dask_otel: could not record a blocked event loop")

    def watch(self) -> None:
        while True:
            began, now = self.last, monotonic()
            if self.done.wait(max(began + self.limit - now, (now - began) / 4)):
                return
            frame = sys._current_frames().get(self.thread)
            if frame is not None and self.last == began and monotonic() - began > self.limit:
                self.stacks.append((began, "".join(format_stack(frame, MAX_FRAMES)),
                                    (monotonic() - began) / 4))  # till the next read

    def timed(self, phase: str, info: dict) -> None:
        now = monotonic()
        if phase == "start":
            self.gc_began = now
            return
        since = self.gc_seconds if self.gc_ended >= self.last else 0.0  # since the last tick
        self.gc_seconds, self.gc_ended = since + now - max(self.gc_began, self.last), now
        if now - self.gc_began > self.limit and threading.get_ident() == self.thread:
            stack = "".join(format_stack(sys._getframe(1), MAX_FRAMES))
            self.stacks.append((self.last, stack, now - self.gc_began))

    def stop(self) -> None:
        super().stop()
        self.done.set()
        gc.callbacks[:] = [c for c in gc.callbacks if c != self.timed]


def watch_worker(worker: Worker) -> LoopWatch:
    """Each stall of the worker's loop, its cause, the tasks executing and their Dask
    spans, to the scheduler, on the stream of the worker's events, ahead of their results"""
    def tell(seconds: float, cause: dict[str, Any]) -> None:
        executing = list(worker.state.executing)
        worker.log_event(STALL_TOPIC, {
            "duration": seconds,
            "tasks": [str(ts.key) for ts in executing],
            "spans": list({ts.span_id for ts in executing if ts.span_id}),
            "cause": cause,
        })

    return LoopWatch(tell)


def _histogram(meter: Meter) -> Histogram:
    return meter.create_histogram(
        STALL_DURATION, unit="s", explicit_bucket_boundaries_advisory=list(BUCKETS),
        description="Event loops blocked past distributed.admin.tick.limit, by server kind")


class Stalls:
    """One scheduler's stalls, its own and its workers', until :meth:`stop`"""

    def __init__(self, mirror: SpanMirror | None, meter_provider: MeterProvider | None,
                 attributes: Mapping[str, Any], events: Any):
        self.mirror, self.attributes = mirror, dict(attributes)  # the servers' metric attributes
        self.histogram = of_provider(_histogram, meter_provider) if meter_provider else None
        self.events, self.watch = events, LoopWatch(self.blocked)

    def observe(self, topic: str, msg: Any) -> None:
        self.blocked(float(msg["duration"]), msg.get("cause") or {}, msg)  # STALL_TOPIC

    def blocked(self, seconds: float, cause: Mapping[str, Any], worker: Any = None) -> None:
        """An event loop blocked for ``seconds``: the scheduler's, or the one of the
        worker whose report is ``worker``; the point in the first workflow's trace"""
        kind = "scheduler" if worker is None else "worker"
        attributes: dict[str, Any] = {SERVER_KIND: kind, STALL_DURATION: seconds, **cause}
        leaves, mirror = None, self.mirror
        if worker is not None:
            keys = worker.get("tasks") or ()
            attributes[WORKER_ADDRESS] = str(worker.get("worker"))
            attributes[TASKS_RUNNING] = [str(k) for k in islice(keys, MAX_KEYS)]
            attributes[TASKS_RUNNING + "_count"] = len(keys)
            leaves = [str(span_id) for span_id in worker.get("spans") or ()]
        context = mirror and mirror.add_span_event(STALL_EVENT, attributes, time_ns(), leaves)
        if STALL_TOPIC in self.events.topics:  # a log record
            self.events.emit(STALL_TOPIC, logging.WARNING, f"{kind} event loop blocked for "
                             f"{seconds:.2f} s", {**attributes}, context)
        if self.histogram is not None:
            self.histogram.record(seconds, {**self.attributes, SERVER_KIND: kind},
                                  context=in_context(context) or Context())

    def stop(self) -> None:
        self.watch.stop()
