"""The installed distribution's version, for instrumentation scopes and meters.

Its own module so that no module of the package imports the package ``__init__``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dask-otel")
except PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0+unknown"
