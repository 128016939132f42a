"""Start and release of a Dask server's telemetry: the two ends every plugin shares.

:func:`start_telemetry` reads the server's config and attaches it to its process's
:class:`~dask_otel.export.telemetry.Telemetry`; it never raises into Dask.
:func:`release_telemetry` detaches it, and the last server of a process flushes
and shuts the SDK down, within ``otel.flush-timeout`` whatever the collector does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from dask_otel.config import ConfigError, read_config
from dask_otel.export.telemetry import ServerTelemetry, Telemetry

logger = logging.getLogger("dask_otel")


#: Share of otel.flush-timeout one process may wait. A LocalCluster closes its
#: workers (in parallel) before its scheduler: each waiting half keeps the whole
#: cluster's shutdown within otel.flush-timeout.
PROCESS_SHARE = 0.5
#: Share of that given to the flush; the rest is for shutting the SDK down, which
#: interrupts an export still waiting on the collector
FLUSH_SHARE = 0.8


async def release_telemetry(telemetry: Telemetry) -> None:
    """Detach from the process's Telemetry; the last user flushes and shuts it down.

    Waits at most half of otel.flush-timeout (:data:`PROCESS_SHARE`), whatever the
    collector does. The flush, which the SDK does not bound against a hung
    collector, runs in a thread. If it completes, the SDK is shut down and its
    threads joined. If it does not, or exports were already failing (then nothing
    is waited for), the SDK is shut down in the background: exporters first, which
    interrupts a retry back-off and cancels a gRPC call waiting on the collector,
    so that the SDK's threads end at once. What was still queued is dropped and
    counted.
    """
    if not Telemetry.detach(telemetry):
        return
    timeout = telemetry.config.flush_timeout
    budget = PROCESS_SHARE * timeout
    deadline = time.monotonic() + budget
    try:
        if telemetry.outage:
            logger.warning(
                "dask_otel: exports are failing; closing without waiting for them "
                "(what was still queued is dropped and counted)"
            )
        elif await _in_thread(
            telemetry.force_flush, "dask_otel-flush", deadline - (1 - FLUSH_SHARE) * budget,
            # A flush whose export meets an outage (a collector that has not
            # answered for STALLED_AFTER) cannot complete: stop waiting for it
            give_up=lambda: telemetry.outage,
        ):
            # Flushed: the shutdown is quick, and ends the SDK's threads before
            # the server reports itself closed
            await _in_thread(telemetry.shutdown, "dask_otel-shutdown", deadline)
            return
        elif telemetry.outage:
            logger.warning(
                "dask_otel: exports started failing during the close; not waiting for "
                "them (what was still queued is dropped and counted)"
            )
        else:
            logger.warning(
                "dask_otel: telemetry not flushed within %.3gs (half of "
                "otel.flush-timeout=%ss); what was still queued is dropped",
                FLUSH_SHARE * budget,
                timeout,
            )
    except asyncio.CancelledError:
        # `dask worker` cancels its tasks on a second Ctrl-C; re-raising here would
        # abandon Dask's own close half-way (the worker then hangs).
        pass
    # The collector is not answering: shut the SDK down without waiting. Its
    # threads end as soon as the exporters' shutdown cuts their exports short.
    threading.Thread(target=telemetry.shutdown, name="dask_otel-shutdown", daemon=True).start()


async def _in_thread(
    function: Any, name: str, deadline: float, give_up: Any = lambda: False
) -> bool:
    """Run ``function`` in a daemon thread; wait for it until ``deadline``
    (``time.monotonic()``), or until ``give_up()`` is true, without blocking the
    event loop. True if it finished."""

    def run() -> None:
        try:
            function()
        except Exception:
            logger.exception("dask_otel: %s failed", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive() and time.monotonic() < deadline and not give_up():
        await asyncio.sleep(0.01)
    return not thread.is_alive()


def start_telemetry(server: str, **resource: Any) -> tuple[ServerTelemetry | None, str | None]:
    """Read this server's config and attach it to its process's Telemetry; never
    raises.

    Returns the server's view of the Telemetry, or None and why the bridge is off
    on ``server``.
    """
    try:
        config = read_config()
        if not config.enabled:
            logger.info("dask_otel: otel.enabled is false on %s; not exporting", server)
            return None, f"disabled by otel.enabled on {server}"
        return Telemetry.acquire(config, **resource), None
    except ConfigError as e:  # names the key and the value
        logger.error("dask_otel is off on %s: %s", server, e)
        return None, f"ConfigError: {e}"
    except Exception as e:
        # Never a bare exception text ("'otel'" for a KeyError): say what failed
        logger.exception("dask_otel is off on %s: could not start telemetry", server)
        return None, f"could not start telemetry: {type(e).__name__}: {e}"
