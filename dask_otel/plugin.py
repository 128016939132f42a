"""Scheduler and worker plugins: wiring, lifecycle, flush on close.

The scheduler plugin owns the span mirror and the scheduler's metrics; on start it
registers the worker plugin with the scheduler, which hands it to every current
and future worker. Neither plugin ever raises into Dask: a bad configuration or
a broken exporter is logged at ERROR, kept in ``.error`` for inspection
(:func:`dask_otel.status`), and the cluster runs on without telemetry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from tornado.ioloop import IOLoop, PeriodicCallback

from dask_otel.config import ConfigError, read_config
from dask_otel.telemetry import Telemetry
from dask_otel.spans import SpanMirror
from dask_otel.worker_shim import dumps_by_value

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

logger = logging.getLogger("dask_otel")

#: Name of both plugins in ``Scheduler.plugins``, ``Scheduler.worker_plugins`` and
#: ``Worker.plugins``
PLUGIN_NAME = "dask-otel"


async def _release_telemetry(telemetry: Telemetry) -> None:
    """Detach from the process's Telemetry, flushing if this was the last user.

    The SDK's flush does not stop an export that is retrying against a dead or
    hung collector, so it runs in a daemon thread and the Dask server waits for
    it at most otel.flush-timeout: shutdown is never held longer than that.
    """
    timeout = telemetry.config.flush_timeout
    thread = threading.Thread(
        target=Telemetry.release, args=(telemetry,), name="dask_otel-flush", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        # `dask worker` cancels its tasks on a second Ctrl-C; re-raising here would
        # abandon Dask's own close half-way (the worker then hangs). The flush goes
        # on in its daemon thread.
        return
    if thread.is_alive():
        logger.warning(
            "dask_otel: telemetry not flushed within otel.flush-timeout=%ss; "
            "what was still queued is dropped",
            timeout,
        )


def _start_telemetry(server: str, **resource: Any) -> tuple[Telemetry | None, str | None]:
    """Read config and attach to this process's Telemetry; never raises"""
    try:
        config = read_config()
        if not config.enabled:
            logger.info("dask_otel: otel.enabled is false on %s; not exporting", server)
            return None, None
        return Telemetry.acquire(config, **resource), None
    except ConfigError as e:  # names the key and the value
        logger.error("dask_otel is off on %s: %s", server, e)
        return None, f"ConfigError: {e}"
    except Exception as e:
        # Never a bare exception text ("'otel'" for a KeyError): say what failed
        logger.exception("dask_otel is off on %s: could not start telemetry", server)
        return None, f"could not start telemetry: {type(e).__name__}: {e}"


