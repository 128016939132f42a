"""One sampling decision per Dask trace, the same in every process that asks.

The scheduler mirrors a trace's spans when they finish; workers (task spans, the
context code inside a task runs in) need the same decision before. No message
carries it: every process asks its own sampler (``OTEL_TRACES_SAMPLER``, which
should be set alike on the scheduler and the workers) the same question, with
nothing but what a task already knows: the trace id, the root span's first tag,
and the remote parent that came with the graph, if any.

A Dask trace id is a uuid4, whose variant bits make its low 64 bits always start
with binary ``10``: the SDK's ``TraceIdRatioBased`` sampler, which compares those
64 bits with ``ratio * 2**64``, would keep 0 % or 100 % of Dask traces for most
ratios. A root Dask trace is therefore sampled on :func:`sampling_id`, the trace
id with its low 64 bits replaced by a hash of the whole id: uniform, and the same
everywhere. The exported trace id stays the root span's UUID.

A Dask trace that joined a caller's trace (a remote parent, see
:mod:`dask_otel.client`) is sampled as any child of a remote parent: with the
parent in the context and the caller's own, well-distributed trace id, so that
``parentbased_*`` samplers follow the caller's decision.
"""

from __future__ import annotations

from functools import lru_cache
from hashlib import blake2b
from typing import TYPE_CHECKING

from opentelemetry import trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import SpanContext

_LOW_64 = (1 << 64) - 1


def sampling_id(trace_id: int) -> int:
    """The id a root Dask trace is sampled on: its high 64 bits, and a hash of the
    whole id as low 64 bits (what ``TraceIdRatioBased`` compares)"""
    digest = blake2b(trace_id.to_bytes(16, "big"), digest_size=8).digest()
    return (trace_id & ~_LOW_64) | int.from_bytes(digest, "big")


@lru_cache(maxsize=4096)
def _root_sampled(sampler: Sampler, trace_id: int, root_tag: str) -> bool:
    result = sampler.should_sample(None, sampling_id(trace_id), root_tag)
    return result.decision.is_sampled()


def trace_sampled(
    sampler: Sampler,
    trace_id: int,
    root_tag: str,
    remote_parent: SpanContext | None = None,
) -> bool:
    """The sampler's decision for a whole Dask trace.

    ``root_tag`` is the root Dask span's first tag (``Span.name[0]``), which every
    task of the trace knows from its ``span`` annotation. Decisions on roots are
    cached (a bounded LRU), so that asking per task costs a dict lookup.
    """
    if remote_parent is None:
        return _root_sampled(sampler, trace_id, root_tag)
    context = trace.set_span_in_context(trace.NonRecordingSpan(remote_parent))
    result = sampler.should_sample(context, remote_parent.trace_id, root_tag)
    return result.decision.is_sampled()
