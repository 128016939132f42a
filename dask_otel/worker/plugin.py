"""The worker plugin, as Dask registers it on every worker, and the one builder of
a server's status (:func:`server_status`). Shipped pickled *by value*, so that a
worker without ``dask_otel`` still unpickles it (one that fails to unpickle stops
the worker from starting): it starts the :class:`~dask_otel.worker.bridge.WorkerBridge`
or logs one clear error. No ``dask_otel`` import at module level (``tests/test_layout.py``).
The status: README.md, "``instrument`` and ``status``".
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

#: Name of the scheduler and worker plugins in ``Scheduler.plugins``,
#: ``Scheduler.worker_plugins`` and ``Worker.plugins``
PLUGIN_NAME = "dask-otel"


class OtelWorkerPlugin(WorkerPlugin):
    """What Dask registers on each worker: it starts a :class:`WorkerBridge`"""

    name = PLUGIN_NAME
    idempotent = True
    #: :class:`~dask_otel.worker.bridge.WorkerBridge`, once set up
    bridge: Any = None
    #: Why the bridge is off on this worker, if it is not installed there
    error: str | None = None

    def setup(self, worker: Any) -> Any:
        try:
            from dask_otel.worker.bridge import WorkerBridge
        except ImportError as e:
            self.error = (f"dask_otel is not installed on worker {worker.address} ({e}); this "
                          "worker exports no telemetry. Install dask-otel in the workers' "
                          "environment.")
            logging.getLogger("dask_otel").error(self.error)
            return None
        self.bridge = WorkerBridge()
        return self.bridge.setup(worker)

    def teardown(self, worker: Any) -> Any:
        return self.bridge and self.bridge.teardown(worker)

    def status(self) -> dict[str, Any]:
        bridge = self.bridge
        hook = bridge.task_context if bridge is not None else None
        task_spans = hook.task_spans if hook is not None else None
        return server_status(
            self.error if bridge is None else bridge.error,
            bridge.server_telemetry if bridge is not None else None,
            "workers",  # dask_otel.config.WORKERS: nothing of dask_otel imported here
            metrics=bridge is not None and bridge.spill is not None,
            # whether tasks run in their OTel context (False: hook not installed)
            task_context=hook is not None,
            # tasks that ran without context because building it failed
            task_context_errors=hook.errors if hook is not None else 0,
            # task spans exported by this worker; None when it exports no traces
            task_spans=task_spans.exported if task_spans is not None else None,
        )


def server_status(error: str | None, telemetry: Any, process: str, **features: Any
                  ) -> dict[str, Any]:
    """What :func:`dask_otel.status` shows of one Dask server, scheduler or worker
    (here because this module travels by value). ``telemetry``: its
    :class:`~dask_otel.export.telemetry.ServerTelemetry`, None where the bridge is
    off; ``process`` names the keys of ``config``; ``features``: the server's own."""
    if telemetry is None:
        service_name = config_file = config = export = None
    else:  # dask_otel is installed here
        from dask_otel.export.telemetry import service_name as named

        process_wide = telemetry.telemetry
        service_name = {"name": process_wide.resource.attributes.get("service.name"),
                        "from": named()[1]}
        read = process_wide.config_file
        config_file = read and {"path": read.path, "ignored": list(read.ignored)}
        config = process_wide.config.effective(process)
        export = process_wide.export_status()
    return {
        # why the bridge is off on this server (None: it is on)
        "error": error,
        # the service.name its spans carry, and which rule gave it
        "service_name": service_name,
        # OTEL_CONFIG_FILE's path and the parts of it the bridge ignores (None: no file)
        "config_file": config_file,
        # the scheduler whose exporters and metric resource it shares (two clusters
        # in one process), None when they are its own
        "shared_with": telemetry and telemetry.shared_with,
        **features,
        # per signal (None: not exported), what this process's exporters shipped
        # and lost: items, size (bytes, before compression), dropped, failures
        "export": export,
        # the otel.* keys this kind of server reads, as it uses them (None: off)
        "config": config,
    }


def dumps_by_value() -> bytes:
    """The pickled plugin, carrying its own code"""
    import sys

    import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(OtelWorkerPlugin())
    finally:
        cloudpickle.unregister_pickle_by_value(module)
