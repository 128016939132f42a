"""dask_otel's tests: real clusters, real exporters, real receivers and backends.

The harness they share is the package :mod:`tests.support`; ``conftest.py`` holds
only pytest fixtures.
"""