class OtelSchedulerPlugin(SchedulerPlugin):
    """Mirrors the scheduler's Dask spans and metrics into OpenTelemetry"""

    name = PLUGIN_NAME
    #: ``Client.register_plugin`` does nothing if the preload already added one
    idempotent = True

    #: Why the bridge is off on this scheduler, if it is; None when all is well
    error: str | None
    telemetry: Telemetry | None
    mirror: SpanMirror | None

    def __init__(self) -> None:
        self.error = None
        self.telemetry = None
        self.mirror = None
        self.metrics: Any = None
        self._poller: PeriodicCallback | None = None
        self._started = False
        self._closed = False

    async def start(self, scheduler: Scheduler) -> None:
        # Idempotent: the preload registers the plugin while the scheduler is
        # starting, and the scheduler then starts every plugin it holds.
        if self._started:
            return
        self._started = True
        self.scheduler = scheduler
        self.telemetry, self.error = _start_telemetry(
            f"scheduler {scheduler.address}",
            **{"dask.scheduler.address": scheduler.address},
        )
        if self.telemetry is None:
            return
        config = self.telemetry.config
        try:
            if self.telemetry.spans is not None:
                self.mirror = SpanMirror(scheduler, self.telemetry, config)
                self._poller = PeriodicCallback(self._poll, config.poll_interval * 1000)
                self._poller.start()
            if self.telemetry.meter_provider is not None:
                from dask_otel.metrics import SchedulerMetrics

                self.metrics = SchedulerMetrics(scheduler, self.telemetry, self)
        except ConfigError as e:  # an OTEL_* variable the SDK refused, named
            logger.error("dask_otel is off on scheduler %s: %s", scheduler.address, e)
            self.error = f"ConfigError: {e}"
        except Exception as e:
            logger.exception("dask_otel: could not start on scheduler")
            self.error = f"{type(e).__name__}: {e}"
        try:
            await scheduler.register_worker_plugin(
                None, dumps_by_value(), name=PLUGIN_NAME, idempotent=True
            )
        except Exception:
            # The workers then export no spill metrics; the scheduler goes on
            logger.exception("dask_otel: could not register the worker plugin")

    def _poll(self) -> None:
        if self._closed:  # a poll queued with add_callback before close()
            return
        try:
            more = self.mirror.poll()  # type: ignore[union-attr]
        except Exception:
            logger.exception("dask_otel: span poll failed")
            return
        if more and not self._closed:
            # Many spans finished at once: go on after the loop has run other work
            IOLoop.current().add_callback(self._poll)

    def update_graph(self, scheduler: Scheduler, *, tasks: Any = (), **kwargs: Any) -> None:
        if self.mirror is not None:
            try:
                self.mirror.observe_graph(tasks)
            except Exception:
                logger.exception("dask_otel: could not observe graph")

    def transition(
        self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str = "", **kwargs: Any
    ) -> None:
        # Called for every transition of every task: keep the common path one test.
        # stimulus_id by name, as Dask passes it: no kwargs dict to build (~60 ns).
        if finish == "erred" and self.mirror is not None:
            try:
                self.mirror.observe_erred(key)
            except Exception:
                logger.exception("dask_otel: could not count erred task")

    async def close(self) -> None:
        """Export what is still open and flush, within otel.flush-timeout"""
        if self._closed:
            return
        self._closed = True
        # Each step on its own: Dask's plugin.close re-raises, and one failing step
        # must not keep the others (above all the release) from running
        for step in (self._stop_polling, self._flush_spans, self._close_metrics):
            try:
                step()
            except Exception:
                logger.exception("dask_otel: %s failed while closing", step.__name__)
        if self.telemetry is not None:
            try:
                await _release_telemetry(self.telemetry)
            except Exception:
                logger.exception("dask_otel: could not release telemetry")

    def _stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.stop()

    def _flush_spans(self) -> None:
        if self.mirror is not None:
            self.mirror.flush()

    def _close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def status(self) -> dict[str, Any]:
        """What :func:`dask_otel.status` reports for the scheduler"""
        mirror = self.mirror
        return {
            "error": self.error,
            "traces": mirror is not None,
            "metrics": self.metrics is not None,
            "open_spans": len(mirror.open_spans) if mirror else 0,
            "open_groups": len(mirror.open_groups) if mirror else 0,
            "mirrored_spans": mirror.mirrored if mirror else 0,
            "spans_delivered": sum(e.spans_exported for e in self._export_stats),
            "spans_failed": sum(e.spans_failed for e in self._export_stats),
            "export_failures": sum(e.export_failures for e in self._export_stats),
        }

    @property
    def _export_stats(self) -> list:
        return self.telemetry.export_stats if self.telemetry is not None else []


class OtelWorkerPlugin(WorkerPlugin):
    """On each worker: the OTel context tasks run in, and the SpillBuffer state as
    OpenTelemetry metrics"""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.error: str | None = None
        self.telemetry: Telemetry | None = None
        self.spill: Any = None
        #: :class:`dask_otel.task_context.TaskContextHook`; None where it could
        #: not be installed
        self.task_context: Any = None

    def setup(self, worker: Worker) -> None:
        self.telemetry, self.error = _start_telemetry(
            f"worker {worker.address}",
            **{"dask.scheduler.address": worker.scheduler.address},
        )
        if self.telemetry is None:
            return
        for step in (self._start_task_context, self._start_spill):
            try:
                step(worker, self.telemetry)
            except Exception as e:
                logger.exception("dask_otel: could not start on worker %s", worker.address)
                self.error = f"{type(e).__name__}: {e}"

    def _start_task_context(self, worker: Worker, telemetry: Telemetry) -> None:
        from dask_otel.task_context import start_task_context

        self.task_context = start_task_context(worker, telemetry)

    def _start_spill(self, worker: Worker, telemetry: Telemetry) -> None:
        if telemetry.meter_provider is None:
            return
        from dask_otel.spill import SpillInstruments

        self.spill = SpillInstruments.observe(worker, telemetry)

    async def teardown(self, worker: Worker) -> None:
        if self.task_context is not None:
            self.task_context.uninstall()
            self.task_context = None
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        if self.telemetry is not None:
            telemetry, self.telemetry = self.telemetry, None
            await _release_telemetry(telemetry)

    def status(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "metrics": self.spill is not None,
            "task_context": self.task_context is not None,
        }
