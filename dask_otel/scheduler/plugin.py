"""The scheduler plugin: Dask's hooks in, each dispatched once to the span mirror
(:mod:`dask_otel.spans`), the metrics and the events out. Added once per scheduler
whichever path asks (:func:`add_bridge`); it registers the worker plugin. It never
raises into Dask: an error is logged, kept in ``.error`` (:func:`dask_otel.status`).
docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time
from tornado.ioloop import IOLoop, PeriodicCallback

from dask_otel.annotation import BLOCK_EXIT
from dask_otel.attributes import SCHEDULER_ADDRESS
from dask_otel.config import SCHEDULER, ConfigError
from dask_otel.export.lifecycle import release_telemetry, start_telemetry
from dask_otel.log import logger
from dask_otel.scheduler import blocks
from dask_otel.scheduler.blocks import CLIENT_GONE_GRACE
from dask_otel.spans import SpanMirror
from dask_otel.stalls import STALL_TOPIC, Stalls
from dask_otel.worker.plugin import PLUGIN_NAME, dumps_by_value, server_status

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_otel.config import OtelConfig
    from dask_otel.export.telemetry import ServerTelemetry, Telemetry
    from dask_otel.scheduler.events import DaskEvents
    from dask_otel.scheduler.metrics import SchedulerMetrics

#: The transitions the mirror times besides leaving ``processing``
_TIMED = frozenset(("processing", "erred"))


class OtelSchedulerPlugin(SchedulerPlugin):
    """Mirrors the scheduler's Dask spans and metrics into OpenTelemetry"""

    name = PLUGIN_NAME
    #: ``Client.register_plugin`` does nothing if the preload already added one
    idempotent = True

    #: Why the bridge is off on this scheduler, if it is; None when all is well
    error: str | None = None
    #: The process's Telemetry (shared with the other Dask servers in it), and
    #: this scheduler's share of it (config, span resource, metric attributes)
    telemetry: Telemetry | None = None
    server_telemetry: ServerTelemetry | None = None
    #: The span mirror (None: traces and metrics are off; ``mirror.sink`` None:
    #: traces are off, its records make the workflow outcomes)
    mirror: SpanMirror | None = None
    #: The fine and self-metrics (None: metrics are off); Dask's own families
    metrics: SchedulerMetrics | None = None
    families: Any = None
    #: Dask's events out as log records, span events and removed workers
    events: DaskEvents | None = None
    _poller: PeriodicCallback | None = None
    #: Blocked event loops (None: traces, metrics and logs are off)
    stalls: Stalls | None = None
    _started = _closed = False

    def __init__(self, path: str = "client") -> None:
        #: Which ways of turning the bridge on asked for it here, the one that
        #: added it first: ``instrumentor``, ``preload``, ``client``
        self.paths = [path]

    async def start(self, scheduler: Scheduler) -> None:
        # Idempotent: the preload registers the plugin while the scheduler is
        # starting, and the scheduler then starts every plugin it holds.
        if self._started:
            return
        self._started = True
        self.scheduler = scheduler
        own, self.error = start_telemetry(f"scheduler {scheduler.address}",
                                          **{SCHEDULER_ADDRESS: scheduler.address})
        if own is None:
            return
        self.server_telemetry, self.telemetry = own, own.telemetry
        config: OtelConfig = own.config
        try:
            outcomes = None
            if (provider := own.telemetry.meter_provider) is not None:
                from dask_otel.export.dask_families import DaskFamilies, families_wanted
                from dask_otel.scheduler.metrics import SchedulerMetrics
                from dask_otel.scheduler.outcomes import Outcomes

                outcomes = Outcomes(provider, own.metric_attributes, config.workflows,
                                    config.metric_labels)
                if families_wanted(own):
                    self.families = DaskFamilies(scheduler, own)
            logs = own.telemetry.logs
            if own.span_sink is not None or outcomes is not None or logs is not None:
                # Traces, the workflow outcomes made of its records, the runs started
                self.mirror = SpanMirror(scheduler, own.span_sink, config, outcomes)
                self._poller = PeriodicCallback(self._poll, config.poll_interval * 1000)
                self._poller.start()
                if provider is not None:  # metrics on: the mirror runs
                    self.metrics = SchedulerMetrics(scheduler, own, self.mirror)
                from dask_otel.scheduler.events import DaskEvents

                self.events = DaskEvents(
                    scheduler, self.mirror, logs.provider if logs is not None else None,
                    config.event_topics, config.logs_level, outcomes, config.errors_messages,
                )
                self.stalls = Stalls(self.mirror, provider, own.metric_attributes, self.events)
        except ConfigError as e:  # an OTEL_* variable the SDK refused, named
            logger.error("dask_otel is off on scheduler %s: %s", scheduler.address, e)
            self.error = f"ConfigError: {e}"
        except Exception as e:
            logger.exception("dask_otel: could not start on scheduler")
            self.error = f"{type(e).__name__}: {e}"
        try:
            await scheduler.register_worker_plugin(None, dumps_by_value(), name=PLUGIN_NAME,
                                                   idempotent=True)
        except Exception:
            # The workers then export no spill metrics; the scheduler goes on
            logger.exception("dask_otel: could not register the worker plugin")

    def _poll(self) -> None:
        if self._closed:  # a poll queued with add_callback before close()
            return
        more = _guarded(self.mirror.poll)  # type: ignore[union-attr]
        if more and not self._closed:
            # Many spans finished at once: go on after the loop has run other work
            IOLoop.current().add_callback(self._poll)

    def update_graph(self, scheduler: Scheduler, *, tasks: Any = (), keys: Any = (),
                     client: Any = None, **kwargs: Any) -> None:
        if (mirror := self.mirror) is not None:
            known = mirror.ledger.spans_seen  # the Dask spans past it are the graph's new ones
            _guarded(mirror.observe_graph, tasks, keys, client)
            if self.events is not None and mirror.ledger.spans_seen > known:
                _guarded(self.events.runs_started, known)

    def transition(self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str = "",
                   **kwargs: Any) -> None:
        # Called for every transition of every task: keep the common path two
        # tests. stimulus_id by name, as Dask passes it: no kwargs dict to build.
        # The scheduler's own clock when it sends a task and hears back from it
        # bounds the times the worker reports (totals.observed).
        if (mirror := self.mirror) is None or (start != "processing" and finish not in _TIMED):
            return
        try:
            if start == "processing" or finish == "processing":
                mirror.observe_processing(key, finish == "processing")  # sent?
            if finish == "erred":
                mirror.observe_erred(key, kwargs.get("startstops"))
        except Exception:
            logger.exception("dask_otel: could not observe task %r", key)

    def log_event(self, topic: Any, msg: Any) -> None:
        # Every event on every topic (Dask's broker calls it): a test or two when off.
        # A client left a dask_otel.span block (dask_otel.client)
        if topic == BLOCK_EXIT:
            if self.mirror is not None:
                _guarded(blocks.observe_exit, self.mirror.ledger, self.mirror.dask_spans, msg)
            return
        # None after close: the workers' closing events would meet a shut provider
        observed = self.stalls if topic == STALL_TOPIC else self.events
        if observed is not None and not self._closed:
            _guarded(observed.observe, topic, msg)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        # The exits of the blocks it left last may still come: they wait
        # (blocks.CLIENT_GONE_GRACE), then those still open are over
        if self.mirror is None or self._closed:
            return
        _guarded(blocks.observe_client_leaving, self.mirror.ledger, client, time())
        try:
            IOLoop.current().call_later(CLIENT_GONE_GRACE, self._client_gone, client)
        except Exception:  # no event loop to wait on: at once
            self._client_gone(client)

    def _client_gone(self, client: str) -> None:
        if self.mirror is None or self._closed:
            return  # closing exports what is open, unfinished
        _guarded(blocks.observe_client_gone, self.mirror.ledger, client)

    async def close(self) -> None:
        """Export what is still open and flush, within otel.flush-timeout"""
        if self._closed:
            return
        self._closed = True
        # Each step on its own: Dask's plugin.close re-raises, and one failing step
        # must not keep the others (above all the release) from running
        for part, step in (("stalls", "stop"), ("_poller", "stop"), ("mirror", "flush"),
                           ("families", "close"), ("metrics", "close")):
            if (running := getattr(self, part)) is not None:
                try:
                    getattr(running, step)()
                except Exception:
                    logger.exception("dask_otel: %s.%s failed while closing", part, step)
        if self.telemetry is not None:
            try:
                await release_telemetry(self.telemetry, getattr(self.mirror, "builder", None))
            except Exception:
                logger.exception("dask_otel: could not release telemetry")

    def status(self) -> dict[str, Any]:
        """What :func:`dask_otel.status` reports for the scheduler"""
        mirror = self.mirror
        return server_status(
            self.error, self.server_telemetry, SCHEDULER,
            # who turned it on (first), and who asked again and found it there
            paths=list(self.paths),
            traces=mirror is not None and mirror.sink is not None,
            metrics=self.metrics is not None,
            open_spans=len(mirror.ledger.records) if mirror else 0,
            open_groups=len(mirror.ledger.groups) if mirror else 0,
            mirrored_spans=mirror.mirrored if mirror else 0,
            sampled_out_spans=mirror.sampled_out if mirror else 0,
            queue_full_dropped_spans=mirror.builder.dropped if mirror and mirror.builder else 0,
        )


