"""Fixtures only (and the order tests start in); the harness they use is the
package tests.support"""

from __future__ import annotations

import dask
import pytest

import dask_otel.log
from tests.support import oracle
from tests.support.cluster import otel_cluster

# caplog listens on the root logger. distributed, imported here before pytest set it
# up, keeps its lines to its own handler, and the bridge's logger follows it
# (dask_otel/log.py): let the bridge's lines reach caplog as well.
dask_otel.log.logger.propagate = True

# The oracle counts the tasks graphs ran from the scheduler's transition log (1,000
# entries by default): keep all of a test's
dask.config.set({oracle.LOG_LENGTH_KEY: oracle.LOG_LENGTH})


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


@pytest.fixture(autouse=True)
def dask_is_the_oracle():
    """After every test that ran a cluster, Dask's own record against everything
    the bridge exported (tests/support/oracle.py): clusters of ``otel_cluster`` and
    ``dask_processes`` as they close, any other scheduler of this process here"""
    import os

    from distributed import Scheduler

    oracle.current = whole = oracle.Oracle()
    before = set(Scheduler._instances)
    try:
        yield whole
        whole.finish([s for s in list(Scheduler._instances) if s not in before], os.environ)
        whole.assert_whole()
    finally:
        oracle.current = None


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
