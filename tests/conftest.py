"""Fixtures only (and the order tests start in); the harness they use is the
package tests.support"""

from __future__ import annotations

import pytest

import dask_otel.log
from tests.support.cluster import otel_cluster

# caplog listens on the root logger. distributed, imported here before pytest set it
# up, keeps its lines to its own handler, and the bridge's logger follows it
# (dask_otel/log.py): let the bridge's lines reach caplog as well.
dask_otel.log.logger.propagate = True


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
    """An otel_cluster with the defaults: yields (client, mirrored)"""
    with otel_cluster() as (client, mirrored):
        yield client, mirrored


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (minutes, or most of one) start first: the other test
    processes of pytest-xdist run the rest meanwhile, instead of waiting at the end
    for the one that drew a slow test last"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
