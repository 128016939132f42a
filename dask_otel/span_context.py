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
  (:func:`trace_decision`), unless the client's block forced it
  (``dask_otel.span(sampled=...)``);
- trace flags: the caller's (W3C Level 2's random flag 0x02 included) with the
  sampled bit decided here; a Dask-rooted trace says random (:func:`root_flags`);
- trace state: the one the sampler returned if it returned one (consistent
  probability samplers write ``ot=th:...`` there), else the remote parent's, so
  that vendors' entries reach every span of the trace, as W3C trace context asks
  of children; none without a caller;
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
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

if TYPE_CHECKING:
    from distributed.spans import Span
    from opentelemetry.sdk.trace.sampling import Sampler

#: The low 64 bits of a 128-bit id: a Dask span's OTel span id
LOW_64 = (1 << 64) - 1
#: W3C trace context Level 2's "random" trace flag: the trace id's low 56 bits
#: are random. The int: opentelemetry-api 1.41 has no ``TraceFlags`` constant for it
RANDOM = 0x02
#: A uuid4's version nibble (bits 76-79) and variant bits (62-63), as an int's
_UUID4_VERSION = (0xF << 76, 0x4 << 76)
_UUID4_VARIANT = (0x3 << 62, 0x2 << 62)


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


def root_flags(root_id: str) -> int:
    """The trace flags of a Dask-rooted trace, but the sampled bit: random (0x02)
    if its id is a uuid4, as ``distributed.spans`` makes them. A uuid4 has 122
    random bits: all but the version nibble (bits 76-79) and the variant bits
    (62-63), so its low 56 bits, the ones the flag speaks of, are all random.
    An id hashed from a hand-made one (:func:`dask_uuid`) is not random: 0."""
    n = dask_uuid(root_id)
    mask, version = _UUID4_VERSION
    vmask, variant = _UUID4_VARIANT
    return RANDOM if (n & mask) == version and (n & vmask) == variant else 0


@lru_cache(maxsize=4096)
def _root_decision(sampler: Sampler, trace_id: int, root_tag: str) -> tuple[bool, TraceState | None]:
    result = sampler.should_sample(None, sampling_id(trace_id), root_tag)
    return result.decision.is_sampled(), result.trace_state or None


def trace_decision(
    sampler: Sampler | None,
    trace_id: int,
    root_tag: str,
    remote_parent: SpanContext | None = None,
) -> tuple[bool, TraceState | None]:
    """The sampler's decision for a whole Dask trace, and the trace state it
    returned (None: it returned none, or an empty one).

    ``root_tag`` is the root Dask span's first tag (``Span.name[0]``), which every
    task of the trace knows from its ``span`` annotation. A root trace is sampled
    on :func:`sampling_id`, with a cached decision (a bounded LRU: asking per task
    costs a dict lookup). A trace that continues a caller's is sampled as any
    child of a remote parent, so that ``parentbased_*`` samplers follow the
    caller. Without a sampler (a client with only the OTel API): the caller's
    flag, or sampled.
    """
    if sampler is None:
        return remote_parent is None or remote_parent.trace_flags.sampled, None
    if remote_parent is None:
        return _root_decision(sampler, trace_id, root_tag)
    context = trace.set_span_in_context(trace.NonRecordingSpan(remote_parent))
    result = sampler.should_sample(context, remote_parent.trace_id, root_tag)
    return result.decision.is_sampled(), result.trace_state or None


def trace_sampled(
    sampler: Sampler | None,
    trace_id: int,
    root_tag: str,
    remote_parent: SpanContext | None = None,
) -> bool:
    """The sampler's decision for a whole Dask trace (:func:`trace_decision`)"""
    return trace_decision(sampler, trace_id, root_tag, remote_parent)[0]


def dask_span_context(
    root_id: str,
    span_id: str,
    root_tag: str,
    remote_parent: SpanContext | None,
    sampler: Sampler | None,
    *,
    is_remote: bool,
    forced: bool | None = None,
) -> SpanContext:
    """The OTel SpanContext of Dask span ``span_id`` in the tree of root ``root_id``
    (whose first tag is ``root_tag``), continuing ``remote_parent`` if the root
    does: the one composition of the rules in the module docstring. ``forced``:
    the client's ``sampled=`` for the trace (None: the sampler decides)."""
    trace_id = trace_id_of(root_id, remote_parent)
    if forced is None:
        sampled, state = trace_decision(sampler, trace_id, root_tag, remote_parent)
    else:
        sampled, state = forced, None
    if remote_parent is not None:
        flags = remote_parent.trace_flags & ~TraceFlags.SAMPLED
        state = state or remote_parent.trace_state
    else:
        flags = root_flags(root_id)
    return SpanContext(
        trace_id,
        otel_span_id(span_id),
        is_remote=is_remote,
        trace_flags=TraceFlags(flags | TraceFlags.SAMPLED if sampled else flags),
        trace_state=state,
    )


def child_context(parent: SpanContext, span_id: int) -> SpanContext:
    """The SpanContext, with id ``span_id``, of a span the current process makes
    and exports as a child of a sampled Dask span's ``parent``: its trace, its
    trace flags (sampled) and its trace state"""
    return SpanContext(
        parent.trace_id, span_id, is_remote=False,
        trace_flags=TraceFlags(parent.trace_flags | TraceFlags.SAMPLED),
        trace_state=parent.trace_state,
    )
