"""Zero-code: ``opentelemetry-instrument dask scheduler`` turns the bridge on.

:class:`DaskInstrumentor` is the ``dask`` entry point of the
``opentelemetry_instrumentor`` group, so ``opentelemetry-instrument`` loads it in
every process it starts (Nanny-spawned workers too, through ``sitecustomize``)::

    pip install dask-otel opentelemetry-distro
    OTEL_SERVICE_NAME=dask opentelemetry-instrument dask scheduler
    OTEL_SERVICE_NAME=dask opentelemetry-instrument dask worker tcp://scheduler:8786

or by hand, before the cluster starts::

    from dask_otel.instrumentor import DaskInstrumentor
    DaskInstrumentor().instrument()

Every :class:`distributed.Scheduler` built in the process then carries the
scheduler plugin, added right after ``Scheduler.__init__`` as contrib
instrumentations wrap a server's ``__init__``: no dask config is read for it, so
``dask scheduler --preload my_plugin`` keeps it, unlike the
``distributed.scheduler.preload`` key. Workers get their side as with the preload:
the scheduler hands them the worker plugin. With the preload key or
``dask_otel.instrument(client)`` as well, the cluster still has one bridge
(:func:`dask_otel.scheduler.plugin.add_bridge`); ``dask_otel.status(client)`` names
the paths that asked for it.

``instrument(tracer_provider=...)``: the bridge's spans take that provider's
``service.name`` (see :func:`dask_otel.export.telemetry.service_name`), the one
application spans made with it carry. The bridge still exports through providers of
its own: it owns their shutdown (bounded by ``otel.flush-timeout``) and their
export accounting, and its workers live in processes a provider object cannot
reach. ``meter_provider`` is not used, for the same reasons.

A worker started with the instrumentor on logs one WARNING if its scheduler
handed it no bridge (a scheduler started without either, e.g. the ``--preload``
trap). ``uninstrument()`` restores ``Scheduler.__init__`` and
``Worker.start_unsafe``; schedulers built before keep their bridge until they
close. The other instrumentations ``opentelemetry-instrument`` loads, and what they
cost on Dask servers: docs/zero-code.md.
"""

from __future__ import annotations

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


def _carry_the_bridge(wrapped: Any, scheduler: Any, args: Any, kwargs: Any) -> None:
    """``Scheduler.__init__``, then the bridge's plugin added to it. Never raises
    into Dask: a scheduler without the bridge beats no scheduler."""
    wrapped(*args, **kwargs)
    try:
        from dask_otel.scheduler.plugin import add_bridge

        add_bridge(scheduler, "instrumentor")
    except Exception:
        logger.exception("dask_otel: the instrumentor could not add the bridge to a scheduler")


def _check_the_bridge(wrapped: Any, worker: Any, args: Any, kwargs: Any) -> Any:
    """``Worker.start_unsafe``, then one WARNING if the scheduler handed the worker
    no bridge (it hands its worker plugins over as the worker registers): the
    scheduler runs without the instrumentor and without the preload, most often
    the ``--preload`` trap. Never raises into Dask."""

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

        from dask_otel.export.telemetry import SERVICE_NAME_FROM

        SERVICE_NAME_FROM["tracer_provider"] = kwargs.get("tracer_provider")
        _active = True
        # Wrap when distributed is imported (now, if it is): a process that never
        # builds a Dask server (pip, a script) does not pay for importing it
        for target, attribute, wrapper in _WRAPPED:
            register_post_import_hook(_wrapper_of(target, attribute, wrapper), target)

    def _uninstrument(self, **kwargs: Any) -> None:
        global _active
        from dask_otel.export.telemetry import SERVICE_NAME_FROM

        _active = False
        SERVICE_NAME_FROM["tracer_provider"] = None
        for target, attribute, _ in _WRAPPED:
            if (target, attribute) in _wrapped:
                owner, name = attribute.split(".")
                unwrap(f"{target}.{owner}", name)
                _wrapped.discard((target, attribute))
