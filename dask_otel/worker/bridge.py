"""The bridge on one worker, started by the registered plugin: the worker's share
of its process's telemetry, the OTel context tasks run in (with task spans), the
SpillBuffer instruments, Dask's own families, and its blocked event loop told to the
scheduler (:mod:`dask_otel.stalls`). A feature that fails to start is logged and
shown in ``status()``; the others run. docs/traces.md, docs/metrics.md, docs/events.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.core import Status

from dask_otel.attributes import SCHEDULER_ADDRESS
from dask_otel.export.global_provider import adopt_global_tracer_provider
from dask_otel.export.lifecycle import (release_telemetry, release_telemetry_in_background,
                                        start_telemetry)
from dask_otel.log import logger
from dask_otel.spill import ObservedWorker
from dask_otel.stalls import watch_worker
from dask_otel.worker.execute_hook import TaskContextHook
from dask_otel.worker.task_context import TaskContexts, default_sampler
from dask_otel.worker.task_spans import TaskRules, TaskSpans

if TYPE_CHECKING:
    from distributed import Worker

    from dask_otel.export.telemetry import ServerTelemetry


@dataclass(slots=True)
class WorkerBridge:
    """What :class:`~dask_otel.worker.plugin.OtelWorkerPlugin` runs on one worker"""

    #: why the bridge (or a feature of it) is off on this worker
    error: str | None = None
    #: this worker's share of its process's Telemetry (its own config, span
    #: resource and metric attributes)
    server_telemetry: ServerTelemetry | None = None
    spill: Any = None
    #: :class:`~dask_otel.export.dask_families.DaskFamilies`, with otel.metrics.dask
    families: Any = None
    #: :class:`~dask_otel.worker.execute_hook.TaskContextHook`; None where it
    #: could not be installed
    task_context: Any = None
    #: :class:`~dask_otel.stalls.LoopWatch`
    stalls: Any = None

    def setup(self, worker: Worker) -> None:
        own, self.error = start_telemetry(f"worker {worker.address}",
                                          **{SCHEDULER_ADDRESS: worker.scheduler.address})
        if own is None:
            return
        self.server_telemetry = own
        for step in (self._start_task_context, self._start_spill, self._start_families,
                     self._start_stalls):
            try:
                step(worker, own)
            except Exception as e:
                logger.exception("dask_otel: could not start on worker %s", worker.address)
                self.error = f"{type(e).__name__}: {e}"

    def _start_task_context(self, worker: Worker, own: ServerTelemetry) -> None:
        """Wrap ``Worker.execute``, with the sampler the scheduler's mirror asks too
        (the bridge's TracerProvider's, else the SDK's default from OTEL_*). Task
        spans, by the worker's rules or a client block's, need an exporter."""
        if (sink := own.span_sink) is None:
            self.task_context = TaskContextHook.install(worker, TaskContexts(default_sampler()))
            return
        adopt_global_tracer_provider()  # user spans inside tasks need a provider
        self.task_context = TaskContextHook.install(
            worker, TaskContexts(sink.sampler, TaskRules.of(own.config), own.config.keep_erred),
            TaskSpans(worker, sink, own.config.errors_messages),
        )

    def _start_spill(self, worker: Worker, own: ServerTelemetry) -> None:
        if own.telemetry.meter_provider is not None:
            self.spill = ObservedWorker(worker, own)

    def _start_families(self, worker: Worker, own: ServerTelemetry) -> None:
        from dask_otel.export.dask_families import DaskFamilies, families_wanted

        if own.telemetry.meter_provider is not None and families_wanted(own):
            self.families = DaskFamilies(worker, own)

    def _start_stalls(self, worker: Worker, own: ServerTelemetry) -> None:
        self.stalls = watch_worker(worker)

    async def teardown(self, worker: Worker) -> None:
        for part, stop in (("stalls", "stop"), ("families", "close"),
                           ("task_context", "uninstall"), ("spill", "close")):
            if (running := getattr(self, part)) is not None:
                getattr(running, stop)()
                setattr(self, part, None)
        if (own := self.server_telemetry) is not None:
            self.server_telemetry = None
            if worker.status in (Status.closing, Status.closed):
                # Not inside Dask's close: see release_telemetry_in_background
                release_telemetry_in_background(own.telemetry)
            else:  # a client unregistered the plugin (no close): the worker goes on
                await release_telemetry(own.telemetry)

