"""Start and release of a Dask server's telemetry, the two ends every plugin shares:
:func:`start_telemetry` never raises into Dask; the last server of a process to
release flushes and shuts the SDK down within its share of ``otel.flush-timeout``,
whatever the collector does (docs/deploy.md, "When telemetry fails").
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
from typing import Any

from dask_otel.config import ConfigError, read_config
from dask_otel.export.telemetry import ServerTelemetry, Telemetry
from dask_otel.log import logger

#: Share of otel.flush-timeout one process may wait. A LocalCluster closes its
#: workers (in parallel) before its scheduler: each waiting half keeps the whole
#: cluster's shutdown within otel.flush-timeout.
PROCESS_SHARE = 0.5
#: Share of that given to the flush; the rest is for shutting the SDK down, which
#: interrupts an export still waiting on the collector
FLUSH_SHARE = 0.8


async def release_telemetry(telemetry: Telemetry, builder: Any = None) -> None:
    """Detach from the process's Telemetry; the last user flushes (in a thread: the
    SDK does not bound a flush against a hung collector; the span ``builder`` drained
    first) and shuts it down, waiting at most :data:`PROCESS_SHARE` of otel.flush-timeout;
    past that, or during an outage, the SDK is shut down in the background."""
    if Telemetry.detach(telemetry):
        await _flush_and_shut_down(telemetry, builder)


async def _flush_and_shut_down(telemetry: Telemetry, builder: Any = None) -> None:
    timeout = telemetry.config.flush_timeout
    budget = PROCESS_SHARE * timeout
    deadline = time.monotonic() + budget

    def shut_down(flushed: threading.Event | None = None) -> None:
        if builder is not None:  # what it holds reaches the SDK first, off the loop
            builder.drain(budget)
        if flushed is not None:
            telemetry.force_flush()
            flushed.set()
        telemetry.shutdown()

    try:
        if telemetry.outage:
            logger.warning("dask_otel: exports are failing; closing without waiting for them "
                           "(what was still queued is dropped and counted)")
        else:
            # One thread flushes, then shuts the SDK down (joined before the server
            # reports itself closed): one thread start and loop wake-up per close
            flushed = threading.Event()
            done = _in_thread(lambda: shut_down(flushed), "dask_otel-close")
            # A flush whose export meets an outage (a refused collector, or one
            # silent for STALLED_AFTER) cannot complete: stop waiting for it
            flush_deadline = deadline - (1 - FLUSH_SHARE) * budget
            if (await _wait(done, flush_deadline, give_up=lambda: telemetry.outage)
                    or flushed.is_set()):
                # Flushed: the shutdown is quick
                await _wait(done, deadline)
                return
            if telemetry.outage:
                logger.warning("dask_otel: exports started failing during the close; not waiting "
                               "for them (what was still queued is dropped and counted)")
            else:
                logger.warning("dask_otel: telemetry not flushed within %.3gs (half of "
                               "otel.flush-timeout=%ss); what was still queued is dropped",
                               FLUSH_SHARE * budget, timeout)
    except asyncio.CancelledError:
        pass  # `dask worker` cancels on a second Ctrl-C: re-raising hangs Dask's close
    # The collector is not answering: shut the SDK down without waiting. Its
    # threads end as soon as the exporters' shutdown cuts their exports short.
    threading.Thread(target=shut_down, name="dask_otel-shutdown", daemon=True).start()


def release_telemetry_in_background(telemetry: Telemetry) -> None:
    """:func:`release_telemetry` in a thread of its own, for a worker's close: the
    process's exit (not the caller) waits for it, within the same bound. Dask stops
    a worker's heartbeat only after its plugins' teardowns: a heartbeat begun during
    the wait, to a scheduler that is gone, held the close until its connection
    timed out (30 s on distributed 2024.1)."""
    if not Telemetry.detach(telemetry):
        return
    thread = threading.Thread(target=asyncio.run, args=(_flush_and_shut_down(telemetry),),
                              name="dask_otel-release", daemon=True)
    # its share of otel.flush-timeout, and a second for the thread's start and loop
    deadline = time.monotonic() + PROCESS_SHARE * telemetry.config.flush_timeout + 1.0
    with _background_lock:
        # A process that closes many workers keeps only the releases under way
        _background[:] = [(t, d) for t, d in _background if t.is_alive()]
        _background.append((thread, deadline))
    thread.start()


_background: list[tuple[threading.Thread, float]] = []
_background_lock = threading.Lock()


@atexit.register  # once per process: a no-op where no worker closed
def _join_background_releases() -> None:
    """At the process's exit: let the releases of closed workers finish (their final
    export), each within its bound"""
    with _background_lock:
        pending = list(_background)
        _background.clear()
    for thread, deadline in pending:
        thread.join(max(0.0, deadline - time.monotonic()))


def _in_thread(function: Any, name: str) -> asyncio.Future:
    """Run ``function`` in a daemon thread; the future is done when it has returned
    (the thread wakes the loop: a healthy close goes on at once, not at a poll)"""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            function()
        except Exception:
            logger.exception("dask_otel: %s failed", name)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed while we waited
                loop.call_soon_threadsafe(finished)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


#: How often a wait with ``give_up`` asks it (only while the flush is under way:
#: a healthy close is woken by its thread, not by this)
GIVE_UP_EVERY = 0.05


async def _wait(done: asyncio.Future, deadline: float, give_up: Any = None) -> bool:
    """Wait for :func:`_in_thread`'s future until ``deadline`` (``time.monotonic()``)
    or ``give_up()``, without blocking the event loop; True if the function returned"""
    while True:
        remaining = max(0.0, deadline - time.monotonic())
        step = remaining if give_up is None else min(remaining, GIVE_UP_EVERY)
        try:
            # shield: a timeout leaves the future to the thread, which sets it later
            await asyncio.wait_for(asyncio.shield(done), step)
            return True
        except asyncio.TimeoutError:
            if time.monotonic() >= deadline or (give_up is not None and give_up()):
                return False


def start_telemetry(server: str, **resource: Any) -> tuple[ServerTelemetry | None, str | None]:
    """Read this server's config and attach it to its process's Telemetry; never
    raises. The server's view of the Telemetry, or None and why the bridge is off."""
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
