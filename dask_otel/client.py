"""Client side: a Dask span that continues the caller's OpenTelemetry trace.

``dask_otel.span(*tags)`` is a drop-in for ``distributed.span``: same signature,
same yield (the Dask span's UUID), same nesting, and it opens a real Dask span.
It adds two things:

- The caller's current OTel context travels with the graph, as the task
  annotation ``otel`` (:mod:`dask_otel.annotation`), so that the scheduler
  parents the root Dask span under the caller's span, in the caller's trace, and
  samples it as a parent-based sampler would.
- Inside the ``with`` block the current OTel span is the Dask span itself (a
  ``NonRecordingSpan`` with the ids the scheduler exports it with), so that
  client-side instrumented calls (HTTP, database) nest under it. The caller's
  baggage stays in the context.
- On leaving the block it tells the scheduler, with one event sent without
  waiting (:data:`dask_otel.annotation.BLOCK_EXIT`), so that the Dask span covers
  the block as well as its tasks, and a block that ran no task is exported too.
  Without a client, with a closed one or with a scheduler without the bridge,
  nothing changes and nothing is raised.

Usage::

    from opentelemetry import trace
    import dask_otel

    tracer = trace.get_tracer("my-service")
    with tracer.start_as_current_span("POST /reports"):
        with dask_otel.span("nightly report") as sid:
            df.map_partitions(score).compute()

How the trace id is chosen and how the trace is sampled: docs/traces.md.

Needs only ``opentelemetry-api``: nothing here imports the SDK or the scheduler.
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
