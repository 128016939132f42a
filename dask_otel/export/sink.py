"""The :class:`SpanSink`: the one place the bridge's spans (mirrored Dask spans and
TaskGroups, task spans) go to the SDK, built finished as ``ReadableSpan``s, with what
a Tracer would add (resource, scope, the SDK's ``SpanLimits``: every string cut to
the value length limit but the ids users search by). Limits: docs/traces.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Status, StatusCode

from dask_otel._version import __version__
from dask_otel.attributes import SCHEMA_URL, SPAN_ID
from dask_otel.config import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, SpanLimits, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanContext

#: Span attribute value length when no OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT is set:
#: span tags are user data, and a 1 MB tag must not become a 1 MB attribute.
DEFAULT_ATTRIBUTE_LENGTH = 4096
#: Attributes whose values are ids, never cut to the length limit (a cut UUID
#: finds nothing): ``dask.span.id``, on spans, task spans and links
WHOLE_VALUES = frozenset({SPAN_ID})

_UNSET = Status(StatusCode.UNSET)
#: The attributes of an event or link that has none: a ``BoundedAttributes`` always,
#: as the SDK gives them, so that ``dropped_attributes`` counts what the limits dropped
NO_ATTRIBUTES = BoundedAttributes(immutable=True)

#: Attribute value types that need no cleaning: OTel's primitive types, exactly
#: (a subclass of str or int might be anything)
_PRIMITIVES = frozenset((str, bool, int, float))


def within_limits(values: Iterable[Any], max_len: int | None) -> bool:
    """Whether attribute values are of OTel attribute types, exactly (primitives,
    tuples of one primitive type), with no string longer than ``max_len``"""
    for value in values:
        kind = type(value)
        if kind is tuple and value:
            kind = type(value[0])
            if kind not in _PRIMITIVES or any(type(v) is not kind for v in value):
                return False
            if kind is str and max_len is not None and max(map(len, value)) > max_len:
                return False
        elif kind is str and max_len is not None and len(value) > max_len:
            return False
        elif kind not in _PRIMITIVES and kind is not tuple:
            return False
    return True


@dataclass(slots=True, eq=False)
class SpanSink:
    """Where the mirror hands the spans it builds, finished: straight to the SDK's
    span processors, without what only live spans need (locks, contexts, ids from
    an IdGenerator: the mirror's come from Dask)"""

    #: The process's TracerProvider: its sampler
    provider: TracerProvider
    #: The span processors the spans are handed to (the provider's, or a
    #: second cluster's share of them)
    processors: list[SpanProcessor]
    #: The SDK's SpanLimits: attribute count (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT)
    #: and value length (OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, or ours)
    limits: SpanLimits
    #: The exporting server's resource (the provider's by default)
    resource: Resource = None  # type: ignore[assignment]
    #: ``dask_otel`` and its version, as a Tracer of that name would have it
    scope: InstrumentationScope = field(init=False)

    def __post_init__(self) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.resource = self.resource or self.provider.resource
        self.scope = InstrumentationScope("dask_otel", __version__, SCHEMA_URL)

    def name(self, name: str) -> str:
        """A span name or status description cut, as attribute strings are, to the
        attribute value length limit"""
        return name[:self.limits.max_span_attribute_length]  # None: no limit

    @property
    def sampler(self) -> Sampler:
        """The provider's sampler (OTEL_TRACES_SAMPLER); ask it through
        :func:`dask_otel.span_context.trace_decision`, one decision per trace"""
        return self.provider.sampler

    def bounded(self, attributes: dict[str, Any], count: int | None = None
                ) -> dict[str, Any] | BoundedAttributes:
        """``attributes`` (a new dict the caller hands over) within the SDK's limits
        (at most ``count``, default the span attribute count limit), as its own
        spans apply them; as they are when already within them (the mirror's
        usually are: ``BoundedAttributes`` costs ~2 us per attribute)"""
        limit = self.limits.max_span_attributes if count is None else count
        max_len = self.limits.max_span_attribute_length
        within = limit is None or len(attributes) <= limit
        if within and within_limits(attributes.values(), max_len):
            return attributes
        return bounded_attributes(attributes, limit, max_len)

    def event_attributes(self, attributes: dict[str, Any], count: int | None) -> BoundedAttributes:
        """The attributes of an event or a link within the SDK's limits (``count``: its
        count limit), always as ``BoundedAttributes``: they are few, no fast path"""
        return bounded_attributes(attributes, count, self.limits.max_span_attribute_length)

    def span(self, name: str, context: SpanContext, parent: SpanContext | None, start: float,
             end: float, attributes: dict[str, Any], status: Status | None = None,
             events: tuple[Event, ...] = (), links: tuple[Link, ...] = ()) -> ReadableSpan:
        """A finished span (times in seconds since the epoch, ``end`` no earlier
        than ``start``), with what the SDK's Tracer would give it"""
        return ReadableSpan(
            self.name(name), context=context, parent=parent, resource=self.resource,
            attributes=self.bounded(attributes), links=links, events=events,
            status=status or _UNSET, start_time=int(start * 1e9),
            end_time=int(max(end, start) * 1e9), instrumentation_scope=self.scope,
        )

    def emit(self, span: ReadableSpan) -> None:
        for processor in self.processors:
            processor.on_end(span)


def bounded_attributes(attributes: dict[str, Any], count: int | None, max_len: int | None
                       ) -> BoundedAttributes:
    """``BoundedAttributes`` as the SDK builds them for its own spans (at most
    ``count``, the oldest dropped first; values cleaned, strings cut to
    ``max_len``), except that :data:`WHOLE_VALUES` keep their whole value and
    come last, so that the count limit drops them last"""
    whole = {k: attributes[k] for k in WHOLE_VALUES.intersection(attributes)}
    if not whole:
        return BoundedAttributes(count, attributes, immutable=True, max_value_len=max_len)
    rest = {k: v for k, v in attributes.items() if k not in whole}
    cut = BoundedAttributes(None, rest, immutable=True, max_value_len=max_len)
    out = BoundedAttributes(count, {**cut, **whole}, immutable=True)
    out.dropped += cut.dropped  # values of no attribute type
    return out


def span_limits() -> SpanLimits:
    """The SDK's SpanLimits from OTEL_*_LIMIT, with our default value length; a
    malformed variable is a ConfigError that names it"""
    from opentelemetry.sdk.trace import SpanLimits

    set_by_env = any(v in os.environ for v in (
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"))
    try:
        return SpanLimits(
            max_span_attribute_length=None if set_by_env else DEFAULT_ATTRIBUTE_LENGTH)
    except ValueError as e:  # "OTEL_..._LIMIT must be a non-negative integer but got -5"
        variable = next((v for v in os.environ if v.startswith("OTEL_") and v in str(e)), None)
        if variable is None:
            raise
        raise ConfigError(variable, os.environ[variable], "a non-negative integer") from e
