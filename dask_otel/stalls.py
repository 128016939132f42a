"""Event loops blocked past Dask's limit, measured on every server by a callback of
the bridge's own (:func:`watch_loop`), a worker's told to the scheduler, where each is
a span event on the Dask spans it hit and a point of a histogram (:class:`Stalls`).
Every name of a stall is spelled here. docs/events.md "Blocked event loops"."""

from __future__ import annotations

from itertools import islice
from time import monotonic, time_ns
from typing import TYPE_CHECKING, Any

import dask.config
import distributed.core
from dask.utils import parse_timedelta
from opentelemetry.context import Context
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
#: :data:`MAX_KEYS`; ``_count``: all)
STALL_EVENT, STALL_DURATION = "dask.event_loop.blocked", "dask.event_loop.blocked.duration"
SERVER_KIND, TASKS_RUNNING, MAX_KEYS = "dask.server.kind", "dask.tasks.running", 20
#: Topic of a worker's report (``Worker.log_event``): ``{"duration": seconds,
#: "tasks": [running keys], "spans": [their Dask span ids]}``
STALL_TOPIC = "dask_otel.event-loop-blocked"
#: The histogram's bucket bounds, seconds: from a limit set low to a stall that
#: loses workers (distributed.comm.timeouts)
BUCKETS = (0.5, 1, 2, 3, 5, 10, 30, 60, 120, 300)


def watch_loop(blocked: Callable[[float], None]) -> PeriodicCallback:
    """Dask's own measurement, by a callback of the bridge's: ``blocked(seconds)``
    when a run of it comes later than ``distributed.admin.tick.limit`` after the one
    before, every ``distributed.admin.tick.interval``, on the current event loop"""
    # Dask's limit as distributed read it at import (a Nanny's worker gets its config
    # later): a stall here is one Dask logs as "Event loop was unresponsive"
    limit, last = distributed.core.tick_maximum_delay, [monotonic()]

    def measure() -> None:
        now = monotonic()
        late, last[0] = now - last[0], now
        if late > limit:
            try:
                blocked(late)
            except Exception:  # never into the loop
                logger.exception("dask_otel: could not record a blocked event loop")

    interval = parse_timedelta(dask.config.get("distributed.admin.tick.interval"), "ms")
    callback = PeriodicCallback(measure, interval * 1000)
    callback.start()
    return callback


def watch_worker(worker: Worker) -> PeriodicCallback:
    """Each stall of the worker's loop, with the tasks executing and their Dask spans,
    to the scheduler, on the stream of the worker's events, ahead of their results"""
    def tell(seconds: float) -> None:
        executing = list(worker.state.executing)
        worker.log_event(STALL_TOPIC, {
            "duration": seconds,
            "tasks": [str(ts.key) for ts in executing],
            "spans": list({ts.span_id for ts in executing if ts.span_id}),
        })

    return watch_loop(tell)


def _histogram(meter: Meter) -> Histogram:
    return meter.create_histogram(
        STALL_DURATION, unit="s", explicit_bucket_boundaries_advisory=list(BUCKETS),
        description="Event loops blocked past distributed.admin.tick.limit, by server kind")


class Stalls:
    """One scheduler's stalls, its own and its workers', until :meth:`stop`"""

    def __init__(self, mirror: SpanMirror, meter_provider: MeterProvider | None,
                 attributes: Mapping[str, Any]):
        self.mirror, self.attributes = mirror, dict(attributes)  # the servers' metric attributes
        self.histogram = of_provider(_histogram, meter_provider) if meter_provider else None
        self.watch = watch_loop(self.blocked)

    def observe(self, topic: str, msg: Any) -> None:
        self.blocked(float(msg["duration"]), msg)  # a worker's report: STALL_TOPIC

    def blocked(self, seconds: float, worker: Any = None) -> None:
        """An event loop blocked for ``seconds``: the scheduler's, or the one of the
        worker whose report is ``worker``; the point in the first workflow's trace"""
        kind = "scheduler" if worker is None else "worker"
        attributes: dict[str, Any] = {SERVER_KIND: kind, STALL_DURATION: seconds}
        leaves = None
        if worker is not None:
            keys = worker.get("tasks") or ()
            attributes[WORKER_ADDRESS] = str(worker.get("worker"))
            attributes[TASKS_RUNNING] = [str(k) for k in islice(keys, MAX_KEYS)]
            attributes[TASKS_RUNNING + "_count"] = len(keys)
            leaves = [str(span_id) for span_id in worker.get("spans") or ()]
        context = self.mirror.add_span_event(STALL_EVENT, attributes, time_ns(), leaves)
        if self.histogram is not None:
            self.histogram.record(seconds, {**self.attributes, SERVER_KIND: kind},
                                  context=in_context(context) or Context())

    def stop(self) -> None:
        self.watch.stop()
