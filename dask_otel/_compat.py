"""Every version switch and every private attribute of Dask or OpenTelemetry the
bridge reads, one line each, with the version that needs it (distributed's habit:
``distributed/compatibility.py``).

The floor is ``pyproject.toml``'s: distributed 2024.1.0, opentelemetry 1.41.
Nothing here serves a version below it. When the floor moves, delete what it
makes dead; a private name a new release drops fails the tripwire tests in
``tests/test_compat.py``, not a user's cluster.
"""

from __future__ import annotations


# --- distributed: versions ------------------------------------------------------



# --- distributed: private attributes ---------------------------------------------



# --- OpenTelemetry SDK ------------------------------------------------------------