def _guarded(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` from a Dask hook: what it raises is logged, never raised into Dask"""
    try:
        return call(*args)
    except Exception:
        logger.exception("dask_otel: %s failed", getattr(call, "__qualname__", call))
        return None


def add_bridge(scheduler: Scheduler, path: str) -> OtelSchedulerPlugin:
    """One bridge per scheduler, whichever paths ask: add the plugin (started
    with the scheduler), or note ``path`` on the one already there"""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, OtelSchedulerPlugin):
        note_path(scheduler, path)
        return plugin
    plugin = OtelSchedulerPlugin(path)
    scheduler.add_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    return plugin


def note_path(scheduler: Scheduler, path: str) -> None:
    """Note that ``path`` asked for the bridge already on ``scheduler``"""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, OtelSchedulerPlugin) and path not in plugin.paths:
        plugin.paths.append(path)


def preload_trap(scheduler: Scheduler) -> str | None:
    """Why a scheduler whose dask config names the ``dask_otel`` preload has no
    bridge, if that is the case: a ``--preload`` of something else (or
    ``Scheduler(preload=...)``) makes Dask ignore ``distributed.scheduler.preload``
    (``Scheduler.__init__`` reads it only when no preload is given)."""
    if PLUGIN_NAME in scheduler.plugins:
        return None
    configured = dask.config.get("distributed.scheduler.preload", None) or []
    if isinstance(configured, str):
        configured = [configured]
    started = [preload.name for preload in scheduler.preloads]
    if "dask_otel" not in configured or "dask_otel" in started:
        return None
    return (
        f"scheduler {scheduler.address}: distributed.scheduler.preload names dask_otel, "
        f"but the scheduler was given --preload {' '.join(started)}, which makes Dask "
        "ignore that key: the bridge is off. Name both on the command line "
        "(--preload dask_otel), start it under opentelemetry-instrument, or call "
        "dask_otel.instrument(client)"
    )
