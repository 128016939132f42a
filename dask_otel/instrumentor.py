"""Zero-code: :class:`DaskInstrumentor`, the ``dask`` entry point of
``opentelemetry_instrumentor`` that ``opentelemetry-instrument`` loads: once distributed
is imported (a process that never imports it pays nothing) it sets up the ``otel:``
defaults and Dask's console and wraps ``Scheduler.__init__`` (to add the bridge) and
``Worker.start_unsafe`` (to warn of a missing one). The manual: docs/zero-code.md.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

logger = logging.getLogger("dask_otel")

#: What the bridge supports (pyproject's ``distributed`` requirement)
_instruments = ("distributed >= 2024.1.0",)

#: True between instrument() and uninstrument(): the import hook below may fire
#: after uninstrument() (it cannot be unregistered) and must then do nothing
_active = False
#: What is wrapped now, as (module, attribute): instrument, uninstrument and
#: instrument again before distributed is imported registers each hook twice
_wrapped: set[tuple[str, str]] = set()
#: ``tracer_provider`` given to ``instrument()``, if any: its service.name is the
#: bridge's (dask_otel.export.telemetry.service_name)
SERVICE_NAME_FROM: dict[str, Any] = {"tracer_provider": None}


def _set_up_for_dask(distributed: Any) -> None:
    """Once distributed is imported: the ``otel:`` config defaults and Dask's
    console, which importing :mod:`dask_otel.config` sets up; never raises"""
    try:
        importlib.import_module("dask_otel.config")
    except Exception:
        logger.exception("dask_otel: could not set up the otel config and Dask's console")


def _carry_the_bridge(wrapped: Any, scheduler: Any, args: Any, kwargs: Any) -> None:
    """``Scheduler.__init__``, then the bridge added; a scheduler without the
    bridge beats no scheduler"""
    wrapped(*args, **kwargs)
    try:
        from dask_otel.scheduler.plugin import add_bridge

        add_bridge(scheduler, "instrumentor")
    except Exception:
        logger.exception("dask_otel: the instrumentor could not add the bridge to a scheduler")


def _check_the_bridge(wrapped: Any, worker: Any, args: Any, kwargs: Any) -> Any:
    """``Worker.start_unsafe``, then one WARNING if the scheduler handed the worker
    no bridge as it registered (most often the ``--preload`` trap)"""

    async def start() -> Any:
        result = await wrapped(*args, **kwargs)
        try:
            from dask_otel.worker.plugin import PLUGIN_NAME

            if PLUGIN_NAME not in worker.plugins:
                logger.warning(
                    "dask_otel: scheduler %s has no dask_otel bridge, so worker %s exports "
                    "nothing of Dask's (until dask_otel.instrument(client) is called). "
                    "Start the scheduler under opentelemetry-instrument too, or name "
                    "--preload dask_otel on its command line: a --preload of something "
                    "else makes Dask ignore distributed.scheduler.preload",
                    worker.scheduler.address, worker.address,
                )
        except Exception:
            logger.debug("dask_otel: could not check the worker's bridge", exc_info=True)
        return result

    return start()


def _wrapper_of(target: str, attribute: str, wrapper: Any) -> Any:
    """An import hook that wraps ``target.attribute`` once, while instrumented"""

    def wrap(module: Any) -> None:
        from wrapt import wrap_function_wrapper

        if _active and (target, attribute) not in _wrapped:
            wrap_function_wrapper(module, attribute, wrapper)
            _wrapped.add((target, attribute))

    return wrap


#: What the instrumentor wraps: module, attribute, wrapper
_WRAPPED = (
    ("distributed.scheduler", "Scheduler.__init__", _carry_the_bridge),
    ("distributed.worker", "Worker.start_unsafe", _check_the_bridge),
)


class DaskInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Adds the bridge to every Dask scheduler built in this process"""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        global _active
        from wrapt import register_post_import_hook

        SERVICE_NAME_FROM["tracer_provider"] = kwargs.get("tracer_provider")
        _active = True
        # Set up and wrap when distributed is imported (now, if it is), whatever
        # imports it first: a process that never does (pip, a web server) pays nothing
        register_post_import_hook(_set_up_for_dask, "distributed")
        for target, attribute, wrapper in _WRAPPED:
            register_post_import_hook(_wrapper_of(target, attribute, wrapper), target)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _active
        _active = False
        SERVICE_NAME_FROM["tracer_provider"] = None
        for target, attribute, _ in _WRAPPED:
            if (target, attribute) in _wrapped:
                owner, name = attribute.split(".")
                unwrap(f"{target}.{owner}", name)
                _wrapped.discard((target, attribute))
