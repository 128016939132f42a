"""Shared fixtures: real LocalClusters with the bridge switched on by the preload key"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster
from opentelemetry.attributes import BoundedAttributes

import dask_otel.log

# caplog listens on the root logger. distributed, imported here before pytest set it
# up, keeps its lines to its own handler, and the bridge's logger follows it
# (dask_otel/log.py): let the bridge's lines reach caplog as well.
dask_otel.log.logger.propagate = True

#: Dask config that switches the bridge on with spans kept in memory on the scheduler
#: and a short export delay, so that tests do not wait seconds per span
MEMORY_CONFIG = {
    "distributed.scheduler.preload": ["dask_otel"],
    "otel.traces.exporter": "memory",
    "otel.metrics.exporter": "none",
    "otel.spans.export-delay": "200ms",
    "otel.spans.poll-interval": "100ms",
}


def wait_until(predicate: Callable[[], Any], timeout: float = 20, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``"""
    deadline = time.monotonic() + timeout
    while True:
        if result := predicate():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.05)


class Mirrored:
    """What the bridge exported from one LocalCluster, read from its in-memory
    exporter on the scheduler (LocalCluster runs the scheduler in this process)"""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.plugin = cluster.scheduler.plugins["dask-otel"]

    @property
    def in_memory(self) -> bool:
        """Whether spans went to the in-memory exporter (and so can be read)"""
        telemetry = self.plugin.telemetry
        return telemetry is not None and [
            type(e).__name__ for e in telemetry.span_exporters
        ] == ["InMemorySpanExporter"]

    def spans(self) -> list:
        (exporter,) = self.plugin.telemetry.span_exporters
        return list(exporter.get_finished_spans())

    def by_dask_id(self, dask_id: str, timeout: float = 20):
        """The OTel span mirroring the Dask span ``dask_id``, waiting for its export"""
        span_id = int(dask_id.replace("-", ""), 16) & ((1 << 64) - 1)

        def find():
            return next((s for s in self.spans() if s.context.span_id == span_id), None)

        return wait_until(find, timeout, f"the span of Dask span {dask_id}")

    def children(self, parent) -> list:
        return sorted(
            (s for s in self.spans() if s.parent and s.parent.span_id == parent.context.span_id),
            key=lambda s: (s.start_time, s.name),
        )


def _tree_view(s: Any) -> tuple[int, int, int | None, int, int, str]:
    """(trace id, span id, parent id, start ns, end ns, name) of an SDK
    ``ReadableSpan`` or of a span the OTLP receiver decoded"""
    if hasattr(s, "context"):
        # A remote parent (the caller's span a trace joined) is not the bridge's
        parent = s.parent.span_id if s.parent is not None and not s.parent.is_remote else None
        return s.context.trace_id, s.context.span_id, parent, s.start_time, s.end_time, s.name
    parent = int(s.parent_span_id, 16) if s.parent_span_id else None
    return (
        int(s.trace_id, 16), int(s.span_id, 16), parent,
        round(s.start * 1e9), round(s.end * 1e9), s.name,
    )


def assert_well_formed(spans: list) -> None:
    """What holds for every span the bridge exports, in export order: unique span
    ids; events and links with ``BoundedAttributes``; start <= end; a parent
    present in the same trace (unless remote); a span exported before its parent
    lies within it (start and end); one exported after it (work that ran after the
    parent's export) starts no earlier than it."""
    views = [_tree_view(s) for s in spans]
    for s in (s for s in spans if hasattr(s, "context")):  # the SDK's spans
        # As the SDK's own spans have them: an exporter may read
        # .attributes.dropped off each (the OTLP encoder of opentelemetry-sdk 1.25 did)
        for item in (*s.events, *s.links):
            assert isinstance(item.attributes, BoundedAttributes), (s.name, item)
    by_id: dict[int, tuple[int, tuple]] = {}
    for i, v in enumerate(views):
        assert v[1] not in by_id, f"two spans share the id of {v[5]!r}"
        by_id[v[1]] = (i, v)
    for i, (trace_id, _, parent_id, start, end, name) in enumerate(views):
        assert start <= end, name
        if parent_id is None:
            continue
        assert parent_id in by_id, f"the parent of {name!r} was not exported"
        j, parent = by_id[parent_id]
        assert parent[0] == trace_id, name
        assert start >= parent[3], f"{name!r} starts before {parent[5]!r}"
        if i < j:
            assert end <= parent[4], (
                f"{name!r} ends {(end - parent[4]) / 1e6:.1f} ms after its parent {parent[5]!r}"
            )


@contextlib.contextmanager
def otel_cluster(config: dict | None = None, **cluster_kwargs: Any) -> Iterator[tuple[Client, Mirrored]]:
    """A LocalCluster with the bridge on; yields a client and what was mirrored"""
    kwargs = dict(
        n_workers=2,
        threads_per_worker=1,
        processes=False,
        dashboard_address=":0",
    )
    kwargs.update(cluster_kwargs)
    if kwargs["processes"]:
        kwargs.setdefault("host", "127.0.0.1")
    with dask.config.set({**MEMORY_CONFIG, **(config or {})}):
        with LocalCluster(**kwargs) as cluster, Client(cluster) as client:
            mirrored = Mirrored(cluster)
            yield client, mirrored
    # Everything is exported now, the open spans by the scheduler's close
    if mirrored.in_memory:
        assert_well_formed(mirrored.spans())


@pytest.fixture(autouse=True)
def telemetry_released():
    """Every test leaves no Telemetry behind: the last Dask server of a process that
    closes must flush and shut the SDK providers down."""
    from dask_otel.export.telemetry import Telemetry

    yield
    leaked = Telemetry._current
    Telemetry._current, Telemetry._users = None, 0
    if leaked is not None:
        leaked.shutdown()
        pytest.fail("a test left dask_otel's Telemetry acquired (a server did not close)")


@pytest.fixture
def cluster():
    with otel_cluster() as (client, mirrored):
        yield client, mirrored
