"""The process's global TracerProvider, on worker processes that have none.

The bridge never replaces an application's global OpenTelemetry providers. Only
on a process that has no global TracerProvider (``dask worker`` usually has none)
does :func:`adopt_global_tracer_provider` make the bridge's the global one, so
that spans made with the OTel API inside tasks are exported.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from dask_otel.export.telemetry import Telemetry


class TelemetryTracerProvider(trace.TracerProvider):
    """The process's global TracerProvider once the bridge has adopted that role:
    its tracers start spans on the TracerProvider of whichever :class:`Telemetry`
    is current, and do nothing while there is none.

    The OTel API lets a process set its global provider once, while Telemetry
    objects come and go (a LocalCluster with ``processes=False`` closed and
    started again): this level of indirection makes "set once" hold. Tracers
    that code got before (``trace.get_tracer`` at import) resolve through it too.
    """

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> trace.Tracer:
        return TelemetryTracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )


class TelemetryTracer(trace.ProxyTracer):
    """A ProxyTracer that follows the current Telemetry's TracerProvider"""

    #: the provider ``_real_tracer`` came from
    _provider: Any = None

    @property
    def _tracer(self) -> trace.Tracer:
        telemetry = Telemetry._current
        provider = telemetry.tracer_provider if telemetry is not None else None
        if provider is None:
            return self._noop_tracer
        if provider is not self._provider:
            self._real_tracer = provider.get_tracer(
                self._instrumenting_module_name,
                self._instrumenting_library_version,
                self._schema_url,
                self._attributes,
            )
            self._provider = provider
        return self._real_tracer  # type: ignore[return-value]


#: The global TracerProvider this process got from the bridge, if it did
_ADOPTED: Any = None


def adopt_global_tracer_provider() -> bool:
    """Make the bridge's TracerProvider the process's global one, if the process
    has none; True if the bridge's is the global one (now or since before).

    "None" means ``trace.get_tracer_provider()`` is still the API's proxy: no
    ``trace.set_tracer_provider`` call and no OTEL_PYTHON_TRACER_PROVIDER. An
    application's provider, even a NoOpTracerProvider, is never replaced; and an
    application that sets its own *after* the bridge did is refused by the OTel
    API ("Overriding of current TracerProvider is not allowed"): set it before
    the worker starts (a worker preload, or at import).
    """
    global _ADOPTED
    with Telemetry._lock:
        current = trace.get_tracer_provider()
        if _ADOPTED is not None and current is _ADOPTED:
            return True
        if not isinstance(current, trace.ProxyTracerProvider):
            return False
        provider = TelemetryTracerProvider()
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is provider:  # another thread may have won
            _ADOPTED = provider
            return True
        return False
