"""Properties that must hold for every span a test receives"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


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
