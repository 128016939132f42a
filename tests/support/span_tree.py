"""The one span-tree checker: what holds for every span the bridge exports, from
any of the places spans are read back.

Spans come from the SDK's in-memory exporter (``ReadableSpan``), the OTLP test
receiver (:class:`tests.support.otlp_receiver.ReceivedSpan`) or Jaeger (a dict
of :func:`tests.support.backends.normalise_jaeger_span`); :func:`as_node` turns
each into one shape first. :func:`assert_span_tree` checks them all at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.attributes import BoundedAttributes

#: Clock resolution of Jaeger, which keeps a span's start and its duration in
#: microseconds each (the SDK and OTLP carry nanoseconds): how far a span read
#: from Jaeger may seem to start before, or end after, its parent
JAEGER_SLACK_NS = 2_000
#: How late a root Dask span may end after the caller's span: the mirror bounds
#: every task time by the scheduler's own clock (sent, heard back), so on one
#: host a root ends before the call that waited for its results returns; the
#: slack is only for the float seconds -> integer nanoseconds conversions
DASK_CLOCK_SLACK_NS = 1_000_000


@dataclass(frozen=True)
class Node:
    """One span: hex ids, times in integer nanoseconds since the epoch"""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    #: The parent is another process's span (an SDK span's ``parent.is_remote``);
    #: False where the source does not say (OTLP, Jaeger)
    remote_parent: bool = False
    #: How coarse the source's clock is: the slack for comparing times
    resolution_ns: int = 0


def as_node(span: Any) -> Node:
    """A Node from an SDK ``ReadableSpan``, an OTLP receiver ``ReceivedSpan`` or a
    Jaeger span dict"""
    if isinstance(span, Node):
        return span
    if isinstance(span, dict):  # Jaeger
        return Node(span["trace_id"], span["span_id"], span["parent_id"], span["name"],
                    span["start_time_unix_nano"], span["end_time_unix_nano"],
                    resolution_ns=JAEGER_SLACK_NS)
    if hasattr(span, "context"):  # SDK ReadableSpan
        parent = span.parent
        return Node(
            f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}",
            f"{parent.span_id:016x}" if parent else None, span.name,
            span.start_time, span.end_time, remote_parent=bool(parent and parent.is_remote),
        )
    # OTLP receiver: float seconds, converted monotonically (order is kept)
    return Node(span.trace_id, span.span_id, span.parent_span_id, span.name,
                round(span.start * 1e9), round(span.end * 1e9))


def assert_span_tree(
    spans: Iterable[Any],
    *,
    ends: Literal["inside", "inside-if-exported-first", "anywhere"] = "inside",
    one_trace: bool = False,
    root_parent: str | None = None,
    dask_roots: Collection[str] = (),
) -> dict[str, Node]:
    """Check a list of spans, in the order they were exported or received:

    - SDK spans carry their events' and links' attributes as ``BoundedAttributes``,
      as the SDK's own spans do (an exporter may read ``.attributes.dropped`` off
      each: the OTLP encoder of opentelemetry-sdk 1.25 did);
    - no two spans share a span id; every span starts no later than it ends;
    - every parent is among the spans, in the same trace, except a caller's span
      the trace joined: a remote parent of an SDK span, or ``root_parent``;
    - every child starts no earlier than its parent (a parent that is present,
      remote or not), give or take the source's clock resolution;
    - ``ends``: every child ends no later than its parent (``"inside"``); only a
      child exported before its parent (``"inside-if-exported-first"``: work that
      ran after the parent's export is a later child, which may end after it);
      or anywhere (``"anywhere"``: an erred task, whose time Dask's ``Span.stop``
      ignores). The spans named in ``dask_roots`` (root Dask spans under a
      caller's span) may end up to ``DASK_CLOCK_SLACK_NS`` after their parent;
    - ``one_trace``: the spans are one whole trace: there is at least one, all of
      one trace id, with one root (no parent, or ``root_parent``).

    Returns the spans as :class:`Node` by span id.
    """
    spans = list(spans)
    for s in spans:
        if hasattr(s, "context"):  # the SDK's spans
            for item in (*s.events, *s.links):
                assert isinstance(item.attributes, BoundedAttributes), (s.name, item)
    nodes = [as_node(s) for s in spans]
    duplicates = [i for i, c in Counter(n.span_id for n in nodes).items() if c > 1]
    assert not duplicates, f"span ids used twice: {duplicates}"
    by_id = {n.span_id: n for n in nodes}
    order = {n.span_id: i for i, n in enumerate(nodes)}
    if one_trace:
        assert nodes, "no spans"
        assert len({n.trace_id for n in nodes}) == 1, Counter(n.trace_id for n in nodes)
        roots = [n for n in nodes if n.parent_id is None or n.parent_id == root_parent]
        assert len(roots) == 1, f"roots: {roots}"
    for n in nodes:
        assert n.start_ns <= n.end_ns, n
        if n.parent_id is None:
            continue
        parent = by_id.get(n.parent_id)
        if parent is None:
            absent_ok = n.parent_id == root_parent or (n.remote_parent and not one_trace)
            assert absent_ok, f"the parent of {n.name!r} ({n.span_id}) was not exported"
            continue
        assert parent.trace_id == n.trace_id, f"{n.name!r} is in another trace than its parent"
        slack = max(n.resolution_ns, parent.resolution_ns)
        assert parent.start_ns <= n.start_ns + slack, (
            f"{n.name!r} starts before its parent {parent.name!r}"
        )
        if ends == "anywhere" or (
            ends == "inside-if-exported-first" and order[n.span_id] > order[parent.span_id]
        ):
            continue
        if n.name in dask_roots:
            slack = max(slack, DASK_CLOCK_SLACK_NS)
        assert n.end_ns <= parent.end_ns + slack, (
            f"{n.name!r} ends {(n.end_ns - parent.end_ns) / 1e6:.1f} ms after its parent "
            f"{parent.name!r}"
        )
    return by_id
