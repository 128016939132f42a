"""Properties every span of a received trace must have, checked over all of them.

Spans come from different places (the SDK's in-memory exporter, the OTLP test
receiver, Phoenix); :func:`as_node` turns each into one shape first.
:func:`check_span_tree` checks SDK spans of any number of traces;
:func:`assert_one_whole_trace` one whole trace from any source.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: Clock resolution slack: Phoenix stores microseconds, the SDK nanoseconds
SLACK_NS = 1_000
#: How late a root Dask span may end after the caller's span: Dask times tasks on
#: the worker and shifts them by an estimated worker-to-scheduler clock offset
#: (``Worker.scheduler_delay``), off by up to a network round trip even on one
#: host, so a caller that ends the moment ``compute()`` returns can end first
DASK_CLOCK_SLACK_NS = 50_000_000


@dataclass(frozen=True)
class Node:
    """One span: hex ids, times in integer nanoseconds since the epoch"""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int


def as_node(span: Any) -> Node:
    """A Node from an SDK ``ReadableSpan``, an OTLP receiver ``ReceivedSpan`` or a
    Phoenix span dict (tests/backends.py ``normalise_phoenix_span``)"""
    if isinstance(span, dict):  # Phoenix
        return Node(span["trace_id"], span["span_id"], span["parent_id"], span["name"],
                    span["start_time_unix_nano"], span["end_time_unix_nano"])
    if hasattr(span, "context"):  # SDK ReadableSpan
        return Node(
            f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}",
            f"{span.parent.span_id:016x}" if span.parent else None, span.name,
            span.start_time, span.end_time,
        )
    return Node(span.trace_id, span.span_id, span.parent_span_id, span.name,  # receiver
                round(span.start * 1e9), round(span.end * 1e9))


def assert_one_whole_trace(
    spans: list[Any], root_parent: str | None = None, dask_roots: tuple[str, ...] = ()
) -> dict[str, Node]:
    """One trace id; unique span ids; every parent present (but the root's, which
    may be ``root_parent``); every child inside its parent in time. The spans
    named in ``dask_roots`` (root Dask spans under a caller's span) may end up to
    ``DASK_CLOCK_SLACK_NS`` after their parent. Returns the spans by span id."""
    nodes = [as_node(s) for s in spans]
    assert nodes, "no spans"
    assert len({n.trace_id for n in nodes}) == 1, Counter(n.trace_id for n in nodes)
    duplicates = [i for i, c in Counter(n.span_id for n in nodes).items() if c > 1]
    assert not duplicates, f"span ids used twice: {duplicates}"
    by_id = {n.span_id: n for n in nodes}
    roots = [n for n in nodes if n.parent_id is None or n.parent_id == root_parent]
    assert len(roots) == 1, f"roots: {roots}"
    for n in nodes:
        assert n.start_ns <= n.end_ns, n
        if n in roots:
            continue
        parent = by_id.get(n.parent_id)
        assert parent is not None, f"parent of {n.name} ({n.span_id}) missing"
        assert parent.start_ns <= n.start_ns + SLACK_NS, f"{n.name} starts before its parent {parent.name}"
        slack = DASK_CLOCK_SLACK_NS if n.name in dask_roots else SLACK_NS
        assert n.end_ns <= parent.end_ns + slack, f"{n.name} ends after its parent {parent.name}"
    return by_id


def check_span_tree(spans: Iterable[Any], *, inside: bool = True) -> None:
    """Every span of SDK ``ReadableSpan``s has a unique id, its parent (if any)
    among them, in the same trace, and (``inside``) lies within its parent's time"""
    spans = list(spans)
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    assert len(by_id) == len(spans), "two spans share an id"
    for s in spans:
        if s.parent is None:
            continue
        parent = by_id.get((s.context.trace_id, s.parent.span_id))
        assert parent is not None, f"{s.name!r}: parent {s.parent.span_id:016x} not exported"
        if inside:
            assert parent.start_time <= s.start_time <= s.end_time <= parent.end_time, (
                f"{s.name!r} [{s.start_time}, {s.end_time}] is not inside {parent.name!r} "
                f"[{parent.start_time}, {parent.end_time}]"
            )
