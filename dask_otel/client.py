"""Client side: a Dask span that continues the caller's OpenTelemetry trace.

``dask_otel.span(*tags)`` is a drop-in for ``distributed.span``: same signature,
same yield (the Dask span's UUID), same nesting, and it opens a real Dask span.
It adds two things:

- The caller's current OTel context travels with the graph, as the task
  annotation ``otel`` (``{"carrier": {...}, "entered": {uuid: time}}``), so that
  the scheduler parents the root Dask span under the caller's span, in the
  caller's trace, and samples it as a parent-based sampler would.
- Inside the ``with`` block the current OTel span is the Dask span itself (a
  ``NonRecordingSpan`` with the ids the scheduler exports it with), so that
  client-side instrumented calls (HTTP, database) nest under it. The caller's
  baggage stays in the context.

Usage::

    from opentelemetry import trace
    import dask_otel

    tracer = trace.get_tracer("my-service")
    with tracer.start_as_current_span("POST /reports"):
        with dask_otel.span("nightly report") as sid:
            df.map_partitions(score).compute()

How the trace id is chosen
    - The root ``dask_otel.span`` opened while the caller has a valid current
      span: the caller's trace id; the root Dask span's parent is the caller's span.
    - No current span (or a root opened with ``distributed.span``): the root Dask
      span's UUID, exactly as with ``distributed.span``.
    - Nested blocks (``dask_otel.span`` or ``distributed.span``) belong to their
      root's trace, whatever the current span is when they are entered.

Edge cases
    - The caller's context is written with the globally configured propagators
      (``OTEL_PROPAGATORS``; W3C trace context and baggage by default). If they
      write nothing the scheduler can read back as a span context (e.g.
      ``OTEL_PROPAGATORS=baggage``), the trace id is the root UUID.
    - A Dask span opened by this block starts no later than the client entered
      the block (``time.time()`` on the client: a client whose clock runs ahead of
      the scheduler's moves starts earlier, never later).
    - The sampled flag of the context inside the block is the caller's decision as
      the process's sampler sees it (``dask_otel.sampling.trace_sampled``), or, in a
      process without the OTel SDK, the caller's flag (sampled with no caller).

Needs only ``opentelemetry-api``: nothing here imports the SDK or the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import dask
import distributed
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dask_otel.ids import otel_span_id, trace_id_of
from dask_otel.sampling import trace_sampled

__all__ = ["span"]

#: Name of the task annotation (see the module docstring)
ANNOTATION = "otel"


@contextmanager
def span(*tags: str) -> Iterator[str]:
    """Open a Dask span, as ``distributed.span(*tags)``, that continues the caller's
    OTel trace; yields the UUID of the innermost Dask span.

    With several tags, one Dask span per tag is opened, nested, as
    ``distributed.span`` does; each starts no later than this block was entered.
    """
    entered_at = time.time()
    outer = dask.get_annotations()
    caller = otel_context.get_current()
    with distributed.span(*tags) as span_id:
        span_annotation = dask.get_annotations()["span"]
        annotation = otel_annotation(
            outer, span_annotation["ids"][-len(tags):], entered_at, caller
        )
        dask_context = _dask_span_context(span_annotation, annotation.get("carrier"))
        token = otel_context.attach(
            trace.set_span_in_context(NonRecordingSpan(dask_context), caller)
        )
        try:
            with dask.annotate(**{ANNOTATION: annotation}):
                yield span_id
        finally:
            otel_context.detach(token)


def otel_annotation(
    outer: dict[str, Any],
    new_ids: Any,
    entered_at: float,
    caller: otel_context.Context,
) -> dict[str, Any]:
    """The ``otel`` annotation of a block: the enclosing block's, with ``entered``
    extended by the Dask spans this block opened.

    Only a root block (no enclosing Dask span) writes a carrier, and only if the
    caller has a valid current span; nested blocks inherit their root's (none if
    the root is a ``distributed.span``).
    """
    inherited = outer.get(ANNOTATION) or {}
    entered = {**inherited.get("entered", {}), **dict.fromkeys(new_ids, entered_at)}
    annotation: dict[str, Any] = {"entered": entered}
    if "span" in outer:
        if "carrier" in inherited:
            annotation["carrier"] = inherited["carrier"]
    elif trace.get_current_span(caller).get_span_context().is_valid:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=caller)
        if carrier:
            annotation["carrier"] = carrier
    return annotation


def root_carrier(otel: Any, root_id: str) -> Mapping[str, str] | None:
    """The carrier of a task's ``otel`` annotation if it is the one of root Dask
    span ``root_id``: written by the ``dask_otel.span`` block that opened that root
    (the root is among the annotation's ``entered``). Anything else (no
    annotation, one of another shape, or one that came with a task Dask moved onto
    another workflow's span) is None. The scheduler and the workers apply this
    same rule, so they agree on every task's trace."""
    if not isinstance(otel, Mapping):
        return None
    entered = otel.get("entered")
    carrier = otel.get("carrier")
    if not isinstance(entered, Mapping) or root_id not in entered:
        return None
    return carrier if isinstance(carrier, Mapping) else None


def remote_parent(carrier: Mapping[str, Any] | None) -> SpanContext | None:
    """The caller's span context as the scheduler reads it back from a carrier,
    or None if the carrier holds none (or only values that are not strings)"""
    if not carrier:
        return None
    carrier = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
    parent = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return parent if parent.is_valid else None


def _dask_span_context(
    span_annotation: dict[str, Any], carrier: dict[str, str] | None
) -> SpanContext:
    """The OTel span context of the innermost Dask span of ``span_annotation``, as
    the scheduler exports it (``is_remote``: the span lives in another process)"""
    ids = span_annotation["ids"]
    parent = remote_parent(carrier)
    trace_id = trace_id_of(ids[0], parent)
    sampler = getattr(trace.get_tracer_provider(), "sampler", None)  # the SDK's, if any
    if sampler is not None:
        sampled = trace_sampled(sampler, trace_id, span_annotation["name"][0], parent)
    else:
        sampled = parent is None or parent.trace_flags.sampled
    return SpanContext(
        trace_id,
        otel_span_id(ids[-1]),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
        trace_state=parent.trace_state if parent is not None else None,
    )
