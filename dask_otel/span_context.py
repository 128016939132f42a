"""A Dask span's OpenTelemetry identity, computable in any process without a message.

The client (``dask_otel.span``), the scheduler's mirror, the workers (the context a
task runs in) and span links all need the OTel ``SpanContext`` of a Dask span;
:func:`dask_span_context` composes it, and they all call it. The rules
(docs/traces.md, "Ids and sampling"):

- span id: the low 64 bits of the Dask span's UUID;
- trace id: the caller's trace id when the root Dask span continues a caller's
  span (the remote parent that travels in the ``otel`` annotation, see
  :mod:`dask_otel.annotation`), else the root Dask span's UUID;
- sampled: one decision per trace, the same in every process
  (:func:`trace_sampled`);
- trace state: the remote parent's, so that vendors' entries reach every span of
  the trace, as W3C trace context asks of children; none without a caller;
- ``is_remote``: False only in the process that makes the span (the scheduler,
  which exports it, and links to it), True everywhere else;
- a child of a Dask span (a TaskGroup batch's span, a task span) has a random id
  of the exporting process in the Dask span's trace (:func:`child_context`).

Needs only ``opentelemetry-api``: the client side runs without the SDK.
"""

from __future__ import annotations

import uuid
from functools import lru_cache
from hashlib import blake2b
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace.sampling import Sampler

#: The low 64 bits of a 128-bit id: a Dask span's OTel span id
LOW_64 = (1 << 64) - 1
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


def dask_uuid(span_id: str) -> int:
    """The 128-bit integer of a Dask span id (a UUID string).

    Ids that are not UUIDs (hand-made annotations) are hashed into one.
    """
    hex_ = span_id.replace("-", "")
    if len(hex_) == 32:
        try:
            return int(hex_, 16)
        except ValueError:
            pass
    return uuid.uuid5(uuid.NAMESPACE_OID, span_id).int


def otel_span_id(span_id: str) -> int:
    """The OTel span id of a Dask span: the low 64 bits of its UUID"""
    return dask_uuid(span_id) & LOW_64


def trace_id_of(root_id: str, remote_parent: SpanContext | None = None) -> int:
    """The trace id of a Dask span tree: the caller's trace (``remote_parent``, the
    SpanContext its root continues) if any, else its root span's UUID"""
    return remote_parent.trace_id if remote_parent is not None else dask_uuid(root_id)


def root_span(span: Span) -> Span:
    """The root of a Dask span's tree (``Span.parent`` up): its trace"""
    while (parent := span.parent) is not None:
        span = parent
    return span


# --- sampling -------------------------------------------------------------------
#
# The scheduler mirrors a trace's spans when they finish; workers (task spans, the
# context code inside a task runs in) and the client need the same decision before.
# No message carries it: every process asks its own sampler (OTEL_TRACES_SAMPLER,
# set alike everywhere) the same question, with what a task already knows: the
# trace id, the root span's first tag, and the remote parent, if any.


def sampling_id(trace_id: int) -> int:
    """The id a root Dask trace is sampled on: its high 64 bits, and a hash of the
    whole id as low 64 bits.

    A Dask trace id is a uuid4, whose variant bits make its low 64 bits always
    start with binary ``10``: the SDK's ``TraceIdRatioBased``, which compares those
    bits with ``ratio * 2**64``, would keep 0 % or 100 % of Dask traces for most
    ratios. The hash is uniform, and the same everywhere.
    """
    digest = blake2b(trace_id.to_bytes(16, "big"), digest_size=8).digest()
    return (trace_id & ~LOW_64) | int.from_bytes(digest, "big")


@lru_cache(maxsize=4096)
def _root_sampled(sampler: Sampler, trace_id: int, root_tag: str) -> bool:
    result = sampler.should_sample(None, sampling_id(trace_id), root_tag)
    return result.decision.is_sampled()


def trace_sampled(
    sampler: Sampler | None,
    trace_id: int,
    root_tag: str,
    remote_parent: SpanContext | None = None,
) -> bool:
    """The sampler's decision for a whole Dask trace.

    ``root_tag`` is the root Dask span's first tag (``Span.name[0]``), which every
    task of the trace knows from its ``span`` annotation. A root trace is sampled
    on :func:`sampling_id`, with a cached decision (a bounded LRU: asking per task
    costs a dict lookup). A trace that continues a caller's is sampled as any
    child of a remote parent, so that ``parentbased_*`` samplers follow the
    caller. Without a sampler (a client with only the OTel API): the caller's
    flag, or sampled.
    """
    if sampler is None:
        return remote_parent is None or remote_parent.trace_flags.sampled
    if remote_parent is None:
        return _root_sampled(sampler, trace_id, root_tag)
    context = trace.set_span_in_context(trace.NonRecordingSpan(remote_parent))
    result = sampler.should_sample(context, remote_parent.trace_id, root_tag)
    return result.decision.is_sampled()


def dask_span_context(
    root_id: str,
    span_id: str,
    root_tag: str,
    remote_parent: SpanContext | None,
    sampler: Sampler | None,
    *,
    is_remote: bool,
) -> SpanContext:
    """The OTel SpanContext of Dask span ``span_id`` in the tree of root ``root_id``
    (whose first tag is ``root_tag``), continuing ``remote_parent`` if the root
    does: the one composition of the rules in the module docstring"""
    trace_id = trace_id_of(root_id, remote_parent)
    sampled = trace_sampled(sampler, trace_id, root_tag, remote_parent)
    return SpanContext(
        trace_id,
        otel_span_id(span_id),
        is_remote=is_remote,
        trace_flags=SAMPLED if sampled else NOT_SAMPLED,
        trace_state=remote_parent.trace_state if remote_parent is not None else None,
    )


def child_context(parent: SpanContext, span_id: int) -> SpanContext:
    """The SpanContext, with id ``span_id``, of a span the current process makes
    and exports as a child of a sampled Dask span's ``parent``: its trace, its
    trace state, sampled"""
    return SpanContext(
        parent.trace_id, span_id, is_remote=False, trace_flags=SAMPLED,
        trace_state=parent.trace_state,
    )
