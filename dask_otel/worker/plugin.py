"""The worker plugin, as Dask registers it on every worker.

The scheduler plugin ships it pickled *by value*, so that a worker without
``dask_otel`` installed can still unpickle it: a worker plugin that fails to
unpickle makes the worker fail to start (distributed 2026.8). It is plain
distributed code; on the worker it starts the :class:`~dask_otel.worker.bridge.WorkerBridge`,
or logs one clear error and lets the worker compute without telemetry.
Keep this module free of imports from ``dask_otel``.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

#: Name of the scheduler and worker plugins in ``Scheduler.plugins``,
#: ``Scheduler.worker_plugins`` and ``Worker.plugins``
PLUGIN_NAME = "dask-otel"


class OtelWorkerPlugin(WorkerPlugin):
    """On each worker: the OTel context tasks run in, task spans, and the
    SpillBuffer state as OpenTelemetry metrics (see :class:`WorkerBridge`)"""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        #: :class:`~dask_otel.worker.bridge.WorkerBridge`, once set up
        self.bridge: Any = None
        #: Why the bridge is off on this worker, if it is not installed there
        self.error: str | None = None

    def setup(self, worker: Any) -> Any:
        try:
            from dask_otel.worker.bridge import WorkerBridge
        except ImportError as e:
            self.error = (
                f"dask_otel is not installed on worker {worker.address} ({e}); this "
                "worker exports no telemetry. Install dask-otel in the workers' "
                "environment."
            )
            logging.getLogger("dask_otel").error(self.error)
            return None
        self.bridge = WorkerBridge()
        return self.bridge.setup(worker)

    def teardown(self, worker: Any) -> Any:
        if self.bridge is not None:
            return self.bridge.teardown(worker)
        return None

    def status(self) -> dict[str, Any]:
        if self.bridge is not None:
            return self.bridge.status()
        return {"error": self.error, "service_name": None, "metrics": False, "task_context": False,
                "task_context_errors": 0, "task_spans": None, "config": None}


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
