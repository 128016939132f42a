"""Client side: :func:`span`, a drop-in for ``distributed.span`` that continues the
caller's OpenTelemetry trace; it writes the client's half of the wire contract
(:mod:`dask_otel.annotation`). Inside the block the current OTel span is the Dask
span as the scheduler exports it; with no client, a closed one or a scheduler
without the bridge, nothing changes and nothing is raised. opentelemetry-api only.
The manual: README.md, "One trace from the request to the task"; docs/traces.md,
"A dask_otel.span block" and "One workflow's controls".
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import dask
import distributed
from opentelemetry import context as otel_context
from opentelemetry import trace

from dask_otel._compat import on_graph_sent
from dask_otel.annotation import (ANNOTATION, BLOCK_EXIT, block_exit, forced_sampling,
                                  remote_parent, write_annotation)
from dask_otel.config import KEEP_RULES, parse_labels, parse_task_rules
from dask_otel.span_context import dask_span_context, in_context

__all__ = ["span"]

#: Open blocks by Dask span id: the first client per scheduler address that sent a graph under each
_sent: dict[str, dict[str, distributed.Client]] = {}


@contextmanager
def span(*tags: str, sampled: bool | None = None, tasks: Mapping[str, Any] | None = None,
         workflow: bool = False, attributes: Mapping[str, Any] | None = None,
         keep: Mapping[str, Any] | None = None) -> Iterator[str]:
    """Open Dask spans, as ``distributed.span(*tags)``, that continue the caller's OTel
    trace; yields the UUID of the innermost one.

    ``sampled``: True keeps, False drops, this workflow's whole trace whatever the sampler
    says (a root block's choice). ``tasks``: ``otel.tasks.*`` keys by their last part
    (``{"spans": True, "slower-than": "500ms"}``) for this block's tasks, over the workers'
    config; nested blocks inherit and override them. ``workflow``: the root block's name is
    a bounded workflow name. ``attributes``: labels on every span of the block, inherited and
    overridden as ``tasks``. ``keep``: ``otel.traces.keep.*`` keys by their last part
    (``{"erred": True, "slower-than": "10m"}``) for this run, over the scheduler's config
    (a root block's choice). A bad value raises TypeError or ValueError at the call, naming it."""
    entered_at = time.time()
    outer = dask.get_annotations()
    rules, labels, keep = _check_controls(outer, sampled, tasks, workflow, attributes, keep)
    caller = otel_context.get_current()
    with distributed.span(*tags) as span_id:
        span_annotation = dask.get_annotations()["span"]
        ids, name = span_annotation["ids"], span_annotation["name"]
        otel = write_annotation(outer, ids[-len(tags):], entered_at, caller,
                                sampled=sampled, tasks=rules, workflow=workflow,
                                attributes=labels, keep=keep)
        # The Dask span as the scheduler exports it; is_remote: it lives there
        sampler = getattr(trace.get_tracer_provider(), "sampler", None)  # the SDK's, if any
        context = dask_span_context(ids[0], ids[-1], name[0], remote_parent(otel.get("carrier")),
                                    sampler, is_remote=True, forced=forced_sampling(otel, ids[0]))
        token = otel_context.attach(in_context(context, caller))
        sent = _sent[span_id] = {}
        try:
            with dask.annotate(**{ANNOTATION: otel}):
                yield span_id
        finally:
            otel_context.detach(token)
            del _sent[span_id]
            _announce_exit(block_exit(span_annotation, len(tags), otel, time.time()), sent)


def _check_controls(outer: Mapping[str, Any], sampled: Any, tasks: Any, workflow: Any,
                    attributes: Any, keep: Any) -> tuple[dict[str, Any] | None, ...]:
    """The block's controls checked at the call, by the parsers their readers use:
    ``tasks`` (the ``otel.tasks.*`` keys'), ``attributes`` and ``keep`` (the
    ``otel.traces.keep.*`` keys'), each None if not given"""
    nested = "span" in outer
    if sampled is not None and not isinstance(sampled, bool):
        raise TypeError(f"sampled: expected True, False or None, got {sampled!r}")
    if not isinstance(workflow, bool):
        raise TypeError(f"workflow: expected True or False, got {workflow!r}")
    if nested and workflow:
        raise ValueError("workflow=True: only a root block (in no other Dask span) names a "
                         "workflow; its outcome is its root span's")
    if nested and sampled is not None:
        inherited = (outer.get(ANNOTATION) or {}).get("sampled")
        if sampled is not inherited:
            raise ValueError(f"sampled={sampled!r}: a nested block is in its root's trace, which "
                             f"the root block decides (it said {inherited!r})")
    if nested and keep is not None:  # the run's, so its root block's
        raise ValueError(f"keep={keep!r}: only a root block (in no other Dask span) says "
                         "what of its run is kept")
    return (None if tasks is None else parse_task_rules(tasks),
            None if attributes is None else parse_labels(attributes),
            None if keep is None else parse_task_rules(keep, table=KEEP_RULES, arg="keep"))


def _graph_sent(client: distributed.Client) -> None:
    """``client`` sends a graph: under the open blocks its span annotation names"""
    for span_id in (dask.get_annotations().get("span") or {}).get("ids", ()):
        if (clients := _sent.get(span_id)) is not None:
            clients.setdefault(client.scheduler.address, client)


on_graph_sent(_graph_sent)  # once, as this module is imported


def _announce_exit(msg: dict, sent: dict[str, distributed.Client]) -> None:
    """Send a block's exit to the schedulers its graphs went to (none: the
    default client's, which exports it as a block that ran no task), on each
    client's event loop, without waiting; whatever goes wrong is dropped"""
    try:
        for client in list(sent.values()) or [distributed.client.default_client()]:
            if client.status == "running" and client.loop is not None:
                # Sent before this client closes: the scheduler tells a late exit
                # from a block its client left open (dask_otel.scheduler.blocks)
                client.loop.add_callback(_send_exit, client, {**msg, "client": client.id,
                                                              "graphs": bool(sent)})
    except Exception:  # no client (no graph of this block reached a scheduler), or other
        pass  # telemetry never fails the caller


async def _send_exit(client: distributed.Client, msg: dict) -> None:
    try:
        await client.scheduler.log_event(topic=BLOCK_EXIT, msg=msg)
    except Exception:
        pass  # the client closed meanwhile, or the scheduler went away
