"""Every version switch and every private attribute of Dask or OpenTelemetry the
bridge reads, one line each, with the version that needs it (distributed's habit:
``distributed/compatibility.py``).

The floor is ``pyproject.toml``'s: distributed 2024.1.0, opentelemetry 1.41.
Nothing here serves a version below it. When the floor moves, delete what it
makes dead; a private name a new release drops fails the tripwire tests in
``tests/test_compat.py``, not a user's cluster.
"""

from __future__ import annotations

import functools
import logging


# --- distributed: versions ------------------------------------------------------



# --- distributed: private attributes ---------------------------------------------



# --- OpenTelemetry SDK ------------------------------------------------------------

# The outage policy's one adapter (dask_otel/export/accounting.py). The SDK's OTLP
# exporters (gRPC and HTTP) retry a failed export inside export() until their timeout,
# and offer no public way to stop that cycle
# (https://github.com/open-telemetry/opentelemetry-python/issues/3815, /issues/4331).
# In 1.41 to 1.45 each logs a WARNING on the export thread just before its backoff
# wait, which its public shutdown() ends ("Shutdown in progress, aborting retry").
# The adapter is that record's level and logger, never its text; above the versions
# tested, the policy runs on what is public (the exporter's timeout, FAILURE).
# tests/test_compat.py::test_sdk_* trips when a release changes it.


@functools.cache
def sdk_version() -> tuple[int, ...]:
    from opentelemetry.sdk.version import __version__

    return tuple(int(part) for part in __version__.split(".")[:2] if part.isdigit())


#: The SDK versions whose exporters announce a retry as above (the floor to 1.45)
RETRY_ANNOUNCED_UP_TO = (1, 45)


def announces_retry(record: logging.LogRecord) -> bool:
    """An OTLP exporter of opentelemetry-sdk 1.41 to 1.45 is about to wait before
    retrying the export under way in this thread"""
    return record.levelno == logging.WARNING and record.name.startswith(
        "opentelemetry.exporter"
    )


