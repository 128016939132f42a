"""Mirror a Dask distributed cluster into OpenTelemetry: what Dask already measures
(its spans, fine performance metrics, SpillBuffer counters, events and log lines),
handed to the OpenTelemetry SDK.

The public API: the preload hooks :func:`dask_setup` and :func:`dask_teardown`
(``distributed.scheduler.preload: [dask_otel]``), :func:`instrument` for a running
cluster, :func:`status`, :func:`span` and :class:`ConfigError`. Importing the package
loads the ``otel:`` config defaults and nothing of the SDK, so that a client that
only calls :func:`span` needs opentelemetry-api alone (``tests/test_layout.py``).
The manual: README.md; zero-code, the third way on: :mod:`dask_otel.instrumentor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_otel._version import __version__
from dask_otel.client import span
from dask_otel.config import ConfigError  # also loads the otel: config defaults

# The plugins, and through them the OTel SDK, are imported where they are used:
# a client that only calls dask_otel.span needs opentelemetry-api alone.

if TYPE_CHECKING:
    from distributed import Client, Scheduler

__all__ = [
    "ConfigError", "__version__", "dask_setup", "dask_teardown", "instrument", "span", "status",
]


async def dask_setup(scheduler: Scheduler) -> None:
    """Preload entry point (``distributed.scheduler.preload: [dask_otel]``).

    Adds the scheduler plugin, which registers the worker plugin with the
    scheduler, so that every current and future worker exports too.
    """
    from dask_otel.scheduler.plugin import OtelSchedulerPlugin, note_path
    from dask_otel.worker.plugin import PLUGIN_NAME

    if PLUGIN_NAME in scheduler.plugins:  # the instrumentor added it: one bridge
        note_path(scheduler, "preload")
        return
    await scheduler.register_scheduler_plugin(OtelSchedulerPlugin("preload"), idempotent=True)


async def dask_teardown(scheduler: Scheduler) -> None:
    """Preload exit point: export and flush what is pending, within
    ``otel.flush-timeout``."""
    from dask_otel.scheduler.plugin import OtelSchedulerPlugin
    from dask_otel.worker.plugin import PLUGIN_NAME

    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, OtelSchedulerPlugin):
        await plugin.close()


def instrument(client: Client) -> None:
    """Turn the bridge on for the cluster ``client`` is connected to.

    Does the same as the preload, through ``Client.register_plugin``; does nothing
    if the cluster already has it, or if ``otel.enabled`` is false in this
    process's dask config (the scheduler and each worker then read their own).
    ``dask_otel`` must be installed on the scheduler and the workers. Dask spans
    that finished before this call are not exported.

    Raises
    ------
    ConfigError
        if this process's ``otel.enabled`` is neither true nor false.
    """
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
    """The bridge's state on the scheduler and on every worker.

    ``{"scheduler": {"error": None, "mirrored_spans": 12, "config": {...}, ...},
    "workers": {address: {"error": None, "metrics": True, "task_context": True,
    "task_context_errors": 0, "task_spans": None, "config": {...}}}}``; ``None``
    where the plugin is not installed. ``error`` says why the bridge is off there:
    the config key or exporter at fault, or ``disabled by otel.enabled on ...``.
    ``config`` holds the ``otel.*`` keys that process reads, with the values it
    uses (each process reads its own dask config). ``service_name``: the
    ``service.name`` that process's spans carry and which rule gave it; the
    scheduler's ``paths``: which ways of turning the bridge on asked for it, the
    one that added it first (``instrumentor``, ``preload``, ``client``).
    ``warning``: why the scheduler has no bridge although its dask config names
    the preload (a ``--preload`` of something else), else None.
    """
    from dask_otel.worker.plugin import PLUGIN_NAME

    def _status(dask_server: Any) -> dict[str, Any] | None:
        plugins = getattr(dask_server, "plugins", {})
        plugin = plugins.get(PLUGIN_NAME)
        return plugin.status() if plugin is not None else None

    def _trap(dask_scheduler: Any) -> str | None:
        try:
            from dask_otel.scheduler.plugin import preload_trap
        except ImportError:  # dask_otel is not installed there
            return None
        return preload_trap(dask_scheduler)

    return {
        "scheduler": client.run_on_scheduler(
            lambda dask_scheduler: _status(dask_scheduler)
        ),
        "workers": client.run(lambda dask_worker: _status(dask_worker)),
        # why the bridge is off on the scheduler though its config names the preload
        "warning": client.run_on_scheduler(_trap),
    }
