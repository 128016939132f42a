"""The worker plugin as the scheduler ships it: pickled *by value*, so that a worker
without ``dask_otel`` installed can still unpickle it.

A worker plugin that fails to unpickle makes the worker fail to start (distributed
2026.8). This shim is plain distributed code; on the worker it imports the real
plugin and delegates to it, or logs one clear error and lets the worker compute
without telemetry. Keep this module free of imports from ``dask_otel``.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin


class OtelWorkerShim(WorkerPlugin):
    name = "dask-otel"
    idempotent = True

    def __init__(self) -> None:
        self.plugin: Any = None
        self.error: str | None = None

    def setup(self, worker: Any) -> Any:
        try:
            from dask_otel.plugin import OtelWorkerPlugin
        except ImportError as e:
            self.error = (
                f"dask_otel is not installed on worker {worker.address} ({e}); this "
                "worker exports no telemetry. Install dask-otel in the workers' "
                "environment."
            )
            logging.getLogger("dask_otel").error(self.error)
            return None
        self.plugin = OtelWorkerPlugin()
        return self.plugin.setup(worker)

    def teardown(self, worker: Any) -> Any:
        if self.plugin is not None:
            return self.plugin.teardown(worker)
        return None

    def status(self) -> dict[str, Any]:
        if self.plugin is not None:
            return self.plugin.status()
        return {"error": self.error, "metrics": False, "task_context": False}


def dumps_by_value() -> bytes:
    """The pickled shim, carrying its own code"""
    import cloudpickle

    import dask_otel.worker_shim as module

    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(OtelWorkerShim())
    finally:
        cloudpickle.unregister_pickle_by_value(module)
