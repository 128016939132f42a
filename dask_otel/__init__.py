"""Mirror a Dask distributed cluster into OpenTelemetry: what Dask already measures,
handed to the OpenTelemetry SDK. The public API: the preload hooks
(``distributed.scheduler.preload: [dask_otel]``), :func:`instrument`, :func:`status`,
:func:`span` and :class:`ConfigError`. Importing it imports nothing of the SDK, nor
of Dask where distributed is not imported (docs/zero-code.md, "A process that never
uses Dask pays nothing"). The manual: README.md and docs/.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

# Everything, Dask and the SDK included, is imported where used (dask_otel.span needs
# the API alone); these at first use, by __getattr__ (__version__ reads the metadata)
_AT_FIRST_USE = {
    "span": "dask_otel.client", "ConfigError": "dask_otel.config",
    "__version__": "dask_otel._version",
}
if "distributed" in sys.modules:  # a Dask process (a preload's import): the otel:
    importlib.import_module("dask_otel.config")  # defaults and Dask's console, now

if TYPE_CHECKING:
    from distributed import Client, Scheduler

    from dask_otel._version import __version__
    from dask_otel.client import span
    from dask_otel.config import ConfigError

__all__ = [
    "ConfigError", "__version__", "dask_setup", "dask_teardown", "instrument", "span", "status",
]


def __getattr__(name: str) -> Any:
    if name in _AT_FIRST_USE:
        return getattr(importlib.import_module(_AT_FIRST_USE[name]), name)
    raise AttributeError(f"module 'dask_otel' has no attribute {name!r}")


async def dask_setup(scheduler: Scheduler) -> None:
    """Preload entry point: adds the scheduler plugin, which hands the worker
    plugin to every current and future worker"""
    from dask_otel.scheduler.plugin import OtelSchedulerPlugin, note_path
    from dask_otel.worker.plugin import PLUGIN_NAME

    if PLUGIN_NAME in scheduler.plugins:  # the instrumentor added it: one bridge
        note_path(scheduler, "preload")
        return
    await scheduler.register_scheduler_plugin(OtelSchedulerPlugin("preload"), idempotent=True)


async def dask_teardown(scheduler: Scheduler) -> None:
    """Preload exit point: export and flush what is pending (``otel.flush-timeout``)"""
    from dask_otel.scheduler.plugin import OtelSchedulerPlugin
    from dask_otel.worker.plugin import PLUGIN_NAME

    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, OtelSchedulerPlugin):
        await plugin.close()


def instrument(client: Client) -> None:
    """Turn the bridge on for the cluster ``client`` is connected to, as the
    preload does, through ``Client.register_plugin``: nothing if it has it already,
    or if ``otel.enabled`` is false here (ConfigError if neither true nor false).
    Dask spans that finished before the call are not exported."""
    from dask_otel.config import enabled
    from dask_otel.log import logger
    from dask_otel.scheduler.plugin import OtelSchedulerPlugin, note_path

    if not enabled():
        logger.info("dask_otel: otel.enabled is false in this client; not instrumenting")
        return
    # idempotent: a bridge already there (the instrumentor's, the preload's) stays
    # the one, and notes that the client asked too (status()["scheduler"]["paths"])
    client.register_plugin(OtelSchedulerPlugin("client"))
    client.run_on_scheduler(lambda dask_scheduler: note_path(dask_scheduler, "client"))


def status(client: Client) -> dict[str, Any]:
    """The bridge's state on the scheduler and on every worker (None where it is not
    installed), and ``warning``: why the scheduler has none though its config names the
    preload. What each key means: README.md, "``instrument`` and ``status``"."""
    from dask_otel.worker.plugin import PLUGIN_NAME

    def _status(dask_scheduler: Any = None, dask_worker: Any = None) -> dict[str, Any] | None:
        plugin = getattr(dask_scheduler or dask_worker, "plugins", {}).get(PLUGIN_NAME)
        return plugin.status() if plugin is not None else None

    def _trap(dask_scheduler: Any) -> str | None:
        try:
            from dask_otel.scheduler.plugin import preload_trap
        except ImportError:  # dask_otel is not installed there
            return None
        return preload_trap(dask_scheduler)

    return {
        "scheduler": client.run_on_scheduler(_status),
        "workers": client.run(_status),
        "warning": client.run_on_scheduler(_trap),
    }
