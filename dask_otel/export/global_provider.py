"""The process's global TracerProvider on worker processes that have none
(docs/traces.md, "Inside tasks"): set once per process, never replacing an
application's, its tracers follow whichever Telemetry is current.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from dask_otel.export.telemetry import Telemetry


class TelemetryTracerProvider(trace.TracerProvider):
    """The process's global TracerProvider once the bridge has adopted that role: the
    API sets a global provider once, while Telemetry objects come and go"""

    def get_tracer(self, *scope: Any, **named: Any) -> trace.Tracer:
        # name, version, schema_url, attributes: as the caller passed them
        return TelemetryTracer(scope, named)


class TelemetryTracer(trace.Tracer):
    """A Tracer whose spans start on the current :class:`Telemetry`'s TracerProvider
    (its tracer for this scope, got once per provider); none: no-op"""

    #: the current provider, and its tracer
    _current: tuple[Any, trace.Tracer] | None = None

    def __init__(self, scope: tuple, named: dict[str, Any]):
        self.scope, self.named = scope, named  # what ``get_tracer`` was called with

    def tracer(self) -> trace.Tracer:
        provider = getattr(Telemetry._current, "tracer_provider", None)
        if provider is None:
            return _NO_OP
        current = self._current
        if current is None or current[0] is not provider:
            current = self._current = (provider, provider.get_tracer(*self.scope, **self.named))
        return current[1]

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self.tracer().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self.tracer().start_as_current_span(*args, **kwargs)


_NO_OP = trace.NoOpTracer()


_ADOPTED: Any = None  # the global TracerProvider this process got from the bridge


def adopt_global_tracer_provider() -> bool:
    """Make the bridge's TracerProvider the process's global one if the global is
    still the API's proxy; True if the bridge's is the global one. An application's
    provider (even a NoOpTracerProvider) is never replaced."""
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
