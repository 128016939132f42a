"""A Dask span's OpenTelemetry identity, computable in any process without a message:
:func:`dask_span_context` composes the ``SpanContext`` of a Dask span (ids, sampling
decision, trace flags and state) for the client, the scheduler's mirror, the workers and
links alike; :func:`child_context` that of a span a process makes under it. docs/traces.md,
"How the trace id is chosen" and "Sampling". Needs only ``opentelemetry-api``.
"""

from __future__ import annotations

import uuid
from functools import lru_cache
from hashlib import blake2b
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.trace import (NonRecordingSpan, SpanContext, TraceFlags, TraceState,
                                 set_span_in_context)

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace.sampling import Sampler

#: The low 64 bits of a 128-bit id: a Dask span's OTel span id
LOW_64 = (1 << 64) - 1
#: W3C trace context Level 2's "random" trace flag: the trace id's low 56 bits
#: are random. The int: opentelemetry-api 1.41 has no ``TraceFlags`` constant for it
RANDOM = 0x02


def dask_uuid(span_id: str) -> int:
    """The 128-bit integer of a Dask span id (a UUID string); ids that are not
    UUIDs (hand-made annotations) are hashed into one"""
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


def root_span(span: Span) -> Span:
    """The root of a Dask span's tree (``Span.parent`` up): its trace"""
    while (parent := span.parent) is not None:
        span = parent
    return span


# --- sampling: no message carries the decision; every process asks its own sampler
# (OTEL_TRACES_SAMPLER) the same question, with what a task already knows


def sampling_id(trace_id: int) -> int:
    """The id a root Dask trace is sampled on: its high 64 bits, and a hash of the
    whole id as low 64 bits (a uuid4's low 64 bits always start with binary ``10``,
    which the SDK's ``TraceIdRatioBased`` compares with ``ratio * 2**64``)"""
    digest = blake2b(trace_id.to_bytes(16, "big"), digest_size=8).digest()
    return (trace_id & ~LOW_64) | int.from_bytes(digest, "big")


def root_flags(root_id: str) -> int:
    """The trace flags of a Dask-rooted trace, but the sampled bit: random (0x02)
    if its id is a uuid4 (all bits random but the version nibble, bits 76-79, and
    the variant bits, 62-63), as ``distributed.spans`` makes them; else 0"""
    n = dask_uuid(root_id)
    return RANDOM if (n >> 76) & 0xF == 4 and (n >> 62) & 0x3 == 0b10 else 0


@lru_cache(maxsize=4096)
def _root_decision(sampler: Sampler, trace_id: int, root_tag: str
                   ) -> tuple[bool, TraceState | None]:
    result = sampler.should_sample(None, sampling_id(trace_id), root_tag)
    return result.decision.is_sampled(), result.trace_state or None


def trace_decision(sampler: Sampler | None, trace_id: int, root_tag: str,
                   remote_parent: SpanContext | None = None) -> tuple[bool, TraceState | None]:
    """The sampler's decision for a whole Dask trace, and its trace state (None:
    none, or empty). ``root_tag``: the root Dask span's first tag, which every task
    knows. A root trace is sampled on :func:`sampling_id` (cached in a bounded LRU),
    one that continues a caller's as any child of a remote parent. Without a
    sampler (a client with only the OTel API): the caller's flag, or sampled."""
    if sampler is None:
        return remote_parent is None or remote_parent.trace_flags.sampled, None
    if remote_parent is None:
        return _root_decision(sampler, trace_id, root_tag)
    result = sampler.should_sample(in_context(remote_parent), remote_parent.trace_id, root_tag)
    return result.decision.is_sampled(), result.trace_state or None


def dask_span_context(root_id: str, span_id: str, root_tag: str, remote_parent: SpanContext | None,
                      sampler: Sampler | None, *, is_remote: bool, forced: bool | None = None
                      ) -> SpanContext:
    """The OTel SpanContext of Dask span ``span_id`` in the tree of root ``root_id`` (first
    tag ``root_tag``), continuing ``remote_parent`` if the root does. ``is_remote``: False
    only in the process that makes the span (the scheduler). ``forced``: the client's
    ``sampled=`` (None: the sampler decides). Flags are the caller's (or :func:`root_flags`)
    with the sampled bit decided here; the trace state the sampler's, else the caller's."""
    trace_id = remote_parent.trace_id if remote_parent is not None else dask_uuid(root_id)
    if forced is None:
        sampled, state = trace_decision(sampler, trace_id, root_tag, remote_parent)
    else:
        sampled, state = forced, None
    if remote_parent is not None:
        flags = remote_parent.trace_flags & ~TraceFlags.SAMPLED
        state = state or remote_parent.trace_state
    else:
        flags = root_flags(root_id)
    return SpanContext(trace_id, otel_span_id(span_id), is_remote=is_remote, trace_state=state,
                       trace_flags=TraceFlags(flags | TraceFlags.SAMPLED if sampled else flags))


def kept_context(root_id: str, span_id: str, *, is_remote: bool) -> SpanContext:
    """Dask span ``span_id``'s context in the trace ``otel.traces.keep`` keeps the run of
    root ``root_id`` in, the sampler having dropped it: a trace of its own (as a root
    without caller), sampled; the same in every process"""
    return dask_span_context(root_id, span_id, "", None, None, is_remote=is_remote, forced=True)


def child_context(parent: SpanContext, span_id: int) -> SpanContext:
    """The SpanContext (id ``span_id``) of a span this process makes and exports
    under a sampled Dask span's ``parent``: its trace, flags and trace state"""
    return SpanContext(
        parent.trace_id, span_id, is_remote=False,
        trace_flags=TraceFlags(parent.trace_flags | TraceFlags.SAMPLED),
        trace_state=parent.trace_state)


def in_context(span_context: SpanContext | None, base: Context | None = None) -> Context | None:
    """``base`` (None: the current context) with ``span_context`` as its current span, not
    recording: what a task, an exemplar or a log record is tied to a trace by; None for None"""
    return set_span_in_context(NonRecordingSpan(span_context), base) if span_context else None
