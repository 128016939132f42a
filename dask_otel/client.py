"""Client side: :func:`span`, a drop-in for ``distributed.span`` that continues the
caller's OpenTelemetry trace.

It owns the client's half of the wire contract (:mod:`dask_otel.annotation`): the
caller's context written into the block's graphs as the ``otel`` task annotation,
and one event when the block exits (:data:`~dask_otel.annotation.BLOCK_EXIT`), sent
on the client's event loop without waiting. Invariants: it opens real Dask spans and
yields the innermost one's id, as ``distributed.span`` does; inside the block the
current OTel span is the Dask span, with the ids the scheduler exports it with
(:mod:`dask_otel.span_context`), the caller's baggage kept; with no client, a
closed one or a scheduler without the bridge, nothing changes and nothing is
raised. It imports opentelemetry-api only, never the SDK or the scheduler's side
(``tests/test_layout.py``). The manual: README.md, "One trace from the request to
the task", and docs/traces.md, "A dask_otel.span block".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import dask
import distributed
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan

from dask_otel.annotation import (
    ANNOTATION,
    BLOCK_EXIT,
    block_exit,
    remote_parent,
    write_annotation,
)
from dask_otel.span_context import dask_span_context

__all__ = ["span"]


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
        ids, name = span_annotation["ids"], span_annotation["name"]
        otel = write_annotation(outer, ids[-len(tags):], entered_at, caller)
        # The Dask span as the scheduler exports it; is_remote: it lives there
        sampler = getattr(trace.get_tracer_provider(), "sampler", None)  # the SDK's, if any
        context = dask_span_context(
            ids[0], ids[-1], name[0],
            remote_parent(otel.get("carrier")), sampler, is_remote=True,
        )
        token = otel_context.attach(
            trace.set_span_in_context(NonRecordingSpan(context), caller)
        )
        try:
            with dask.annotate(**{ANNOTATION: otel}):
                yield span_id
        finally:
            otel_context.detach(token)
            _announce_exit(block_exit(span_annotation, len(tags), otel, time.time()))


def _announce_exit(msg: dict) -> None:
    """Send a block's exit to the default client's scheduler, without waiting:
    the event goes out on the client's event loop, and whatever goes wrong (no
    client, a closed one, a lost connection) is dropped. A scheduler without the
    bridge keeps it in its event log."""
    try:
        client = distributed.client.default_client()
    except ValueError:  # no client: no graph of this block reached a scheduler
        return
    try:
        if client.status != "running" or client.loop is None:
            return
        client.loop.add_callback(_send_exit, client, msg)
    except Exception:
        pass  # telemetry never fails the caller


async def _send_exit(client: distributed.Client, msg: dict) -> None:
    try:
        await client.scheduler.log_event(topic=BLOCK_EXIT, msg=msg)
    except Exception:
        pass  # the client closed meanwhile, or the scheduler went away
