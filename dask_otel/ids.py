"""OTel ids of Dask spans, computable in any process without a message.

Needs nothing but the standard library, so that the client side
(:mod:`dask_otel.client`) runs with only ``opentelemetry-api`` installed.
"""

from __future__ import annotations

import uuid
from typing import Any

#: The low 64 bits of a 128-bit id: a Dask span's OTel span id
LOW_64 = (1 << 64) - 1


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


def trace_id_of(root_id: str, remote_parent: Any = None) -> int:
    """The trace id of a Dask span tree: the caller's trace (``remote_parent``, the
    SpanContext its root continues) if any, else its root span's UUID"""
    return remote_parent.trace_id if remote_parent is not None else dask_uuid(root_id)


def root_span(span: Any) -> Any:
    """The root of a Dask span's tree (``Span.parent`` up): its trace"""
    while (parent := span.parent) is not None:
        span = parent
    return span
